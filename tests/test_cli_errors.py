"""Bad input through the real `eldr` executable: one message, the right exit code, nothing lost.

Every case runs ``python -m eldr_cli ...`` in a subprocess (as a user would) and asserts:
the exit code (2 for anything the user can fix), no traceback, exactly one error line that
names what was expected, no new files or temporary directories, and pre-existing artifacts
byte-identical afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TOKEN = "pP3uG-8vQk2Zr6XyT1bW0nLh5sJd9aFcE4mKo7iRqYw"  # an admin token must hold 256 bits (issue 36): 43 base64url
ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def eldr(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith(("Error:", "error:"))]


# (args, text the single error line must contain)
USAGE = {
    "unknown-command": (["fitt"], "No such command 'fitt'"),
    "unknown-option": (["fit", "--trce", "x"], "No such option: --trce"),
    "not-an-int": (["fit", "--trace", "x", "--decoders", "abc"], "'--decoders'"),
    "missing-value": (["fit", "--trace"], "'--trace' requires an argument"),
    "missing-argument": (["inspect"], "Missing argument 'path'"),
    "missing-required": (["fit", "--trace", "x"], "Missing option '--decoders'"),
    "bench-unknown": (["bench", "nope"], "No such command 'nope'"),
    # issue 28: no secret as a command-line value, on the client side too
    "sweep-token-on-command-line": (["bench", "sweep", "--url", "http://127.0.0.1:9", "--admin-token", "x"],
                                    "--admin-token VALUE puts the token on the command line"),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors(case, tmp_path):
    args, needle = USAGE[case]
    r = eldr(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_version_and_bare_help(tmp_path):
    from eldr_cli import __version__

    r = eldr("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"eldr {__version__}"
    r = eldr(cwd=tmp_path)
    assert "Traceback" not in r.stderr and "Usage: eldr" in r.stdout + r.stderr and "synth-trace" in r.stdout + r.stderr


def test_help_shows_no_type_after_flags():
    r = eldr("fit", "--help")
    assert r.returncode == 0
    assert "<bool>" not in r.stdout
    assert "<int>" in r.stdout  # options that take a value still show their type



# ---------------------------------------------------------------------------------------------
# The battery: every case runs in its own copy of a small workspace (a trace with picks, a fit,
# a placement, a cost model, a user's file and folder, an Orders-in-Chaos tree), so a case that
# destroyed something cannot hide behind another.

def _zarr_chunk(ws: Path, art: str, array: str) -> Path:
    return next(p for p in sorted((ws / art / "data.zarr" / array / "c").rglob("*")) if p.is_file())


def _flip_byte(f: Path) -> None:
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 3)])


def _rehash(ws: Path, art: str, name: str) -> None:
    """Update the manifest after damaging a file, so the damage reaches the reader (zstd, Parquet)."""
    from eldr_cli.artifacts.store import sha256_file

    mf = ws / art / "manifest.json"
    m = json.loads(mf.read_text())
    m["files"][name] = sha256_file(ws / art / name)
    mf.write_text(json.dumps(m))


def _truncate_chunk_rehashed(ws: Path) -> None:
    f = _zarr_chunk(ws, "trace", "prefill_counts")
    _truncate(f)
    _rehash(ws, "trace", f.relative_to(ws / "trace").as_posix())


def _truncate_parquet_rehashed(ws: Path) -> None:
    _truncate(ws / "trace" / "requests.parquet")
    _rehash(ws, "trace", "requests.parquet")


def _link_loop(ws: Path) -> None:
    (ws / "oic" / "org" / "model" / "bench" / "loop").symlink_to("..", target_is_directory=True)


FIT = ["--pairs", "200", "--no-figures"]
PLACE = ["place-experts", "--trace", "trace", "--routing", "fit/routing", "--ep-size", "2", "--no-figures"]
EVAL = ["place-experts", "evaluate", "--trace", "trace", "--routing", "fit/routing", "--placement", "placement",
        "--out", "pe", "--no-figures"]
MOE = ["bench", "moe-layer", "--experts", "8", "--hidden", "16", "--intermediate", "16", "--top-k", "2",
       "--batches", "1,2", "--active", "1,2", "--repeats", "1"]
SIM = ["bench", "simulate", "--trace", "trace", "--cost-model", "cost", "--routing", "fit/routing", "--out", "sim",
       "--rates", "1", "--duration", "1", "--warmup", "0"]
REPLAY = ["bench", "replay", "--trace", "trace", "--routing", "fit/routing", "--out", "new"]
SERVE = ["bench", "serve", "--url", "http://127.0.0.1:9", "--prompts", "trace", "--out", "b", "--no-live"]

# id: (argv, the text the one error line must contain[, preparation of the workspace])
CASES: dict[str, tuple] = {
    # usage errors (click): exit 2, "Error: ..."
    "usage-unknown-command": (["fitt"], "No such command 'fitt'"),
    "usage-unknown-option": (["fit", "--trce", "trace"], "No such option: --trce"),
    "usage-not-an-int": (["fit", "--trace", "trace", "--decoders", "abc"], "'--decoders'"),
    "usage-missing-value": (["fit", "--trace"], "'--trace' requires an argument"),
    "usage-missing-argument": (["inspect"], "Missing argument 'path'"),
    "usage-missing-option": (["fit", "--trace", "trace"], "Missing option '--decoders'"),
    "usage-bench-unknown": (["bench", "nope"], "No such command 'nope'"),
    "usage-evaluate-missing": (["place-experts", "evaluate", "--trace", "trace"], "Missing option"),
    "usage-flag-with-value": (["fit", "--trace", "trace", "-k", "2", "--vanilla=yes"], "--vanilla"),
    # zero and odd values name the option
    "synth-requests-0": (["synth-trace", "--out", "new", "--requests", "0"], "'--requests'"),
    "synth-layers-negative": (["synth-trace", "--out", "new", "--layers", "-3"], "'--layers'"),
    "synth-topk-gt-experts": (["synth-trace", "--out", "new", "--experts", "4", "--top-k", "8"], "--top-k (8)"),
    "capture-workers-0": (["capture", "--from-trace", "oic", "--out", "new", "--workers", "0"], "'--workers'"),
    "capture-eval-fraction-1": (["capture", "--from-trace", "oic", "--out", "new", "--eval-fraction", "1"],
                                "'--eval-fraction'"),
    "capture-batch-size-0": (["capture", "--model", "m", "--prompts", "p", "--batch-size", "0"], "'--batch-size'"),
    "capture-nothing": (["capture", "--out", "new"], "needs --model DIR and --prompts FILE"),
    "capture-mixed-sources": (["capture", "--from-trace", "oic", "--model", "m", "--out", "new"], "--from-trace"),
    "capture-model-missing": (["capture", "--model", "nope", "--prompts", "notes.txt", "--out", "new"], "nope"),
    "capture-from-missing": (["capture", "--from-trace", "nope", "--out", "new"], "nope is not a directory"),
    "capture-from-empty": (["capture", "--from-trace", "empty", "--out", "new"], "no *.json trace files"),
    "moe-threads-0": ([*MOE, "--out", "new", "--threads", "0"], "'--threads'"),
    "moe-repeats-0": ([*MOE, "--out", "new", "--repeats", "0"], "'--repeats'"),
    "moe-batches-text": ([*MOE, "--out", "new", "--batches", "1,x"], "--batches must be comma-separated"),
    "moe-active-0": ([*MOE, "--out", "new", "--active", "0,1"], "--active must be positive"),
    "moe-topk-gt-experts": ([*MOE, "--out", "new", "--top-k", "9"], "--top-k (9)"),
    "moe-device-unknown": ([*MOE, "--out", "new", "--device", "tpu"], "unknown --device 'tpu'"),
    "serve-url-scheme": (["bench", "serve", "--url", "ftp://x", "--prompts", "trace", "--out", "b"], "--url"),
    "serve-duration-0": ([*SERVE, "--duration", "0"], "'--duration'"),
    "serve-timeout-negative": ([*SERVE, "--timeout", "-1"], "'--timeout'"),
    "serve-rates-text": ([*SERVE, "--rates", "fast"], "rate"),
    "serve-split-bogus": ([*SERVE, "--split", "bogus"], "'--split'"),
    "sweep-routers-empty": (["bench", "sweep", "--url", "http://127.0.0.1:9", "--prompts", "trace", "--out", "b",
                             "--routers", ","], "--routers is empty"),
    "sweep-router-unknown": (["bench", "sweep", "--url", "http://127.0.0.1:9", "--prompts", "trace", "--out", "b",
                              "--routers", "eldr,bogus"], "unknown policy 'bogus'"),
    "sim-split-bogus": ([*SIM, "--split", "bogus"], "'--split'"),
    "sim-prefill-0": ([*SIM, "--prefill", "0"], "'--prefill'"),
    "sim-tau-3": ([*SIM, "--tau", "3"], "'--tau'"),
    "sim-trace-missing": (["bench", "simulate", "--trace", "nope", "--cost-model", "cost", "--out", "sim"], "nope"),
    "sim-out-is-input": ([*SIM[:-8], "--out", "cost", "--rates", "1"], "is the input cost"),
    "show-missing": (["bench", "show", "nope"], "nope does not exist"),
    "show-wrong-kind": (["bench", "show", "trace"], "is a 'trace' artifact; expected bench"),
    "replay-policy-unknown": ([*REPLAY, "--policies", "eldr,bogus"], "unknown policy 'bogus'"),
    "replay-batch-text": ([*REPLAY, "--batch-sizes", "4,x"], "--batch-sizes must be comma-separated"),
    "replay-batch-0": ([*REPLAY, "--batch-sizes", "0"], "--batch-sizes must be a positive integer"),
    "replay-out-is-input": (["bench", "replay", "--trace", "trace", "--routing", "fit/routing", "--out", "trace"],
                            "is the input trace"),
    "emulate-prefill-0": (["emulate", "--trace", "trace", "--cost-model", "cost", "--prefill", "0"], "'--prefill'"),
    "emulate-wrong-kind": (["emulate", "--trace", "trace", "--cost-model", "trace"], "expected cost-model"),
    "emulate-port-range": (["emulate", "--trace", "trace", "--cost-model", "cost", "--base-port", "70000"],
                           "'--base-port'"),
    "fit-split-bogus": (["fit", "--trace", "trace", "-k", "2", "--out", "new", "--split", "bogus"], "'--split'"),
    "fit-tau-3": (["fit", "--trace", "trace", "-k", "2", "--out", "new", "--tau", "3"], "'--tau'"),
    "fit-pairs-5": (["fit", "--trace", "trace", "-k", "2", "--out", "new", "--pairs", "5"], "'--pairs'"),
    "fit-k-0": (["fit", "--trace", "trace", "-k", "0", "--out", "new", *FIT], "K must be between 1 and"),
    "fit-k-too-big": (["fit", "--trace", "trace", "-k", "999", "--out", "new", *FIT], "K must be between 1 and"),
    "fit-transform-bogus": (["fit", "--trace", "trace", "-k", "2", "--out", "new", "--transform", "bogus", *FIT],
                            "unknown transform 'bogus'"),
    "fit-trace-wrong-kind": (["fit", "--trace", "fit", "-k", "2", "--out", "new", *FIT],
                             "is a 'fit' artifact; expected trace"),
    "fit-trace-missing": (["fit", "--trace", "nope", "-k", "2", "--out", "new", *FIT], "nope does not exist"),
    "fit-trace-file": (["fit", "--trace", "notes.txt", "-k", "2", "--out", "new", *FIT], "not an eldr artifact"),
    "fit-trace-user-dir": (["fit", "--trace", "mine", "-k", "2", "--out", "new", *FIT], "not an eldr artifact"),
    "idf-split-evaluation-missing": (["select-layers", "--trace", "trace", "--idf", "trace", "--out", "new"],
                                     "expected idf"),
    # data loss: outputs that hold something else, or an input
    "out-is-the-input": (["fit", "--trace", "trace", "-k", "2", "--out", "trace", *FIT], "is the input trace"),
    "out-holds-the-input": (["fit-idf", "--trace", "fit/idf/../../trace", "--out", "."], "current directory"),
    "out-inside-the-input": (["fit-idf", "--trace", "trace", "--out", "trace/idf"], "is inside the input trace"),
    "out-other-kind": (["fit", "--trace", "trace", "-k", "2", "--out", "placement", *FIT],
                       "holds a 'placement' artifact"),
    "synth-over-cost-model": (["synth-trace", "--out", "cost", "--requests", "10"], "holds a 'cost-model' artifact"),
    "place-over-routing": ([*PLACE, "--out", "fit/routing"], "is the input fit/routing"),
    "place-over-trace": ([*PLACE, "--out", "trace"], "is the input trace"),
    "place-over-fit": ([*PLACE, "--out", "fit"], "holds the input fit/routing"),
    "cluster-over-fit": (["cluster", "--trace", "trace", "--layers", "fit/layers", "-k", "2", "--out", "fit"],
                         "holds the input fit/layers"),
    "layers-over-idf": (["select-layers", "--trace", "trace", "--idf", "fit/idf", "--out", "fit/idf"],
                        "is the input fit/idf"),
    "moe-over-trace": ([*MOE, "--out", "trace"], "holds a 'trace' artifact"),
    "out-regular-file": (["fit-idf", "--trace", "trace", "--out", "notes.txt"], "notes.txt is an existing file"),
    "out-user-dir": (["fit-idf", "--trace", "trace", "--out", "mine"], "mine exists and is not an eldr artifact"),
    "out-empty-string": (["fit", "--trace", "trace", "-k", "2", "--out", "", *FIT], "output path is empty"),
    "out-under-a-file": (["fit-idf", "--trace", "trace", "--out", "notes.txt/idf"], "notes.txt/idf"),
    "out-not-permitted": (["fit-idf", "--trace", "trace", "--out", "/sys/eldr-test-out"], "cannot write"),
    "capture-over-fit": (["capture", "--from-trace", "oic", "--out", "fit"], "holds a 'fit' artifact"),
    # damaged inputs: one message naming the artifact (and `eldr inspect`)
    "tampered-chunk": (["fit", "--trace", "trace", "-k", "2", "--out", "new", *FIT], "does not match its manifest",
                       lambda ws: _flip_byte(_zarr_chunk(ws, "trace", "prefill_counts"))),
    "truncated-chunk": (["fit-idf", "--trace", "trace", "--out", "new"], "does not match its manifest",
                        lambda ws: _truncate(_zarr_chunk(ws, "trace", "prefill_counts"))),
    "truncated-parquet": (["fit-idf", "--trace", "trace", "--out", "new"], "requests.parquet does not match",
                          lambda ws: _truncate(ws / "trace" / "requests.parquet")),
    "missing-file": (["fit-idf", "--trace", "trace", "--out", "new"], "requests.parquet is missing",
                     lambda ws: (ws / "trace" / "requests.parquet").unlink()),
    "tampered-routing": ([*PLACE, "--out", "new"], "fit/routing is damaged",
                         lambda ws: _flip_byte(_zarr_chunk(ws, "fit/routing", "centroids"))),
    "inspect-tampered": (["inspect", "trace"], "fails verification",
                         lambda ws: _flip_byte(_zarr_chunk(ws, "trace", "prefill_counts"))),
    "manifest-not-json": (["fit-idf", "--trace", "trace", "--out", "new"], "is not valid JSON",
                          lambda ws: (ws / "trace" / "manifest.json").write_text("{not json")),
    "zstd-error-rehashed": (["fit-idf", "--trace", "trace", "--out", "new"], "cannot read array 'prefill_counts'",
                            _truncate_chunk_rehashed),
    "parquet-error-rehashed": (["fit-idf", "--trace", "trace", "--out", "new"], "cannot read table",
                               _truncate_parquet_rehashed),
    "inspect-missing": (["inspect", "nope"], "nope does not exist"),
    "inspect-file": (["inspect", "notes.txt"], "not an eldr artifact"),
    # placement
    "place-ep-size-0": ([*PLACE, "--out", "new", "--ep-size", "0"], "'--ep-size'"),
    "place-ep-size-3": ([*PLACE, "--out", "new", "--ep-size", "3"], "does not divide"),
    "place-nothing": (["place-experts", "--out", "new"], "place-experts needs --trace, --routing, --ep-size"),
    "evaluate-policy-bogus": ([*EVAL, "--policy", "bogus"], "unknown policy 'bogus'"),
    "evaluate-batch-0": ([*EVAL, "--batch-size", "0"], "'--batch-size'"),
    "evaluate-tau-5": ([*EVAL, "--tau", "5"], "'--tau'"),
    "evaluate-split-bogus": ([*EVAL, "--split", "bogus"], "'--split'"),
    "model-family-bogus": (["model", "tiny", "--family", "bogus", "--out", "new"], "unknown tiny-model family"),
    "model-over-user-dir": (["model", "tiny", "--out", "mine"], "mine exists"),
    # serve-dynamo: every check runs before Dynamo's runtime is imported (the cases hold without it)
    "dynamo-no-routing": (["serve-dynamo", "--model-path", "m"], "--routing is needed"),
    "dynamo-policy-bogus": (["serve-dynamo", "--model-path", "m", "--routing", "fit", "--policy", "bogus"],
                            "unknown policy 'bogus'"),
    "dynamo-policy-oracle": (["serve-dynamo", "--model-path", "m", "--routing", "fit", "--policy", "oracle"],
                             "unknown policy 'oracle'"),
    "dynamo-endpoint": (["serve-dynamo", "--model-path", "m", "--policy", "jsq", "--decode-endpoint", "a.b"],
                        "is not NAMESPACE.COMPONENT.ENDPOINT"),
    "dynamo-discovery": (["serve-dynamo", "--model-path", "m", "--policy", "jsq", "--discovery-backend", "zk"],
                         "expected etcd, kubernetes, file or mem"),
    "dynamo-state-password": (["serve-dynamo", "--model-path", "m", "--policy", "jsq", "--state",
                               "redis://:pw@127.0.0.1:6379"], "password in the URL"),
    "dynamo-state-no-key": (["serve-dynamo", "--model-path", "m", "--policy", "jsq", "--state",
                             "redis://127.0.0.1:6379"], "needs a key every replica shares"),
    "dynamo-decision-log-suffix": (["serve-dynamo", "--model-path", "m", "--policy", "jsq", "--decision-log",
                                    "log.txt"], "must end with .jsonl or .parquet"),
}


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder below ``root`` (symbolic links not followed) with a hash of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = ""
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = "link" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Built once through the library (fast); every case gets its own copy."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.costmodel.moe_layer import run_moe_layer
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.place import run_place_experts
    from eldr_cli.synth import synthetic_trace

    ws = tmp_path_factory.mktemp("cli-errors") / "ws"
    ws.mkdir()
    write_trace(ws / "trace", synthetic_trace(120, 4, 16, 2, n_domains=3, decode_steps=12, with_picks=True, seed=0))
    run_fit(ws / "trace", ws / "fit", decoders=2, pairs=200, figures=False)
    run_place_experts(ws / "trace", ws / "fit" / "routing", ws / "placement", ep_size=2, figures=False)
    run_moe_layer(ws / "cost", num_experts=8, hidden=16, intermediate=16, top_k=2, batches=[1, 2, 4],
                  actives=[1, 2, 4], repeats=1, threads=1)
    (ws / "notes.txt").write_text("my notes\n")
    (ws / "mine").mkdir()
    (ws / "mine" / "thesis.tex").write_text("\\begin{document}\n")
    (ws / "empty").mkdir()
    leaf = ws / "oic" / "org" / "model" / "bench" / "subject"
    leaf.mkdir(parents=True)
    (leaf / "0.json").write_text("[]")
    return ws


def _run_case(name: str, base: Path, root: Path) -> dict:
    argv, needle, *prep = CASES[name]
    ws = root / name / "ws"
    shutil.copytree(base, ws, symlinks=True)
    if prep:
        prep[0](ws)
    before = _tree(ws.parent)  # the case folder: temporary siblings of an output would show up here
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eldr_cli", *argv], cwd=ws, env=ENV, capture_output=True, text=True,
                       timeout=180)
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr, "needle": needle, "before": before,
            "after": _tree(ws.parent), "s": time.perf_counter() - t0}


@pytest.fixture(scope="module")
def results(workspace, tmp_path_factory):
    """All cases, run concurrently (each waits on its own subprocess)."""
    root = tmp_path_factory.mktemp("cli-error-cases")
    with ThreadPoolExecutor(max_workers=4) as ex:
        futs = {name: ex.submit(_run_case, name, workspace, root) for name in CASES}
        return {name: f.result() for name, f in futs.items()}


def test_battery_has_enough_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, results):
    r = results[case]
    text = r["out"] + r["err"]
    assert r["rc"] == 2, f"exit {r['rc']}\n{text}"
    assert "Traceback" not in text, text
    lines = error_lines(r["err"])
    assert len(lines) == 1, f"expected one error line:\n{r['err']}"
    assert r["needle"] in lines[0], f"{r['needle']!r} not in {lines[0]!r}"
    assert r["after"] == r["before"], (
        f"files changed: new {sorted(r['after'].keys() - r['before'].keys())}, "
        f"gone {sorted(r['before'].keys() - r['after'].keys())}, "
        f"changed {sorted(k for k in r['before'] if k in r['after'] and r['before'][k] != r['after'][k])}")


# ---------------------------------------------------------------------------------------------
# Ctrl-C: exit 130, "interrupted", nothing written

def _blackhole() -> tuple[socket.socket, int, threading.Event]:
    """A TCP server that accepts connections and never answers (a hung endpoint)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted = threading.Event()
    conns = []

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            conns.append(c)
            accepted.set()

    threading.Thread(target=loop, daemon=True).start()
    return srv, srv.getsockname()[1], accepted


