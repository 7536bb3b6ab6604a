"""The eldr decode router as a Dynamo component (``ai-dynamo-runtime``; ``eldr serve-dynamo`` runs it).

It registers as the model's decode tier (``WorkerType.Decode``, needing prefill), the way Dynamo's own Global
Router does, in the namespace the frontend watches (``--namespace``). The real decode workers run in another
namespace (``--decode-endpoint``, e.g. a vLLM worker started with ``--endpoint eldr-decode.backend.generate``),
which the frontend does not watch, so every decode request reaches this component. For each one it follows the
decode instances discovered there (``Client.instance_ids``), lets :class:`~eldr_cli.dynamo.router.InstanceRouter`
choose, sends the request to that instance with ``Client.direct`` (the frontend's context passed on, so a client
that goes away cancels the decode) and streams its answer back. The hand-off itself (decide, hold, reserve,
record, shadows) is the proxy's dispatcher's. A ``stats`` endpoint beside it answers the router's counters, and
``--metrics-port`` serves the proxy's Prometheus metrics at ``GET /metrics`` (:mod:`eldr_cli.dynamo.metrics_http`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from eldr_cli.dynamo.router import InstanceRouter, NoDecodeInstance
from eldr_cli.errors import EldrError

log = logging.getLogger("eldr.dynamo")
SUSPECT_S = 5.0  # an instance that failed to answer is left out this long (then tried again if still listed)


@dataclass
class ComponentConfig:
    model_path: str                      # the model's directory or HF id (tokenizer + config: the frontend's card)
    model_name: str | None = None        # served name (default: model_path)
    endpoint: str = "dynamo.eldr.generate"               # where this router serves (the frontend's namespace)
    decode_endpoint: str = "eldr-decode.backend.generate"  # the real decode workers
    wait_s: float = 30.0                 # how long a request waits for a first decode instance
    metrics: socket.socket | None = None  # GET /metrics (the proxy's Prometheus metrics) listens here (None: off)


def check_endpoint(path: str, flag: str) -> str:
    parts = path.split(".")
    if len(parts) != 3 or not all(parts):
        raise EldrError(f"{flag} {path!r} is not NAMESPACE.COMPONENT.ENDPOINT")
    return path


class DecodeHandler:
    """The decode endpoint's handler: choose (the dispatcher), send with ``Client.direct``, stream back, finish."""

    def __init__(self, router: InstanceRouter, client: Any, wait_s: float):
        self.router, self.client, self.wait_s = router, client, wait_s
        self.failed: dict[int, float] = {}  # instance -> when it failed to answer (still listed by discovery)

    def _listed(self) -> list[int]:
        """The instances discovery lists, less those that failed to answer in the last SUSPECT_S (a process that
        died keeps its entry until its lease expires)."""
        now = time.monotonic()
        self.failed = {i: t for i, t in self.failed.items() if now - t < SUSPECT_S}
        return [i for i in self.client.instance_ids() if i not in self.failed]

    async def _instances(self) -> None:
        self.router.sync(self._listed())
        if not self.router.instances:
            try:
                ids = await asyncio.wait_for(self.client.wait_for_instances(), self.wait_s)
            except asyncio.TimeoutError:
                raise NoDecodeInstance(f"no decode instance registered within {self.wait_s:g} s") from None
            self.router.sync(ids)

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[Any]:
        rid = _request_id(context)
        try:
            await self._instances()
            f = await self.router.choose(request, rid)  # the proxy's dispatcher: decided, held, reserved, recorded
        except NoDecodeInstance:
            self.router.outcome("unavailable")
            raise
        outcome = "cancelled"
        try:
            tried: set[int] = set()
            while True:
                iid = f.instance_id
                assert iid is not None
                tried.add(iid)
                started = False
                try:
                    stream = await self.client.direct(request, iid, context=context)
                    async for out in stream:
                        started = True
                        yield out.data() if hasattr(out, "data") else out
                    outcome = "ok"
                    return
                except Exception as e:  # an instance that left between the decision and the send: once elsewhere
                    stopped = context is not None and context.is_stopped()
                    outcome = "cancelled" if stopped else "stream_error" if started else "upstream_error"
                    if started or len(tried) > 1 or stopped:
                        raise
                    log.warning("decode instance %s failed before streaming (%s); deciding again", iid, e)
                    self.router.metrics.child(self.router.metrics.upstream_errors, "decode", str(iid),
                                              "connect").inc()
                    self.failed[iid] = time.monotonic()
                    self.router.sync(self._listed())
                    self.router.again(f, tried)
        finally:
            self.router.outcome(outcome)
            self.router.finish(f)

    async def stats(self, request: Any = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        yield self.router.stats()


def _request_id(context: Any) -> str:
    try:
        rid = context.id() if context is not None else None
    except Exception:  # pragma: no cover - a runtime without ids
        rid = None
    return str(rid) if rid else uuid.uuid4().hex


async def serve(runtime: Any, cfg: ComponentConfig, router: InstanceRouter) -> None:
    """Register as the model's decode tier and serve until the runtime shuts down."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    ns, comp, _ = check_endpoint(cfg.endpoint, "--endpoint").split(".")
    if check_endpoint(cfg.decode_endpoint, "--decode-endpoint").split(".")[0] == ns:
        raise EldrError(f"--decode-endpoint {cfg.decode_endpoint} is in the router's namespace {ns!r}: the "
                        "frontend would route to the decode workers directly, around eldr",
                        hint="run the decode workers in their own namespace (e.g. eldr-decode.backend.generate)")
    metrics = None
    if cfg.metrics is not None:
        from eldr_cli.dynamo.metrics_http import serve_metrics

        metrics = await serve_metrics(router.metrics.render, cfg.metrics)
        log.info("metrics at http://%s:%d/metrics", *cfg.metrics.getsockname()[:2])
    client = await runtime.endpoint(cfg.decode_endpoint).client()
    endpoint = runtime.endpoint(cfg.endpoint)
    stats_ep = runtime.endpoint(f"{ns}.{comp}.stats")
    await register_model(model_input=ModelInput.Tokens, model_type=ModelType.Chat | ModelType.Completions,
                         endpoint=endpoint, model_path=cfg.model_path, model_name=cfg.model_name or cfg.model_path,
                         worker_type=WorkerType.Decode, needs=[[WorkerType.Prefill]], ignore_weights=True)
    handler = DecodeHandler(router, client, cfg.wait_s)
    flusher = asyncio.ensure_future(_flush_every(router, 1.0))
    await router.shared.start(router)  # several replicas: counts and live sets shared over Redis
    log.info("eldr decode router (%s) serving %s; decode instances at %s", router.policy, cfg.endpoint,
             cfg.decode_endpoint)
    try:
        await asyncio.gather(
            endpoint.serve_endpoint(handler.generate, graceful_shutdown=True,
                                    metrics_labels=[("service", "eldr_router"), ("type", "decode")]),
            stats_ep.serve_endpoint(handler.stats, graceful_shutdown=False))
    finally:
        flusher.cancel()
        if metrics is not None:
            metrics.close()
        await router.shared.stop()


async def _flush_every(router: InstanceRouter, period_s: float) -> None:
    """The decision log's rows reach their file within ``period_s`` (it writes on its own thread)."""
    dlog = router.log
    while dlog is not None:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(dlog.flush)


def run(cfg: ComponentConfig, router: InstanceRouter, discovery: str = "etcd", request_plane: str = "tcp") -> None:
    """Start Dynamo's runtime (``discovery``: etcd, file, kubernetes or mem) and :func:`serve` in it."""
    try:
        import uvloop
        from dynamo.runtime import DistributedRuntime
    except ImportError as e:
        raise EldrError(f"serve-dynamo needs NVIDIA Dynamo's runtime ({e})",
                        hint="pip install 'eldr[dynamo]' (ai-dynamo-runtime 1.6.1)") from None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(loop, discovery, request_plane)
        for sig in (signal.SIGINT, signal.SIGTERM):  # leave discovery, finish the streams in flight, then return
            loop.add_signal_handler(sig, runtime.shutdown)
        await serve(runtime, cfg, router)

    uvloop.run(main())
