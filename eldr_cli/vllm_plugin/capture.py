"""Worker side: router capture hooks + the signature cache (one per worker process).

Lifecycle
---------
1. ``bind_model(model, max_tokens)`` right after the model loads (before warm-up/compile): one
   ``set_capture_fn`` per MoE layer's ``BaseRouter`` (layers ordered by ``layer_id``) and the
   preallocated ``picks [L, rows, k]`` buffer. A model without MoE layers, or with a layer whose
   kernel bypasses ``BaseRouter`` (monolithic kernels), gets one warning and no hooks.
2. ``allocate(kv_cache_config, ...)`` when the worker-side KV connector is created (the KV cache
   size is known then): the cache ``[num_blocks + 1, L, E]`` on the model's device; sizes logged.
3. Each ``execute_model`` step: the connector binds its metadata (``begin_step``: invalidations,
   step marked active); during the forward each hook only copies its layer's top-k ids into
   ``picks`` (no Python state, no host sync: torch.compile traces it once); right after the forward,
   still inside its forward context, ``after_forward`` maps every token to its KV block from the
   slot mapping, restarts rows of blocks that get their first token and accumulates all layers'
   picks; then ``signatures(...)`` sums the rows of the requests whose prefill completed.

Anything that cannot be mapped exactly (micro-batched forwards, a forward larger than the buffer,
a missing slot mapping) switches signatures off for good with one warning: a worker never returns a
signature it cannot vouch for.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eldr_cli.kernels import signature_cache as sck

LOG_NAME = "vllm.eldr_signatures"

# Qwen3-30B-A3B: 48 layers (all MoE), 128 experts, 4 KV heads x head_dim 128, bf16 KV.
QWEN3_30B_A3B = {"layers": 48, "experts": 128, "kv_heads": 4, "head_dim": 128, "kv_bytes": 2}


def _log() -> logging.Logger:
    try:
        from vllm.logger import init_logger

        return init_logger(LOG_NAME)
    except Exception:  # pragma: no cover - vllm missing
        return logging.getLogger(LOG_NAME)


def signature_share(layers: int, experts: int, kv_heads: int, head_dim: int, kv_bytes: int, block_size: int,
                    attn_layers: int | None = None, cell_bytes: int = 1) -> float:
    """Signature-cache bytes per block / KV-cache bytes per block (fills' 4 bytes included)."""
    kv = 2 * (attn_layers or layers) * kv_heads * head_dim * block_size * kv_bytes
    return (layers * experts * cell_bytes + 4) / kv


@dataclass
class CaptureState:
    layers: int = 0
    experts: int = 0
    top_k: int = 0
    device: torch.device | None = None
    bound: bool = False
    sc: sck.SignatureCache | None = None
    token_blocks: torch.Tensor | None = None
    picks: Any = None  # torch.Tensor once bound: [L, rows, k] int32: the last forward's top-k ids per MoE layer
    slot_key: str | None = None
    active: bool = False
    disabled: str | None = None
    backend: str = "auto"
    layer_names: list[str] = field(default_factory=list)

    # -- setup -----------------------------------------------------------------------------------
    def bind_model(self, model: torch.nn.Module, max_tokens: int = 8192) -> bool:
        """Attach capture hooks to every MoE router. Returns whether signatures can be captured.
        ``max_tokens``: the most tokens one forward can carry (scheduler's max_num_batched_tokens)."""
        log = _log()
        if self.bound:
            return True
        try:
            from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
            from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
        except ImportError as e:  # pragma: no cover - vLLM layout changed
            self.disabled = f"vLLM MoE classes not found ({e})"
            log.warning("eldr signatures OFF: %s; serving without signatures", self.disabled)
            return False
        runners = [(n, m) for n, m in model.named_modules() if isinstance(m, MoERunnerInterface)]
        if not runners:
            self.disabled = "the model has no MoE layers"
            log.warning("eldr signatures OFF: %s (%s); serving without signatures",
                        self.disabled, type(model).__name__)
            return False
        bad = []
        for name, m in runners:
            qm = getattr(m, "_quant_method", None)
            if getattr(qm, "is_monolithic", False) or not isinstance(getattr(m, "router", None), BaseRouter):
                bad.append(f"{name} ({type(getattr(m, 'router', None)).__name__}"
                           f"{', monolithic kernel' if getattr(qm, 'is_monolithic', False) else ''})")
        if bad:
            self.disabled = ("MoE kernels bypass the router hook: " + ", ".join(bad[:3])
                             + (" ..." if len(bad) > 3 else ""))
            log.warning("eldr signatures OFF: %s; serving without signatures", self.disabled)
            return False
        runners.sort(key=lambda nm: (getattr(nm[1], "layer_id", 0) or 0, nm[0]))
        experts = set()
        topk = set()
        for i, (_name, m) in enumerate(runners):
            cfg = getattr(m, "moe_config", None)
            n_exp = getattr(cfg, "num_logical_experts", None) or m.router.global_num_experts
            experts.add(int(n_exp))
            topk.add(int(m.router.top_k))
            m.router.set_capture_fn(functools.partial(self.capture, i))
        if len(experts) != 1 or len(topk) != 1:
            for _, m in runners:
                m.router.set_capture_fn(None)
            self.disabled = f"MoE layers differ in experts/top-k ({sorted(experts)}, {sorted(topk)})"
            log.warning("eldr signatures OFF: %s; serving without signatures", self.disabled)
            return False
        self.layers, self.experts, self.top_k = len(runners), experts.pop(), topk.pop()
        self.layer_names = [n for n, _ in runners]
        try:
            self.device = next(model.parameters()).device
        except StopIteration:  # pragma: no cover
            self.device = torch.device("cpu")
        rows = int(max_tokens) + 1024  # margin for padded batches
        self.picks = torch.zeros(self.layers, rows, self.top_k, dtype=torch.int32, device=self.device)
        self.token_blocks = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.bound = True
        log.info("eldr signatures: capture hooks on %d MoE layers (%d experts, top-%d)",
                 self.layers, self.experts, self.top_k)
        return True

    def allocate(self, kv_cache_config, vllm_config) -> bool:
        """Allocate the cache for ``kv_cache_config.num_blocks`` blocks; log its size and shares."""
        log = _log()
        if not self.bound or self.disabled:
            return False
        if self.sc is not None:
            return True
        from vllm.v1.kv_cache_interface import AttentionSpec

        block_size = int(vllm_config.cache_config.block_size)
        groups = list(kv_cache_config.kv_cache_groups)
        attn = [g for g in groups if isinstance(g.kv_cache_spec, AttentionSpec)]
        if len(groups) != 1 or not attn:
            self.disabled = f"{len(groups)} KV-cache groups (hybrid attention) are not supported"
            log.warning("eldr signatures OFF: %s; serving without signatures", self.disabled)
            return False
        self.slot_key = attn[0].layer_names[0]
        num_blocks = int(kv_cache_config.num_blocks)
        try:
            dt, msg = sck.cell_dtype(block_size, self.top_k)
            self.sc = sck.SignatureCache.allocate(num_blocks, self.layers, self.experts, block_size, self.top_k,
                                                  device=self.device)
        except sck.SignatureCacheError as e:
            self.disabled = str(e)
            log.warning("eldr signatures OFF: %s; serving without signatures", e)
            return False
        if msg:
            log.warning("eldr signatures: %s", msg)
        kv_bytes = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        share = self.sc.nbytes / kv_bytes if kv_bytes else float("nan")
        ref = signature_share(block_size=16, **QWEN3_30B_A3B)
        log.info(
            "eldr signature cache: %d blocks x %d MoE layers x %d experts %s = %.2f MiB on %s "
            "(%.3f%% of this worker's %.1f MiB KV cache, block size %d); "
            "for Qwen3-30B-A3B (L=48, E=128, block 16, bf16 KV) it would be %.3f%% of the KV cache",
            num_blocks, self.layers, self.experts, str(dt).removeprefix("torch."), self.sc.nbytes / 2**20,
            self.device, 100 * share, kv_bytes / 2**20, block_size, 100 * ref)
        return True

    # -- per step ----------------------------------------------------------------------------------
    def begin_step(self, invalid_blocks) -> None:
        if self.sc is None or self.disabled:
            return
        if invalid_blocks:
            sck.invalidate_blocks(self.sc, invalid_blocks)
        self.active = True

    def end_step(self) -> None:
        self.active = False

    def _off(self, why: str) -> None:
        self.disabled = why
        self.active = False
        self.sc = None
        _log().warning("eldr signatures OFF from now on: %s; serving continues without signatures", why)

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """The router hook: ``topk_ids`` [num_tokens, top_k] logical expert ids of MoE layer ``layer``.
        Only a copy into the preallocated ``picks`` buffer: no Python state, no host sync, so the hook
        traces once under torch.compile and replays inside a captured graph."""
        n = topk_ids.shape[0]
        if n <= self.picks.shape[1]:
            self.picks[layer, :n].copy_(topk_ids)

    def after_forward(self) -> None:
        """Right after a bound step's forward (still inside its forward context): map every token to
        its KV block from the slot mapping, restart newly (re)allocated blocks, add the picks of all
        MoE layers to the blocks' rows."""
        if not self.active or self.sc is None:
            return
        self.active = False  # one forward per bound step
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return
        sm = get_forward_context().slot_mapping
        if isinstance(sm, list):
            self._off("micro-batched forwards (ubatching) are not supported")
            return
        if not sm:  # no forward ran in this step (e.g. a KV-transfer-only step)
            return
        slots = sm.get(self.slot_key) if isinstance(sm, dict) else None
        if slots is None:
            self._off(f"no slot mapping for layer {self.slot_key}")
            return
        T = slots.shape[0]
        if T > self.picks.shape[1]:
            self._off(f"a forward of {T} tokens exceeds the preallocated {self.picks.shape[1]}")
            return
        tb = sck.begin_forward(self.sc, slots, self.token_blocks)
        sck.accumulate_all(self.sc, self.picks[:, :T], tb, backend=self.backend)  # one launch for all layers

    def signatures(self, complete: list[tuple[str, list[int], int]]) -> dict[str, tuple[np.ndarray | None, int, str]]:
        """{req_id: (counts int32 [L, E] or None, prompt tokens, reason)} for requests whose prefill completed."""
        out: dict[str, tuple[np.ndarray | None, int, str]] = {}
        if not complete:
            return out
        if self.sc is None:
            return {rid: (None, n, self.disabled or "no signature cache") for rid, _, n in complete}
        width = max(1, max(len(b) for _, b, _ in complete))
        bt = torch.full((len(complete), width), -1, dtype=torch.int32)
        for i, (_, blocks, _) in enumerate(complete):
            if blocks:
                bt[i, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
        sums, fills = sck.reduce(self.sc, bt.to(self.sc.cache.device), backend=self.backend)
        sums = sums.cpu().numpy()
        fills = fills.cpu().numpy()
        for i, (rid, blocks, n) in enumerate(complete):
            if int(fills[i]) == n and len(blocks) == math.ceil(n / self.sc.block_size):
                out[rid] = (sums[i], n, "")
            else:
                why = ("a block of the prompt was loaded or copied without a forward (external KV load, "
                       "copy-on-write); its expert picks are unknown") if fills[i] < 0 else \
                      f"blocks hold {int(fills[i])} captured tokens, prompt has {n}"
                out[rid] = (None, n, why)
        return out


STATE = CaptureState()