def test_ctrl_c_exits_130(workspace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    before = _tree(tmp_path)
    srv, port, accepted = _blackhole()
    try:
        p = subprocess.Popen([sys.executable, "-m", "eldr_cli", "bench", "serve", "--url", f"http://127.0.0.1:{port}",
                              "--prompts", "trace", "--out", "b", "--no-live", "--rates", "1", "--duration", "1",
                              "--warmup", "0"], cwd=ws, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        assert accepted.wait(60), "the bench never connected"
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        srv.close()
    assert p.returncode == 130, out + err
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert _tree(tmp_path) == before


def test_from_trace_follows_symbolic_links_and_names_what_it_skips(tmp_path):
    """One subject of three is a symbolic link (as trees assembled from several downloads are): all three
    domains are imported; a link loop is walked once and reported as skipped, by name."""
    import polars as pl

    from eldr_cli.capture.oic_fixtures import write_oic_tree

    write_oic_tree(tmp_path / "src", n_per_subject=3)
    model = tmp_path / "src" / "acme" / "Tiny-MoE"
    (model / "mmlu" / "law").rename(tmp_path / "law-elsewhere")
    (model / "mmlu" / "law").symlink_to(tmp_path / "law-elsewhere", target_is_directory=True)
    (model / "gsm8k" / "again").symlink_to("..", target_is_directory=True)  # a loop
    r = eldr("capture", "--from-trace", str(model), "--out", str(tmp_path / "t"), "--no-progress")
    assert r.returncode == 0, r.stderr
    domains = pl.read_parquet(tmp_path / "t" / "requests.parquet")["domain"].to_list()
    assert sorted(set(domains)) == ["law", "main", "medicine"] and len(domains) == 9
    assert "gsm8k/again" in r.stderr  # the loop, named
    assert "skipped (unreadable files)" in r.stdout and "1" in r.stdout.split("skipped (unreadable files)")[1][:20]


# ---------------------------------------------------------------------------------------------
# Tables fit an 80-column terminal without cutting names or numbers, and print in full otherwise

def _eldr_cols(cwd: Path, *args: str, columns: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "eldr_cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def test_tables_fit_80_columns(workspace, tmp_path):
    from eldr_cli.capture.oic_fixtures import write_oic_tree

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    write_oic_tree(tmp_path / "src", n_per_subject=2)
    commands = [
        ["fit", "--trace", "trace", "-k", "2", "--out", "fit2", "--pairs", "300", "--no-figures"],
        ["inspect", "fit/routing"],
        ["inspect", "trace"],
        ["place-experts", "evaluate", "--trace", "trace", "--routing", "fit/routing", "--placement", "placement",
         "--out", "pe", "--no-figures"],
        ["capture", "--from-trace", str(tmp_path / "src" / "acme" / "Tiny-MoE"), "--out", "imported",
         "--no-progress"],
        ["bench", "simulate", "--trace", "trace", "--cost-model", "cost", "--routing", "fit/routing", "--out", "sim",
         "--rates", "1", "--duration", "2", "--warmup", "0", "--prefill", "1", "--decode", "2"],
        ["bench", "show", "sim"],
    ]
    for argv in commands:
        r = _eldr_cols(ws, *argv, columns="80")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines and max(len(ln) for ln in lines) <= 80, (argv, r.stdout)
        assert "…" not in r.stdout, (argv, r.stdout)
    assert "round-robin" in r.stdout and "TPOT p99" in r.stdout and "ITL p50" not in r.stdout
    # --wide on a narrow terminal: every column, folded, nothing cut
    r = _eldr_cols(ws, "bench", "show", "sim", "--wide", columns="80")
    assert r.returncode == 0 and "ITL" in r.stdout and "lag" in r.stdout and "…" not in r.stdout
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 80
    # a pipe without COLUMNS: every column on one line each
    r = _eldr_cols(ws, "bench", "show", "sim", columns=None)
    assert r.returncode == 0 and "ITL p50" in r.stdout and "lag p50" in r.stdout and "…" not in r.stdout
    full = _eldr_cols(ws, "inspect", "trace", columns=None).stdout
    assert str(ws / "trace") not in full  # relative path shown as given
    assert "prefill_counts" in full and "…" not in full


def test_same_kind_is_replaced_and_force_replaces_another_kind(workspace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    r = eldr("synth-trace", "--out", "trace", "--requests", "30", "--layers", "2", "--experts", "8", cwd=ws)
    assert r.returncode == 0, r.stderr  # a trace over a trace: replaced atomically
    assert json.loads((ws / "trace" / "manifest.json").read_text())["metrics"]["n_requests"] == 30
    r = eldr("synth-trace", "--out", "cost", "--requests", "30", "--layers", "2", "--experts", "8", "--force", cwd=ws)
    assert r.returncode == 0, r.stderr
    assert json.loads((ws / "cost" / "manifest.json").read_text())["kind"] == "trace"
    assert not [p for p in ws.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    # --force never lets an output replace the command's own input
    r = eldr("fit-idf", "--trace", "trace", "--out", "trace", "--force", cwd=ws)
    assert r.returncode == 2 and "is the input trace" in r.stderr


def test_bench_where_every_request_failed_exits_2(workspace, tmp_path):
    """A server that lists a model but answers every completion with HTTP 500: the bench record is
    kept (it is the evidence), and the command says nothing was measured and exits 2."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Failing(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            self._send(200, b'{"data": [{"id": "m"}]}')

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send(500, b'{"error": {"message": "boom"}}')

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    try:
        r = eldr("bench", "serve", "--url", f"http://127.0.0.1:{srv.server_address[1]}", "--prompts", "trace",
                 "--out", "b", "--no-live", "--rates", "4", "--duration", "1", "--warmup", "0", "--max-tokens", "4",
                 cwd=ws)
    finally:
        srv.shutdown()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "every measured request failed" in lines[0], r.stderr
    assert json.loads((ws / "b" / "manifest.json").read_text())["metrics"]["completed"] == 0


@pytest.mark.parametrize("interrupt", [False, True], ids=["finished", "ctrl-c"])
def test_bench_sweep_puts_the_proxy_back_on_its_policy(workspace, tmp_path, interrupt):
    sys.path.insert(0, str(Path(__file__).parent))
    from _proxy_util import Cluster

    c = Cluster(n_prefill=1, n_decode=2, policy="jsq", admin_token=TOKEN,
                stub_kw={"token_delay_s": 0.05 if interrupt else 0.0})
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    argv = [sys.executable, "-m", "eldr_cli", "bench", "sweep", "--url", c.url, "--prompts", "trace",
            "--routers", "round-robin,p2c", "--rates", "4",
            "--duration", "30" if interrupt else "1", "--warmup", "0", "--max-tokens", "4", "--out", "sweep",
            "--no-live"]
    p = subprocess.Popen(argv, cwd=ws, env={**ENV, "ELDR_ADMIN_TOKEN": TOKEN}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if interrupt:
        t0 = time.monotonic()
        while c.app.state.policy_name == "jsq" and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        assert c.app.state.policy_name == "round-robin"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    try:
        assert "Traceback" not in out + err
        assert p.returncode == (130 if interrupt else 0), out + err
        assert c.app.state.policy_name == "jsq"  # the policy the sweep found
        assert "proxy policy restored to jsq" in out
        assert (ws / "sweep").exists() != interrupt  # an interrupted sweep writes nothing
    finally:
        for s in [c.proxy, *c.servers]:
            s.stop()


def test_emulate_cleans_up_and_ignores_clients_that_go_away(workspace, tmp_path):
    from eldr_cli.testing.ports import free_port_range

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, symlinks=True)
    base = free_port_range(2)
    p = subprocess.Popen([sys.executable, "-m", "eldr_cli", "emulate", "--trace", "trace", "--cost-model", "cost",
                          "--prefill", "1", "--decode", "1", "--base-port", str(base), "--cluster-file", "cl.json"],
                         cwd=ws, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not (ws / "cl.json").exists() and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        info = json.loads((ws / "cl.json").read_text())
        body = json.dumps({"model": info["model"], "prompt": "hello", "max_tokens": 500, "stream": True,
                           "ignore_eos": True})
        s = socket.create_connection(("127.0.0.1", base + 1))
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # the client goes away mid-stream
        time.sleep(1.0)
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert "Traceback" not in out + err, err
    assert not (ws / "cl.json").exists()  # no file pointing at dead ports


def test_given_option_values_convert_as_typer_converts_them():
    """eldr converts plain option values itself (typer would build a pydantic adapter per option, ~0.1 s
    of every command): for every option of every command and a spread of inputs, the value (and its
    type) or the refusal is the one typer gives; whatever is not plain is left to typer."""
    from typer._coercion import build_runtime_param
    from typer.main import get_command

    from eldr_cli import main, typer_speedups

    main._register()

    def commands(cmd):
        yield cmd
        for sub in getattr(cmd, "commands", {}).values():
            yield from commands(sub)

    samples = ["0", "16", "-3", "007", "+4", "1.5", "0.25", "-0.5", "1e-3", ".5", "inf", "abc", "a/b", "", " 5"]
    checked = 0
    for cmd in commands(get_command(main.app)):
        ctx = cmd.context_class(cmd, info_name=cmd.name)
        for p in cmd.params:
            if not hasattr(p, "type_descriptor") or p.type_descriptor.annotation is bool:
                continue
            for s in samples:
                try:
                    ours = ("ok", typer_speedups._plain_value(p, ctx, s))
                except Exception as e:  # noqa: BLE001 - compared with typer's below
                    ours = ("error", f"{type(e).__name__}: {e}")
                if ours == ("ok", None):
                    continue  # not plain: typer converts it
                try:
                    v = build_runtime_param(p.type_descriptor).coerce(s, param=p, ctx=ctx)
                    theirs = ("ok", v)
                except Exception as e:  # noqa: BLE001
                    theirs = ("error", f"{type(e).__name__}: {e}")
                assert ours == theirs and type(ours[1]) is type(theirs[1]), (cmd.name, p.name, s)
                checked += 1
    assert checked > 300


def test_typer_speedups_leave_an_untested_typer_alone(monkeypatch):
    import typer

    from eldr_cli import typer_speedups

    monkeypatch.setattr(typer, "__version__", "0.30.0")
    assert typer_speedups.apply(help_only=True) is False
