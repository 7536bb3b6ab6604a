"""`eldr serve-proxy --state ...` as users run Redis: password (URL, env, file), ACL user, TLS with a
verified server (a real TLS redis-server from `make deps-system`; certificates GENERATED here), and the
start-up errors: exit 2 before the banner, one message naming the option."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import redis as redis_py
from _tls_util import make_ca_and_server_cert

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.testing.ports import free_port
from eldr_cli.testing.servers import ServerThread, wait_http

PASSWORD = "redis-pass-2"
KEY = "82ede722e3a231f95522611cfb340cfe0a81822e0ff672180cba483159ca2dd6"
BASE = ["--policy", "jsq", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]


def _run(args, env=None, timeout=60):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="200")
    for k in ("ELDR_STATE_KEY", "ELDR_ADMIN_TOKEN", "ELDR_STATE_PASSWORD"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "eldr_cli", "serve-proxy", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def _refused(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "serve-proxy on" not in r.stdout
    errors = [ln for ln in r.stderr.splitlines() if ln.lower().startswith("error")]
    assert len(errors) == 1, r.stderr
    for n in needles:  # in the message or its hint
        assert n in r.stderr, r.stderr


@pytest.fixture(scope="module")
def redis():
    with RedisServer(password=PASSWORD) as r:
        yield r


def _keyfile(tmp_path, text=KEY, mode=0o600):
    p = tmp_path / "state.key"
    p.write_text(text)
    p.chmod(mode)
    return str(p)


@pytest.mark.parametrize("case", ["missing", "empty", "world-readable", "group-readable", "group-writable",
                                  "directory", "short", "128-bit hex", "repetitive"])
def test_bad_key_file_is_refused_before_the_banner(tmp_path, case):
    path = {"missing": lambda: str(tmp_path / "nope"), "empty": lambda: _keyfile(tmp_path, ""),
            "world-readable": lambda: _keyfile(tmp_path, mode=0o644),
            "group-readable": lambda: _keyfile(tmp_path, mode=0o640),
            "group-writable": lambda: _keyfile(tmp_path, mode=0o660), "directory": lambda: str(tmp_path),
            "short": lambda: _keyfile(tmp_path, "short"), "128-bit hex": lambda: _keyfile(tmp_path, KEY[:32]),
            "repetitive": lambda: _keyfile(tmp_path, "ab" * 40)}[case]()
    _refused(_run([*BASE, "--state", "redis://127.0.0.1:1/0", "--state-key-file", path]), "--state-key-file")


@pytest.mark.parametrize("token", ["x", "letmein", "s3cret-admin-token", "0123456789abcdef0123456789abcdef"])
def test_a_weak_admin_token_as_the_only_key_source_is_refused(token):
    r = _run([*BASE, "--state", "redis://127.0.0.1:1/0"], env={"ELDR_ADMIN_TOKEN": token})
    _refused(r, "ELDR_ADMIN_TOKEN", "secrets.token_urlsafe(32)")
    assert token not in r.stderr.replace("ELDR_ADMIN_TOKEN", "")  # the weak token itself is never printed


def test_a_weak_state_key_in_the_environment_is_refused():
    _refused(_run([*BASE, "--state", "redis://127.0.0.1:1/0"], env={"ELDR_STATE_KEY": "correct horse battery"}),
             "ELDR_STATE_KEY", "secrets.token_urlsafe(32)")


def test_secrets_on_the_command_line_are_refused(tmp_path):
    _refused(_run([*BASE, "--admin-token", KEY]), "--admin-token", "ELDR_ADMIN_TOKEN", "--admin-token-file")
    _refused(_run([*BASE, "--state", "redis://:pw@127.0.0.1:1/0"], env={"ELDR_STATE_KEY": KEY}),
             "--state", "ELDR_STATE_PASSWORD", "--state-password-file")
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(f"admin_token: {KEY}\n")
    cfg.chmod(0o644)
    _refused(_run([*BASE, "--config", str(cfg)]), str(cfg), "chmod 600")
    tok = tmp_path / "admin.token"
    tok.write_text(KEY)
    tok.chmod(0o640)
    _refused(_run([*BASE, "--admin-token-file", str(tok)]), "--admin-token-file", "chmod 600")


def test_the_admin_token_from_a_file_opens_the_admin_api_and_signs(redis, tmp_path):
    tok = tmp_path / "admin.token"
    tok.write_text(KEY + "\n")
    tok.chmod(0o600)
    port = free_port()
    proc = _serve([*BASE, "--state", f"redis://{redis.host}:{redis.port}/0", "--admin-token-file", str(tok),
                   "--port", str(port)], {"ELDR_STATE_PASSWORD": PASSWORD})
    try:
        _up(port, proc)
        h = f"http://127.0.0.1:{port}"
        assert httpx.get(h + "/admin/workers", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(h + "/admin/workers", headers={"authorization": "Bearer x"}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)


def test_no_key_says_how_to_set_one():
    r = _run([*BASE, "--state", "redis://127.0.0.1:1/0"])
    _refused(r, "--state")
    assert "ELDR_STATE_KEY" in r.stderr


def test_wrong_password_is_refused_before_the_banner(redis):
    url = f"redis://{redis.host}:{redis.port}/0"
    _refused(_run([*BASE, "--state", url], env={"ELDR_STATE_KEY": KEY, "ELDR_STATE_PASSWORD": "wrong"}),
             "--state", "password")
    r = _run([*BASE, "--state", f"redis://:wrong@{redis.host}:{redis.port}/0"], env={"ELDR_STATE_KEY": KEY})
    _refused(r, "--state", "ELDR_STATE_PASSWORD")  # a password in the URL is on the command line: refused
    assert "wrong" not in r.stderr  # the password is never printed


def test_bad_ca_file_is_refused(tmp_path):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    _refused(_run([*BASE, "--state", "rediss://127.0.0.1:1/0", "--state-ca-file", str(bad)],
                  env={"ELDR_STATE_KEY": KEY}), "--state-ca-file")


def _up(port, proc):
    wait_http(f"http://127.0.0.1:{port}/health", 60, proc=proc)


def _serve(args, env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)
    return subprocess.Popen([sys.executable, "-m", "eldr_cli", "serve-proxy", *args], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def _replicas(h):
    return httpx.get(h + "/health").json()["replicas"]


def test_acl_user_and_password_file(redis, tmp_path):
    admin = redis_py.Redis(host=redis.host, port=redis.port, password=PASSWORD)
    # the ACL of docs/serve-proxy-security.md
    admin.acl_setuser("eldr", enabled=True, passwords=["+acl-pass-1"], keys=["eldr:*"], channels=["eldr:*"],
                      commands=["+@all", "-@admin", "-@dangerous"])
    for cmd in (["EVALSHA", "0" * 40, "1", "eldr:0:reserved", "x"], ["SCRIPT", "LOAD", "return 1"],
                ["EVAL", "return 1", "1", "eldr:0:reserved"], ["HKEYS", "eldr:0:reserved"],
                ["PUBLISH", "eldr:0:x", "m"]):
        assert admin.execute_command("ACL", "DRYRUN", "eldr", *cmd) in (b"OK", "OK"), cmd
    pw = tmp_path / "pw"
    pw.write_text("acl-pass-1\n")
    pw.chmod(0o600)
    ports = [free_port(), free_port()]
    url = f"redis://eldr@{redis.host}:{redis.port}/0"
    procs = [_serve([*BASE, "--state", url, "--state-password-file", str(pw), "--port", str(p)],
                    {"ELDR_STATE_KEY": KEY}) for p in ports]
    try:
        for p, proc in zip(ports, procs, strict=True):
            _up(p, proc)
        t0 = time.monotonic()
        while _replicas(f"http://127.0.0.1:{ports[0]}") != 2 and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert _replicas(f"http://127.0.0.1:{ports[0]}") == 2
        assert admin.keys("eldr:0:inflight:*")  # written as the ACL user, under its allowed prefix
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        admin.close()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_ca_and_server_cert(d)
    other_ca, _, _ = make_ca_and_server_cert(d / "other", "someone-else")
    try:
        srv = RedisServer(password=PASSWORD, tls=(str(cert), str(key))).start()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"no TLS-capable redis-server ({e}); run `make deps-system`")
    yield srv, str(ca), str(other_ca)
    srv.stop()


def test_replicas_share_state_over_tls_with_a_verified_server(tls_redis):
    srv, ca, _ = tls_redis
    url = f"rediss://:{PASSWORD}@127.0.0.1:{srv.port}/0"
    stubs = []
    apps = []
    try:
        for _ in range(2):
            cfg = ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"], policy="jsq",
                              state=url, state_ca_file=ca, admin_token=KEY, health_interval_s=0).validate()
            app = create_app(cfg)
            apps.append(app)
            stubs.append(ServerThread(app).start())
        t0 = time.monotonic()
        while apps[0].state.shared.live_replicas != 2 and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert apps[0].state.shared.live_replicas == 2 and apps[0].state.shared.errors == 0
    finally:
        for s in stubs:
            s.stop()


def test_tls_server_signed_by_another_ca_is_refused(tls_redis):
    srv, _, other_ca = tls_redis
    r = _run([*BASE, "--state", f"rediss://127.0.0.1:{srv.port}/0", "--state-ca-file", other_ca],
             env={"ELDR_STATE_KEY": KEY, "ELDR_STATE_PASSWORD": PASSWORD})
    _refused(r, "--state-ca-file")
    assert PASSWORD not in r.stderr


def test_the_serving_path_imports_nothing_from_testing():
    code = ("import sys, eldr_cli.commands.serve_proxy, eldr_cli.proxy.server, eldr_cli.proxy.app, "
            "eldr_cli.proxy.replicas.redis_server, eldr_cli.proxy.replicas.shared; "
            "print(sorted(m for m in sys.modules if m.startswith('eldr_cli.testing')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_config_file_with_a_secret_is_read_when_only_its_owner_can(tmp_path):
    from eldr_cli.errors import EldrError
    from eldr_cli.proxy.config import build_config

    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(f"admin_token: {KEY}\nprefill: [http://127.0.0.1:9]\ndecode: [http://127.0.0.1:9]\npolicy: jsq\n")
    cfg.chmod(0o600)
    assert build_config(cfg).admin_token == KEY
    cfg.chmod(0o640)
    with pytest.raises(EldrError, match="chmod 600"):
        build_config(cfg)
    cfg.write_text("prefill: [http://127.0.0.1:9]\ndecode: [http://127.0.0.1:9]\npolicy: jsq\n")  # no secret
    assert build_config(cfg).admin_token in (None, os.environ.get("ELDR_ADMIN_TOKEN"))
