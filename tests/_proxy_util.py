"""Helpers for the proxy tests: a routing artifact and a stub PD cluster behind an in-process proxy."""

from __future__ import annotations

import re
import time

from eldr_cli.proxy import ProxyConfig, create_app
from eldr_cli.testing.servers import ServerThread
from eldr_cli.testing.stub_worker import StubWorker


def build_routing(out, decoders: int, seed: int = 0, layers: int = 4, experts: int = 16):
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    tr = synthetic_trace(n_requests=240, num_layers=layers, num_experts=experts, top_k=4, seed=seed)
    write_trace(out / "trace", tr)
    return run_fit(out / "trace", out / "fit", decoders=decoders, pairs=2000, figures=False)


class Cluster:
    """n_prefill + n_decode stub workers and a proxy in front of them (all on 127.0.0.1)."""

    def __init__(self, n_prefill=2, n_decode=3, stub_kw=None, **cfg):
        self.prefill = [StubWorker(f"p{i}", **(stub_kw or {})) for i in range(n_prefill)]
        self.decode = [StubWorker(f"d{i}", **(stub_kw or {})) for i in range(n_decode)]
        self.servers = [ServerThread(s).start() for s in self.prefill + self.decode]
        self.urls = [s.url for s in self.servers]
        cfg.setdefault("health_interval_s", 0)  # tests drive health rounds explicitly
        self.cfg = ProxyConfig(prefill=self.urls[:n_prefill], decode=self.urls[n_prefill:], **cfg)
        self.app = create_app(self.cfg)
        self.proxy = ServerThread(self.app).start()
        self.url = self.proxy.url

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples matching the labels, read from /metrics over HTTP."""
        import httpx

        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            m = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)", line)
            if m is None or m.group(1) != name:
                continue
            lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(lab.get(k) == str(v) for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def settle(self, timeout=5.0):
        """Wait until no request is in progress at the proxy."""
        t0 = time.monotonic()
        while self.app.state.in_progress and time.monotonic() - t0 < timeout:
            time.sleep(0.01)
        return self.app.state.in_progress

    def inflight(self) -> list[int]:
        return [w.inflight for w in [*self.app.state.prefill, *self.app.state.decode]]

    def close(self):
        self.proxy.stop()
        for s in self.servers:
            s.stop()


def until(cond, timeout: float = 5.0, step: float = 0.02) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False): the tests' one wait."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        time.sleep(step)
    return False
