"""Deployments that exist: the weights and a minimum KV pool must fit in an instance's HBM.

An instance is ``gpus_per_instance`` GPUs (TP, or TP x DP = EP under expert parallelism; see
:mod:`eldr_cli.costmodel.roofline` for how vLLM shards weights and KV over them). Each GPU holds its
share of the weights; vLLM gives the KV cache what is left of ``HBM x gpu_memory_utilization``
(vLLM's ``--gpu-memory-utilization``, default 0.9; activations and CUDA graphs are taken to fit in
the remaining 10%). The instance's KV capacity in tokens is::

    kv_capacity_tokens = DP * floor((HBM * util - weight bytes per GPU) / KV bytes per token per GPU)

(a token's KV lives on the TP ranks of one DP group). A deployment *fits* when that is at least
``min_kv_tokens`` (default 65,536: 32 requests of 2,048 tokens). Without ``--tp`` the smallest TP
of 1, 2, 4, 8 that fits is chosen, then 16 with a note (two 8-GPU nodes); nothing fitting is an
error that names the sizes. GB = 1e9 bytes throughout, HBM taken at the vendor's nominal size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Protocol, TypeVar

from eldr_cli.costmodel.presets import DTYPE_BYTES, ModelFacts
from eldr_cli.errors import EldrError


class Sharded(Protocol):
    """What a deployment reads of a model sharded on GPUs (a :class:`eldr_cli.costmodel.roofline.Roofline`,
    which sits above this module and builds on it)."""

    @property
    def facts(self) -> ModelFacts: ...
    @property
    def tp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def dp(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def kv_bytes_per_token_gpu(self) -> float: ...
    def weights_resident_bytes(self) -> float: ...


R = TypeVar("R", bound=Sharded)

GPU_MEMORY_UTILIZATION = 0.9
MIN_KV_TOKENS = 65536
TP_CHOICES = (1, 2, 4, 8, 16)
KV_BLOCK_TOKENS = 16  # vLLM's default KV block size (the simulator and the emulator allocate in blocks)
# the params keys every roofline cost model carries at its top level (tools read them), in the order the report
# states a decode instance (report.json's verdict.deployment, report.md's facts)
DEPLOYMENT_KEYS = ("gpus_per_instance", "tp", "ep", "dtype", "kv_capacity_tokens")


def deployment_from_params(params: dict) -> dict | None:
    """The deployment a cost-model artifact's ``params`` carry (its ``deployment`` dict and the top-level
    keys), or None when it has no KV capacity (a CPU-measured model, or one written before deployments were
    checked): decoders are then not KV-capped."""
    if "kv_capacity_tokens" not in params:
        return None
    return {**params.get("deployment", {}), **{k: params[k] for k in DEPLOYMENT_KEYS if k in params}}


TP16_NOTE = "TP16 is 16 GPUs per instance: two 8-GPU nodes (vLLM runs it with multi-node parallelism)"


@dataclass(frozen=True)
class Deployment:
    tp: int
    ep: int
    dtype: str
    gpus_per_instance: int
    kv_capacity_tokens: int
    hbm_gb_per_gpu: float
    gpu_memory_utilization: float
    weights_gb: float             # the model's weights, all GPUs together (dense counted once)
    weights_gb_per_gpu: float
    kv_bytes_per_token: float     # one token's KV over the TP ranks that hold it
    min_kv_tokens: int
    tp_chosen: str = "given"      # "given" (--tp) or "auto" (the smallest that fits)
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.kv_capacity_tokens >= self.min_kv_tokens

    def as_params(self) -> dict:
        return asdict(self)


def model_weights_bytes(facts: ModelFacts, dtype: str) -> float:
    """Every weight of the model once (dense, embedding, all routed experts)."""
    experts = facts.num_experts * facts.moe_layers * facts.expert_params
    return (facts.dense_params + facts.embed_params + experts) * DTYPE_BYTES[dtype]


def deployment_of(r: Sharded, *, hbm_gb: float, util: float = GPU_MEMORY_UTILIZATION,
                  min_kv_tokens: int = MIN_KV_TOKENS) -> Deployment:
    """Memory and KV capacity of one instance of ``r``'s sharding on GPUs of ``hbm_gb`` each."""
    w_gpu = r.weights_resident_bytes()
    free = hbm_gb * 1e9 * util - w_gpu
    per_tok = r.kv_bytes_per_token_gpu
    cap = r.dp * max(0, math.floor(free / per_tok)) if per_tok > 0 else 0
    return Deployment(tp=r.tp, ep=r.ep, dtype=r.dtype, gpus_per_instance=r.gpus, kv_capacity_tokens=int(cap),
                      hbm_gb_per_gpu=float(hbm_gb), gpu_memory_utilization=float(util),
                      weights_gb=model_weights_bytes(r.facts, r.dtype) / 1e9, weights_gb_per_gpu=w_gpu / 1e9,
                      kv_bytes_per_token=per_tok * r.tp, min_kv_tokens=int(min_kv_tokens))


