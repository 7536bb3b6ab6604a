"""A Dynamo deployment on this machine for the tests and the benchmark: Dynamo's own frontend, file discovery,
stub prefill and decode workers on Dynamo's runtime and eldr's decode router (``eldr serve-dynamo``), each a
process of ``.venv-dynamo`` (``make venv-dynamo``), all on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests and benchmarks run from one)
DYN_PY = Path(os.environ.get("ELDR_DYNAMO_PYTHON", ROOT / ".venv-dynamo" / "bin" / "python"))
MODEL = "stub"


def dynamo_missing() -> str | None:
    """Why the Dynamo tests cannot run here (None: they can)."""
    if not DYN_PY.exists():
        return f"{DYN_PY} is absent: `make venv-dynamo` builds Dynamo's environment (ai-dynamo 1.6.1)"
    return None


def _env(kv: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(ROOT), "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv),
        "DYN_REQUEST_PLANE": "tcp", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_SELF_HOST_METADATA": "0",
        "DYN_LOG": "warn", "PYTHONUNBUFFERED": "1"})
    return env


class DynamoCluster:
    """``n_decode`` stub decode workers, one stub prefill worker, ``routers`` eldr routers (or none: Dynamo's own
    decode routing straight to the decode workers) and Dynamo's frontend, in ``tmp``."""

    def __init__(self, tmp: Path, *, routing: Path | None, n_decode: int = 3, routers: int = 1,
                 policy: str | None = None, delay_ms: float = 10.0, router_mode: str = "round-robin",
                 log: str = "warn", router_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.tmp, self.routing, self.delay_ms = Path(tmp), routing, delay_ms
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.kv = self.tmp / "kv"
        self.env = _env(self.kv) | {"DYN_LOG": log} | (env or {})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.model = self.tmp / "model"
        self.decode_log = self.tmp / "decode.jsonl"
        self.decision_log = self.tmp / "decisions.jsonl"
        self.eldr = routers > 0
        from eldr_cli.testing.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._run("model", [*self._stub("model"), str(self.model)], wait=True)
        # without eldr the decode workers are the model's decode tier in the frontend's own namespace
        self.decode_endpoint = "eldr-decode.backend.generate" if self.eldr else "dynamo.backend.generate"
        for i in range(n_decode):
            self.start_decode(i)
        self._run("prefill", [*self._stub("prefill"), "--model-path", str(self.model), "--model-name", MODEL])
        for r in range(routers):
            args = [str(DYN_PY), "-m", "eldr_cli", "serve-dynamo", "--model-path", str(self.model),
                    "--model-name", MODEL, "--discovery-backend", "file", "--decision-log",
                    str(self.tmp / f"decisions{'' if r == 0 else r}.jsonl"), "--log-level", "warning"]
            args += ["--routing", str(routing)] if routing is not None else []
            args += ["--policy", policy] if policy else []
            args += list(router_args)
            self._run(f"router{r}", args)
        self._run("frontend", [str(DYN_PY), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                               str(self.port), "--discovery-backend", "file", "--namespace", "dynamo",
                               "--router-mode", router_mode])

    def _stub(self, role: str) -> list[str]:
        return [str(DYN_PY), "-m", "eldr_cli.testing.dynamo_workers", role]

    def _run(self, name: str, args: list[str], wait: bool = False) -> None:
        out = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp)
        if wait:
            if p.wait(120) != 0:
                raise RuntimeError(f"{name} failed: {(self.tmp / f'{name}.log').read_text()[-2000:]}")
            return
        self.procs[name] = p

    def start_decode(self, i: int) -> None:
        self._run(f"decode{i}", [*self._stub("decode"), "--model-path", str(self.model), "--model-name", MODEL,
                                 "--name", f"d{i}", "--log", str(self.decode_log), "--delay-ms", str(self.delay_ms),
                                 "--endpoint", self.decode_endpoint])

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        p = self.procs.pop(name)
        p.send_signal(sig)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait(10)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until the frontend serves the model and a first request completes through the whole chain."""
        import httpx

        t0, last = time.monotonic(), ""
        while time.monotonic() - t0 < timeout:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {self.log_tail(name)}")
            try:
                r = httpx.post(self.url + "/v1/completions", timeout=10,
                               json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as e:
                last = str(e)
            time.sleep(0.5)
        raise RuntimeError(f"the Dynamo deployment did not come up in {timeout:g} s: {last}")

    def log_tail(self, name: str, n: int = 3000) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-n:]

    def decode_rows(self) -> list[dict]:
        if not self.decode_log.exists():
            return []
        return [json.loads(x) for x in self.decode_log.read_text().splitlines() if x.strip()]

    def decisions(self, timeout: float = 5.0, at_least: int = 0, path: Path | None = None) -> list[dict]:
        """The router's decision-log rows (flushed every second)."""
        path = path or self.decision_log
        t0 = time.monotonic()
        while True:
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
            if len(rows) >= at_least or time.monotonic() - t0 > timeout:
                return rows
            time.sleep(0.2)

    def stats(self) -> list[dict]:
        """Every eldr router's ``stats`` answer."""
        r = subprocess.run([*self._stub("stats")], env=self.env, capture_output=True, timeout=60, cwd=self.tmp)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.decode(errors="replace")[-2000:])
        return [json.loads(x) for x in r.stdout.decode().splitlines() if x.startswith("{")]

    def close(self) -> None:
        procs = list(self.procs.values())
        self.procs.clear()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def run_module(*args: str) -> None:  # pragma: no cover - a debugging aid: python tests/_dynamo_util.py DIR
    c = DynamoCluster(Path(args[0]), routing=Path(args[1]) if len(args) > 1 else None)
    try:
        c.wait_ready()
        print("ready at", c.url, flush=True)
        signal.pause()
    finally:
        c.close()


if __name__ == "__main__":  # pragma: no cover
    run_module(*sys.argv[1:])
