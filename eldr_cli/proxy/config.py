"""Proxy configuration: one dataclass, filled from a YAML/TOML file and/or CLI options.

Config file keys are the CLI option names with ``-`` or ``_`` (``--admin-token`` -> ``admin_token``);
CLI options given explicitly win over the file. Secrets never come from the command line (``ps`` shows it
to every user): the admin token from ``$ELDR_ADMIN_TOKEN`` or ``--admin-token-file``, the Redis password
from ``$ELDR_STATE_PASSWORD`` or ``--state-password-file``; a config file holding either must be readable
by its owner only, like every secret file.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eldr_cli.constraints import validate_parameter
from eldr_cli.errors import EldrError
from eldr_cli.routing.prefill import BLOCK_CHARS, BLOCKS, OVERLOAD
from eldr_cli.routing.registry import NEEDS_ROUTING, check_policy


@dataclass
class ProxyConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    routing: str | None = None          # routing (or fit) artifact dir; needed by eldr and domain
    policy: str | None = None           # None: eldr-live (eldr for a routing artifact fitted before it)
    cost_model: str | None = None       # the step cost model eldr-live predicts with (None: relative default)
    tau: float | None = None            # None -> the tau stored in the routing artifact
    seed: int = 0                       # for random / p2c
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None      # None -> env ELDR_ADMIN_TOKEN; unset -> admin endpoints disabled
    admin_token_file: str | None = None  # a file (mode 600) holding the admin token (wins over the env)
    max_body_bytes: int = 4 * 1024 * 1024
    # upstream timeouts (seconds)
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 60.0     # whole prefill leg
    decode_read_timeout_s: float = 300.0  # max silence between two decode chunks
    max_connections_per_worker: int = 1024
    # prefill routing: PrefixHash over the prompt's leading blocks, least-loaded above 1.25x average
    prefix_block_chars: int = BLOCK_CHARS  # 256 (the simulator places prompts with the same)
    prefix_blocks: int = BLOCKS  # 4
    prefill_overload_factor: float = OVERLOAD  # 1.25
    # active health checks
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_path: str = "/health"
    health_fail_threshold: int = 3
    health_success_threshold: int = 2
    # combine in-flight with vllm:num_requests_running scraped from workers' /metrics
    scrape_metrics: bool = False
    # decision log (.jsonl appends; .parquet writes numbered part files) for offline replay
    decision_log: str | None = None
    shadow: list[str] = field(default_factory=list)  # policies that decide beside the live one, logged only
    decision_log_replay: bool = False   # add what a replay / refit needs (arrival, tokens, signature, artifact)
    log_level: str = "info"
    access_log: bool = False
    # several replicas: "local" (this process alone) or redis[s]://[USER@]HOST:PORT[/DB] (shared counts
    # and changes, signed with $ELDR_STATE_KEY / state_key_file / a key derived from the admin token)
    state: str = "local"
    state_key_file: str | None = None
    state_password_file: str | None = None  # else $ELDR_STATE_PASSWORD, else the URL's
    state_ca_file: str | None = None        # CA bundle verifying a rediss:// server
    state_prefix: str = "eldr"              # namespace of every Redis key and channel
    state_reserve_ms: float = 50.0          # atomic select-and-reserve deadline (0: decide locally only)
    workers: int = 1                    # processes behind one port (SO_REUSEPORT)

    def validate(self) -> "ProxyConfig":
        if self.policy is not None:
            check_policy(self.policy, servable=True)
        if not self.prefill:
            raise EldrError("no prefill worker given", hint="pass --prefill URL (repeatable)")
        if not self.decode:
            raise EldrError("no decode worker given", hint="pass --decode URL (repeatable)")
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            for u in urls:
                check_worker_url(u, flag)
        validate_parameter("port", self.port, what="--port")
        validate_parameter("workers", self.workers, what="--workers")
        self._validate_state()
        if (self.policy is None or self.policy in NEEDS_ROUTING) and not self.routing:
            what = f"policy {self.policy!r}" if self.policy else "the default policy (eldr-live)"
            raise EldrError(f"{what} needs a routing artifact",
                            hint="pass --routing DIR, or --policy round-robin|jsq|p2c|random")
        if self.tau is not None:
            self.tau = validate_parameter("tau", self.tau, what="--tau")
        if self.max_body_bytes < 1024:
            raise EldrError("max_body_bytes must be at least 1024")
        if self.health_fail_threshold < 1 or self.health_success_threshold < 1:
            raise EldrError("health thresholds must be >= 1")
        for name in self.shadow:
            check_policy(name, servable=True)
        if self.decision_log:
            check_decision_log_path(str(self.decision_log))
        elif self.decision_log_replay:
            raise EldrError("--decision-log-replay adds fields to the decision log, but no --decision-log is given",
                            hint="pass --decision-log FILE.jsonl (or .parquet) as well")
        self._resolve_admin_token()
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]
        return self

    def _validate_state(self) -> None:
        """The shared-state URL, key, password and CA file: every problem is one message naming its option."""
        from eldr_cli.proxy.replicas.auth import resolve_state_key
        from eldr_cli.proxy.replicas.conn import build_state_conn, check_prefix, parse_state_url

        self.state = parse_state_url(self.state)
        check_prefix(self.state_prefix)
        if isinstance(self.state_reserve_ms, bool) or not isinstance(self.state_reserve_ms, (int, float)) \
                or not 0 <= self.state_reserve_ms <= 1000:
            raise EldrError(f"--state-reserve-ms must be between 0 and 1000, got {self.state_reserve_ms!r}")
        if self.state == "local":
            return
        self._resolve_admin_token()
        resolve_state_key(self.state_key_file, self.admin_token, self.state)
        build_state_conn(self.state, self.state_prefix, self.state_password_file, self.state_ca_file)


    def _resolve_admin_token(self) -> None:
        source = f"--admin-token-file {self.admin_token_file}" if self.admin_token_file else \
            "admin_token" if self.admin_token is not None else ADMIN_TOKEN_ENV
        self.admin_token = admin_token_from(self.admin_token_file, self.admin_token)
        self.admin_token_file = None
        if self.admin_token:
            check_admin_token(self.admin_token, source)


def check_admin_token(token: str, source: str) -> None:
    """An admin token must hold the strength of a state key (:func:`eldr_cli.proxy.replicas.auth.weakness`):
    it guards workers, policy and routing over HTTP, where anyone who reaches the port may guess (issue 36).
    EldrError naming ``source``, never the token."""
    from eldr_cli.proxy.replicas.auth import MAKE_ONE, weakness

    why = weakness(token.encode())
    if why is not None:
        raise EldrError(f"the admin token ({source}) is too weak to guard the admin API: it {why}",
                        hint=f"set {ADMIN_TOKEN_ENV}=$({MAKE_ONE}), or put one in the --admin-token-file "
                             "(mode 600)")


ADMIN_TOKEN_ENV = "ELDR_ADMIN_TOKEN"


def admin_token_from(token_file: str | None, given: str | None = None) -> str | None:
    """The admin token: ``given`` (a config file's), else the ``--admin-token-file`` (mode 600), else
    ``$ELDR_ADMIN_TOKEN``; None when none is set. serve-proxy and the bench's client read it the same way."""
    from eldr_cli.proxy.replicas.auth import read_secret_file

    if token_file:
        if given is not None:
            raise EldrError("give the admin token once: admin_token or --admin-token-file, not both")
        return read_secret_file(token_file, "--admin-token-file").decode()
    return given if given is not None else os.environ.get(ADMIN_TOKEN_ENV) or None


def refuse_command_line_secrets(admin_token: str | None, state: str | None) -> None:
    """A secret given as a command-line value (visible to every user through ``ps``): EldrError naming
    the environment variable or file that replaces it."""
    from urllib.parse import urlsplit

    if admin_token is not None:
        raise EldrError("--admin-token VALUE puts the token on the command line, where `ps` shows it to every "
                        "user of this host", hint=f"set {ADMIN_TOKEN_ENV} or pass --admin-token-file FILE (mode 600)")
    if state is not None and state.startswith(("redis://", "rediss://")):
        try:
            pw = urlsplit(state).password
        except ValueError:
            pw = None
        if pw is not None:
            raise EldrError("--state: the Redis password in the URL would be on the command line, where `ps` "
                            "shows it to every user of this host",
                            hint="drop it from the URL and set ELDR_STATE_PASSWORD or pass --state-password-file "
                                 "FILE (mode 600)")


def check_worker_url(url: str, flag: str) -> None:
    """http://HOST[:PORT] with a host and a port in range; raises EldrError naming the flag."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url.startswith("http://"):
        raise EldrError(f"{flag} {url!r}: worker URLs must start with http:// (the proxy talks plain HTTP to workers)")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise EldrError(f"{flag} {url!r} is not a valid URL: {e}") from None
    if not u.hostname:
        raise EldrError(f"{flag} {url!r} has no host", hint="e.g. http://10.0.0.5:8100")
    if port == 0:
        raise EldrError(f"{flag} {url!r}: port 0 is not a port a worker listens on")


def check_decision_log_path(path: str) -> None:
    """The decision log's suffix and that its folder exists (or can be made) and is writable."""
    if not path.endswith((".jsonl", ".parquet")):
        raise EldrError(f"--decision-log {path!r} must end with .jsonl or .parquet")
    p = Path(path)
    parent = p.parent
    for anc in [parent, *parent.parents]:
        if anc.exists():
            if not anc.is_dir():
                raise EldrError(f"--decision-log {path}: {anc} is a file, not a folder")
            if not os.access(anc, os.W_OK):
                raise EldrError(f"--decision-log {path}: folder {anc} is not writable")
            break
    if p.is_dir():
        raise EldrError(f"--decision-log {path} is a folder; give a file name ending in .jsonl or .parquet")


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a dict of ProxyConfig keys."""
    p = Path(path)
    if not p.is_file():
        raise EldrError(f"config file {p} does not exist")
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(p.read_text()) or {}
        else:
            raise EldrError(f"config file {p} must end with .yaml, .yml or .toml")
    except EldrError:
        raise
    except Exception as e:  # parse errors of either format
        raise EldrError(f"cannot parse config file {p}: {e}") from None
    if not isinstance(data, dict):
        raise EldrError(f"config file {p} must hold a mapping of option names to values")
    _check_secret_file_mode(p, data)
    known = {f.name for f in dataclasses.fields(ProxyConfig)}
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in known:
            raise EldrError(f"unknown key {k!r} in config file {p}", hint=f"known keys: {', '.join(sorted(known))}")
        if key in ("prefill", "decode", "shadow") and isinstance(v, str):
            v = [v]
        out[key] = v
    return out


def _check_secret_file_mode(p: Path, data: dict[Any, Any]) -> None:
    """A config file that holds a secret (the admin token, a password in the state URL) is a secret file."""
    from urllib.parse import urlsplit

    state = data.get("state")
    try:
        pw = urlsplit(state).password if isinstance(state, str) else None
    except ValueError:
        pw = None
    secret = "admin_token" if data.get("admin_token") or data.get("admin-token") else "a password in state" if pw \
        else None
    mode = p.stat().st_mode & 0o777
    if secret and mode & 0o077:
        raise EldrError(f"config file {p} holds {secret} but users other than its owner can read it (mode {mode:o})",
                        hint=f"chmod 600 {p}, or move the secret to its environment variable or file option")


def build_config(file: str | os.PathLike[str] | None = None, **overrides: Any) -> ProxyConfig:
    """File values, then explicit overrides (None = not given), validated."""
    values = load_config_file(file) if file else {}
    for k, v in overrides.items():
        if v is None or (isinstance(v, (list, tuple)) and not v):
            continue
        values[k] = list(v) if isinstance(v, tuple) else v
    try:
        cfg = ProxyConfig(**values)
    except TypeError as e:
        raise EldrError(f"bad proxy configuration: {e}") from None
    return cfg.validate()
