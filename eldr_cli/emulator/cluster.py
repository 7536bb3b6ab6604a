"""The emulated cluster: every worker's app on its own port of one event loop, and ``eldr emulate``'s
run-until-signalled entry point :func:`serve_cluster`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from aiohttp import web

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.bench.client import new_event_loop
from eldr_cli.costmodel import CostModel, check_model
from eldr_cli.emulator.app import make_app
from eldr_cli.emulator.workers import DecodeWorker, PrefillWorker
from eldr_cli.errors import EldrError
from eldr_cli.simulator.replay import TraceReplay


class EmulatedCluster:
    """P prefill + D decode workers on consecutive ports of one event loop."""

    def __init__(self, replay: TraceReplay, n_prefill: int, n_decode: int, *, host: str = "127.0.0.1",
                 base_port: int = 18300, max_seqs: int = 256, model_name: str = "eldr-emulated",
                 prefill_max_tokens: int = 8192):
        self.replay, self.host = replay, host
        self.prefill = [PrefillWorker(i, replay, model_name, host, base_port + i, max_batched_tokens=prefill_max_tokens)
                        for i in range(n_prefill)]
        self.decode = [DecodeWorker(i, replay, model_name, host, base_port + n_prefill + i, max_seqs=max_seqs)
                       for i in range(n_decode)]
        self._runners: list[web.AppRunner] = []

    @property
    def prefill_urls(self) -> list[str]:
        return [f"http://{w.host}:{w.port}" for w in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [f"http://{w.host}:{w.port}" for w in self.decode]

    async def start(self) -> None:
        for w in [*self.prefill, *self.decode]:
            runner = web.AppRunner(make_app(w), access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, w.host, w.port, reuse_address=True)
            try:
                await site.start()
            except OSError as e:
                await self.stop()
                raise EldrError(f"cannot listen on {w.host}:{w.port}: {e.strerror}",
                                hint="choose another --base-port") from None
            self._runners.append(runner)
            w.start()

    async def stop(self) -> None:
        for w in [*self.prefill, *self.decode]:
            await w.stop()
        for r in self._runners:
            await r.cleanup()
        self._runners = []


def serve_cluster(*, trace, cost_model, n_prefill: int, n_decode: int, host: str = "127.0.0.1",
                  base_port: int = 18300, max_seqs: int = 256, model_name: str | None = None,
                  cluster_file=None, ready=None, split: str | None = None) -> None:
    """Run an emulated cluster until SIGINT/SIGTERM (``eldr emulate``). ``cluster_file`` gets
    {"mode": "emulated", "prefill": [...], "decode": [...], "trace": ..., "split": ...} once every port
    listens. ``split`` names the rows a bench sends by default (`eldr bench serve --cluster FILE` without
    --prompts; None: ``evaluation`` when the trace has such rows, else all); every row is answered."""
    if n_prefill < 1 or n_decode < 1:
        raise EldrError("--prefill and --decode must be >= 1")
    if not (0 < base_port and base_port + n_prefill + n_decode <= 65536):
        raise EldrError(f"--base-port {base_port} leaves no room for {n_prefill + n_decode} ports")
    cost = CostModel.load(cost_model)
    tr = read_trace(trace)
    replay = TraceReplay(tr, cost)
    check_model(cost_model, replay.n_layers, replay.num_experts)  # a roofline of another model: refused
    if split is None:
        has_eval = "split" in tr.requests.columns and bool((tr.column("split") == "evaluation").any())
        split = "evaluation" if has_eval else "all"
    n_split = int(tr.split_mask(split).sum())  # an unknown or empty split: one message, before listening
    name = model_name or str(tr.model.get("model") or "eldr-emulated")
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    cluster = EmulatedCluster(replay, n_prefill, n_decode, host=host, base_port=base_port, max_seqs=max_seqs,
                              model_name=name)
    stop = asyncio.Event()

    async def main():
        await cluster.start()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        info = {"mode": "emulated", "pid": os.getpid(), "model": name, "prefill": cluster.prefill_urls,
                "decode": cluster.decode_urls, "trace": str(Path(trace).resolve()),
                "cost_model": str(Path(cost_model).resolve()), "split": split, "split_rows": n_split,
                "rows_without_text": replay.rows_without_text, "n_layers": replay.n_layers,
                "num_experts": replay.num_experts}
        if cluster_file:
            _write_json_atomic(Path(cluster_file), info)
        if ready:
            ready(info)
        await stop.wait()
        await cluster.stop()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def _write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` so a reader polling for the file never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