def sharding_problem(facts: ModelFacts, tp: int, ep: int) -> str | None:
    """Why vLLM cannot shard the model TP x EP this way, or None."""
    if tp < 1 or facts.heads % tp:
        return f"--tp {tp} must divide the model's {facts.heads} attention heads"
    h = facts.kv_heads
    if h and h % tp and tp % h:
        return f"--tp {tp} and the model's {h} KV heads must divide one another (as vLLM requires)"
    if ep < 1 or facts.num_experts % ep:
        return f"--ep {ep} must divide the model's {facts.num_experts} experts"
    if ep > 1 and ep % tp:
        return f"--ep {ep} must be a multiple of --tp {tp} (vLLM's expert parallelism spans TP x DP ranks)"
    return None


def no_fit_message(d: Deployment, model: str, device: str) -> str:
    return (f"{model} in {d.dtype} does not fit TP{d.tp} EP{d.ep} on {d.gpus_per_instance} x {device}: weights "
            f"{d.weights_gb:.1f} GB ({d.weights_gb_per_gpu:.1f} GB per GPU) against {d.hbm_gb_per_gpu:g} GB HBM "
            f"per GPU ({d.gpu_memory_utilization:.0%} usable) leave {d.kv_capacity_tokens:,} KV tokens, below "
            f"the minimum pool of {d.min_kv_tokens:,}")


def plan(make: Callable[[int], R], facts: ModelFacts, *, model: str, device: str, tp: int | None, ep: int,
         hbm_gb: float, util: float = GPU_MEMORY_UTILIZATION,
         min_kv_tokens: int = MIN_KV_TOKENS) -> tuple[R, Deployment]:
    """The roofline and deployment for ``tp`` (checked), or the smallest TP that fits when ``tp`` is None.
    ``make(tp)`` builds the roofline of one TP degree."""
    if not 0 < util <= 1:
        raise EldrError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if hbm_gb <= 0 or min_kv_tokens < 1:
        raise EldrError("--hbm-gb must be > 0 and --min-kv-tokens >= 1")
    deploy = partial(deployment_of, hbm_gb=hbm_gb, util=util, min_kv_tokens=min_kv_tokens)
    if tp is not None:
        problem = sharding_problem(facts, tp, ep)
        if problem:
            raise EldrError(problem)
        r = make(tp)
        d = deploy(r)
        if not d.fits:
            raise EldrError(no_fit_message(d, model, device),
                            hint="a larger --tp (or none: the smallest that fits is chosen), --dtype fp8, "
                                 "or a GPU with more HBM")
        return r, replace(d, note=TP16_NOTE if tp >= 16 else "")
    last, tried = None, []
    for t in TP_CHOICES:
        if sharding_problem(facts, t, ep):
            continue
        r = make(t)
        last = deploy(r)
        tried.append(str(t))
        if last.fits:
            return r, replace(last, tp_chosen="auto", note=TP16_NOTE if t >= 16 else "")
    if last is None:
        raise EldrError(sharding_problem(facts, 1, ep) or "no TP of 1, 2, 4, 8, 16 shards this model")
    raise EldrError(no_fit_message(last, model, device) + f"; no TP that shards it ({', '.join(tried)}) fits",
                    hint="--dtype fp8 (or mxfp4), or a GPU with more HBM")
