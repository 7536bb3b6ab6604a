"""A first-principles (roofline) cost model of one MoE decode step on a GPU: `eldr bench cost-model`.

A decode step of B running requests reads, once per step, from HBM:
  - the dense weights (attention, dense MLP layers, shared experts, routers, the LM head),
  - the weights of the routed experts the batch activates (summed over MoE layers),
  - the KV cache of every running request at its current context length;
and it does 2 FLOPs per weight per token plus attention over the context. Its time is
``max(memory time, compute time) + n_layers * overhead``, memory time using one achieved-bandwidth
efficiency factor. Everything is per GPU of one instance, sharded as vLLM shards it:

  - tensor parallelism (TP ranks): each rank holds and reads 1/TP of the dense weights and, with
    EP = 1, 1/TP of *every* expert (vLLM's FusedMoE splits each expert's intermediate dimension over
    the TP ranks), so a step charges the union of active experts at 1/TP of an expert's bytes; KV heads
    split TP ways, and when TP > KV heads each rank keeps one head (replicated, as vLLM does); an MLA
    latent cache (DeepSeek) is replicated on every rank;
  - expert parallelism (EP ranks, vLLM's ``--enable-expert-parallel``: EP = TP x DP, attention
    data-parallel over DP = EP/TP groups): each rank holds whole experts, contiguous (rank r holds
    experts [r*E/EP, (r+1)*E/EP) of every layer), and a layer waits for its busiest rank, so a step
    charges, summed over MoE layers, the max over ranks of that rank's active experts (METRO's metric;
    the simulator counts it from the step's expert bit sets), at one expert's full bytes. The batch and
    its KV split evenly over the DP groups.

Memory, the fit rule and the KV capacity in tokens are in :mod:`eldr_cli.costmodel.deployment`.

The two free constants (bandwidth efficiency, per-layer overhead) are calibrated once, so that the
MI300X + Qwen3-30B-A3B preset reproduces the ELDR paper's Fig. 2 figure: one MoE layer at batch 64
costs 4.7x more with 128 active experts than with 16. One ratio pins one relation between the two, so
the efficiency is fixed at a stated value and the overhead solved from the ratio.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, TypedDict

import numpy as np

from eldr_cli.costmodel.calibration import calibration_for
from eldr_cli.costmodel.deployment import (
    DEPLOYMENT_KEYS,
    GPU_MEMORY_UTILIZATION,
    MIN_KV_TOKENS,
    Deployment,
    deployment_from_params,
    plan,
)
from eldr_cli.costmodel.model import CostModel, StepTerms, register_source, step_ms_from_terms, write_cost_model
from eldr_cli.costmodel.presets import DTYPE_BYTES, DTYPE_FLOPS, ModelFacts, device_facts, model_config, model_facts
from eldr_cli.errors import EldrError


class Calibration(TypedDict):
    device: str
    model: str
    batch: int
    active: tuple[int, int]
    ratio: float
    source: str


CALIBRATION: Calibration = {"device": "MI300X", "model": "Qwen3-30B-A3B", "batch": 64, "active": (16, 128),
                            "ratio": 4.7, "source": "ELDR paper Fig. 2 (one MoE layer, one MI300X)"}
# Achieved fraction of peak HBM bandwidth for large streaming weight reads: an assumption (typical of
# measured decode kernels), not fitted, because Fig. 2 gives a ratio and a ratio pins one constant.
BANDWIDTH_EFFICIENCY = 0.75
KV_BYTES = 2.0  # KV cache kept in bf16 whatever the weight dtype


@dataclass(frozen=True)
class Roofline:
    facts: ModelFacts
    hbm_tbps: float
    tflops: float               # peak dense BF16
    dtype: str = "bf16"
    tp: int = 1
    ep: int = 1
    efficiency: float = BANDWIDTH_EFFICIENCY   # achieved / nominal HBM bandwidth, weight reads
    attn_fixed_us: float = 0.0  # per decoder layer per step (attention's fixed cost)
    moe_fixed_us: float = 0.0   # per MoE layer per step (the expert GEMMs' fixed cost)
    kv_efficiency: float = 0.0  # achieved / nominal HBM bandwidth, KV reads (0: as ``efficiency``)
    compute_efficiency: float = 1.0  # achieved / peak tensor FLOP/s

    @property
    def overhead_us(self) -> float:
        """The fixed cost per step averaged per decoder layer (attention's and the MoE layers')."""
        f = self.facts
        return self.attn_fixed_us + self.moe_fixed_us * f.moe_layers / f.n_layers

    @property
    def dp(self) -> int:
        """Attention data-parallel groups: EP = TP x DP under expert parallelism, else 1."""
        return self.ep // self.tp if self.ep > 1 else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.efficiency

    @property
    def kv_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * (self.kv_efficiency or self.efficiency)

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * DTYPE_FLOPS[self.dtype] * self.compute_efficiency

    @property
    def expert_bytes(self) -> float:
        """Bytes of one routed expert (all ranks together)."""
        return self.facts.expert_params * DTYPE_BYTES[self.dtype]

    @property
    def expert_read_bytes(self) -> float:
        """Bytes one GPU reads per charged active expert: 1/TP of each (TP shards every expert), or the
        whole expert on the rank that holds it (EP)."""
        return self.expert_bytes / (self.tp if self.ep == 1 else 1)

    @property
    def kv_share(self) -> float:
        """The fraction of a token's KV one TP rank holds: max(1, KV heads // TP) of the KV heads (vLLM
        replicates a head when TP > KV heads); an MLA latent cache is replicated on every rank."""
        h = self.facts.kv_heads
        return 1.0 if h == 0 else max(1, h // self.tp) / h

    @property
    def kv_bytes_per_token_gpu(self) -> float:
        """KV bytes one token of context takes on each GPU that holds it (all layers)."""
        f = self.facts
        return f.kv_elems_per_token_layer * f.n_layers * KV_BYTES * self.kv_share

    def weights_resident_bytes(self) -> float:
        """Weight bytes each GPU holds: dense (and embedding) 1/TP, experts 1/TP of all (EP = 1) or E/EP
        whole experts per layer (EP)."""
        f, w = self.facts, DTYPE_BYTES[self.dtype]
        experts = f.num_experts * f.moe_layers * f.expert_params
        return ((f.dense_params + f.embed_params) / self.tp + experts / (self.tp if self.ep == 1 else self.ep)) * w

    def weights_read_bytes(self, active_total: float) -> float:
        """Weight bytes one GPU reads in a step charging ``active_total`` experts (summed over MoE layers:
        the union with EP = 1, the busiest rank's with EP > 1)."""
        return self.facts.dense_params * DTYPE_BYTES[self.dtype] / self.tp + active_total * self.expert_read_bytes

    def step_terms(self) -> StepTerms:
        """The step as a linear decomposition, all in ms (:class:`~eldr_cli.costmodel.StepTerms`):
        ``step = const + max(m0 + kb*A + kv*C, kc*B + ka*C) + kt*B`` for A charged active experts summed
        over MoE layers (see :meth:`weights_read_bytes`), B requests and C their summed context (tokens),
        per GPU. The simulator's compiled loop evaluates exactly this form; :meth:`memory_ms`,
        :meth:`compute_ms`, :meth:`step_ms` use it too."""
        f, w = self.facts, DTYPE_BYTES[self.dtype]
        bw, fl = self.bytes_per_s / 1e3, self.flops_per_s / 1e3  # per ms
        return StepTerms(
            const=(f.n_layers * self.attn_fixed_us + f.moe_layers * self.moe_fixed_us) / 1e3,
            kb=self.expert_read_bytes / bw,
            kt=0.0,
            m0=f.dense_params * w / self.tp / bw,
            kv=self.kv_bytes_per_token_gpu / self.dp / (self.kv_bytes_per_s / 1e3),
            kc=2 * (f.dense_params / self.gpus + f.top_k * f.moe_layers * f.expert_params / self.gpus) / fl,
            ka=2 * f.attn_dim * f.n_layers / self.gpus / fl,
            roof=1.0)

    def memory_ms(self, active_total: float, context_tokens: float) -> float:
        t = self.step_terms()
        return t.m0 + t.kb * active_total + t.kv * context_tokens

    def compute_ms(self, batch: int, context_tokens: float) -> float:
        t = self.step_terms()
        return t.kc * batch + t.ka * context_tokens

    def step_ms(self, active_total: float, contexts) -> float:
        """One decode step: ``contexts`` = each running request's current context length (tokens)."""
        ctx = np.asarray(contexts, dtype=float)
        return float(terms_ms(self.step_terms(), active_total, int(ctx.size), float(ctx.sum())))

    def moe_layer_ms(self, batch: int, active: int) -> float:
        """One MoE layer's expert computation alone on one GPU (the quantity of the paper's Fig. 2 and of the
        measured tables): max(weight read, GEMM FLOPs) + the MoE layer's fixed cost."""
        mem = active * self.expert_read_bytes / self.bytes_per_s
        comp = 2 * batch * self.facts.top_k * self.facts.expert_params / self.gpus / self.flops_per_s
        return (max(mem, comp) + self.moe_fixed_us / 1e6) * 1e3

    def attention_layer_ms(self, batch: int, context: int) -> float:
        """One decode-attention layer's KV read on one GPU: ``batch`` requests of ``context`` tokens each."""
        kv_layer = self.kv_bytes_per_token_gpu / self.facts.n_layers
        return (batch * context * kv_layer / self.dp / self.kv_bytes_per_s + self.attn_fixed_us / 1e6) * 1e3

    def linear(self, context: int) -> CostModel:
        """Memory-bound linearisation in the simulator's form (per trace layer = per MoE layer):
        a = overhead and dense weights, b = one expert, c = one request's KV at ``context`` tokens."""
        L = self.facts.moe_layers
        t = self.step_terms()
        return CostModel(a_ms=(t.m0 + t.const) / L, b_ms=t.kb, c_ms=context * t.kv / L,
                         source="roofline", device="", top_k=None)


terms_ms = step_ms_from_terms  # the one step formula (eldr_cli.costmodel), under its earlier name


@dataclass(frozen=True)
class RooflineCostModel(CostModel):
    """A roofline `cost-model` artifact in the interface the simulator and emulator use. With ``context``
    (the running requests' context lengths) a step is the roofline itself, KV of every request at its own
    context included; without it (a prefill step), the roofline with no KV read. ``coefficients`` stays
    the artifact's memory-bound linearisation (KV at its ``reference_context``) for callers that need
    a linear form."""

    roofline: Roofline | None = None
    reference_context: int = 0

    def _roof(self) -> Roofline:
        assert self.roofline is not None
        return self.roofline

    @cached_property
    def _terms(self) -> StepTerms:
        return self._roof().step_terms()

    def step_terms(self, n_layers: int, token_scale: float = 1.0) -> StepTerms:
        return self._terms

    @property
    def ep_ranks(self) -> int:
        return self._roof().ep

    def step_ms(self, active_total: float, n_layers: int, tokens: float, token_scale: float = 1.0,
                context=None) -> float:
        c = 0.0 if context is None else float(np.sum(np.asarray(context, dtype=float)))
        return float(terms_ms(self._terms, active_total, tokens, c))

    @classmethod
    def from_params(cls, p: dict) -> "RooflineCostModel":
        """From the params of an artifact written by :func:`run_cost_model`."""
        r = Roofline(ModelFacts(**p["facts"]), float(p["hbm_tbps"]), float(p["tflops_bf16"]), dtype=p["dtype"],
                     tp=int(p["tp"]), ep=int(p["ep"]), efficiency=float(p["bandwidth_efficiency"]),
                     **_fixed_costs(p))
        c = p["coefficients_ms"]
        dep = deployment_from_params(p)  # none in artifacts written before deployments were checked (no cap)
        return cls(a_ms=c["a"], b_ms=c["b"], c_ms=c["c"], e_ms=c.get("e", 0.0), d_ms=c.get("d", 0.0),
                   source="roofline", device=p.get("device", ""), top_k=p.get("top_k"), deployment=dep,
                   roofline=r, reference_context=int(p.get("reference_context", 0)))


def _fixed_costs(p: dict) -> dict:
    """The roofline's calibrated constants from artifact params; an artifact written before calibrations
    has one per-layer overhead, charged on every layer as it was."""
    c = p.get("calibration") or {}
    if "moe_fixed_us" in c:
        return {k: float(c[k]) for k in ("attn_fixed_us", "moe_fixed_us", "kv_efficiency", "compute_efficiency")}
    return {"attn_fixed_us": float(p["overhead_us_per_layer"])}


def calibrate(efficiency: float = BANDWIDTH_EFFICIENCY) -> float:
    """Per-layer overhead (us) that makes MI300X + Qwen3-30B-A3B reproduce the Fig. 2 ratio."""
    _, bw, tf, _ = device_facts(CALIBRATION["device"])
    r = Roofline(model_facts(model_config(CALIBRATION["model"])[1]), bw, tf, efficiency=efficiency)
    b, (lo, hi), ratio = CALIBRATION["batch"], CALIBRATION["active"], CALIBRATION["ratio"]
    t_lo, t_hi = r.moe_layer_ms(b, lo) / 1e3, r.moe_layer_ms(b, hi) / 1e3
    # (o + t_hi) / (o + t_lo) = ratio
    return max((t_hi - ratio * t_lo) / (ratio - 1), 0.0) * 1e6


def calibrated(device: str | None, model: str, dtype: str) -> tuple[Callable[[int], dict], dict]:
    """(tp -> the Roofline's calibrated keyword arguments, the artifact's ``calibration`` params without
    the shape-dependent MoE fixed cost). A device preset with a shipped measurement (see
    :mod:`eldr_cli.costmodel.calibration`) takes every constant from it; any other keeps the assumed
    efficiency and the MoE fixed cost solved from the paper's MI300X ratio, and says it is not measured."""
    cal = calibration_for(device) if device else None
    if cal is None:
        overhead = calibrate()
        kw = {"efficiency": BANDWIDTH_EFFICIENCY, "attn_fixed_us": 0.0, "moe_fixed_us": overhead,
              "kv_efficiency": BANDWIDTH_EFFICIENCY, "compute_efficiency": 1.0}
        doc = {**kw, "measured": False, "provenance": (
            f"roofline NOT calibrated on a measurement of {device or 'this custom GPU'}: bandwidth efficiency "
            f"{BANDWIDTH_EFFICIENCY} assumed, MoE fixed cost {overhead:.1f} us solved from the ELDR paper's "
            f"Fig. 2 ratio on MI300X"), "fig2": {**CALIBRATION, "active": list(CALIBRATION["active"])}}
        return (lambda tp: kw), doc
    base = {"efficiency": cal.weight_efficiency, "attn_fixed_us": cal.attn_fixed_us,
            "kv_efficiency": cal.kv_efficiency, "compute_efficiency": cal.compute_efficiency}
    doc = {**base, "measured": True, "gpu": cal.gpu, "source": cal.source, "notes": cal.notes,
           "provenance": f"roofline calibrated on measurements of {cal.gpu} ({device} preset)"}
    return (lambda tp: {**base, "moe_fixed_us": cal.moe_fixed(model, tp, dtype)[0]}), doc


def calibration_params(device: str | None, model: str, r: Roofline) -> dict:
    """The ``calibration`` params of a roofline artifact, the shape's MoE fixed cost and its provenance."""
    _, doc = calibrated(device, model, r.dtype)
    cal = calibration_for(device) if device else None
    how = cal.moe_fixed(model, r.tp, r.dtype)[1] if cal else "solved from the MI300X Fig. 2 ratio"
    return {**doc, "moe_fixed_us": r.moe_fixed_us, "moe_fixed_how": how,
            "provenance": f"{doc['provenance']}; MoE fixed cost {r.moe_fixed_us:.0f} us per layer ({how})"}


def build(model: str | os.PathLike, *, device: str | None = None, hbm_tbps: float | None = None,
          tflops: float | None = None, hbm_gb: float | None = None, dtype: str = "bf16", tp: int | None = None,
          ep: int = 1, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
          min_kv_tokens: int = MIN_KV_TOKENS) -> tuple[str, str, Roofline, Deployment]:
    """(model name, device label, roofline, deployment); refuses a deployment that does not fit, and picks
    the smallest TP that does when ``tp`` is None (see :mod:`eldr_cli.costmodel.deployment`)."""
    if dtype not in DTYPE_BYTES:
        raise EldrError(f"unknown --dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    name, cfg = model_config(model)
    facts = model_facts(cfg)
    if device:
        dev, bw, tf, gb = device_facts(device)
        bw, tf, gb = hbm_tbps or bw, tflops or tf, hbm_gb or gb
    elif hbm_tbps and tflops and hbm_gb:
        dev, bw, tf, gb = f"custom GPU ({hbm_tbps} TB/s, {tflops} TFLOP/s)", hbm_tbps, tflops, hbm_gb
    else:
        raise EldrError("give --device NAME, or --hbm-tbps, --tflops and --hbm-gb (a custom GPU)")
    if min(bw, tf) <= 0:
        raise EldrError("--hbm-tbps and --tflops must be > 0")
    const, _ = calibrated(dev if device else None, name, dtype)
    r, d = plan(lambda t: Roofline(facts, bw, tf, dtype=dtype, tp=t, ep=ep, **const(t)), facts,
                model=name, device=dev, tp=tp, ep=ep, hbm_gb=gb, util=gpu_memory_utilization,
                min_kv_tokens=min_kv_tokens)
    return name, dev, r, d


def run_cost_model(out: str | os.PathLike, model: str | os.PathLike, *, device: str | None = None,
                   hbm_tbps: float | None = None, tflops: float | None = None, hbm_gb: float | None = None,
                   dtype: str = "bf16", tp: int | None = None, ep: int = 1, context: int = 2048,
                   gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                   min_kv_tokens: int = MIN_KV_TOKENS) -> Path:
    """Write a `cost-model` artifact (source "roofline") usable by the simulator and the emulator; its
    params carry the deployment (``tp``, ``ep``, ``dtype``, ``gpus_per_instance``, ``kv_capacity_tokens``
    and the rest under ``deployment``)."""
    if context < 0:
        raise EldrError("--context must be >= 0")
    name, dev, r, d = build(model, device=device, hbm_tbps=hbm_tbps, tflops=tflops, hbm_gb=hbm_gb, dtype=dtype,
                            tp=tp, ep=ep, gpu_memory_utilization=gpu_memory_utilization,
                            min_kv_tokens=min_kv_tokens)
    lin = r.linear(context)
    lin = CostModel(**{**lin.as_params(), "device": dev})
    f = r.facts
    b = CALIBRATION["batch"]
    lo, hi = CALIBRATION["active"]
    def even(per_layer: int) -> float:  # with EP: the experts spread evenly over the ranks (a lower bound)
        return math.ceil(per_layer / r.ep) * f.moe_layers

    metrics = {
        "fig2_ratio_128_vs_16_batch64": r.moe_layer_ms(b, hi) / r.moe_layer_ms(b, lo),
        "step_ms_batch1": r.step_ms(even(f.top_k), [context]),
        "step_ms_batch64_rr_like": r.step_ms(even(min(f.num_experts, 64 * f.top_k)), [context] * 64),
        "weights_gb_per_gpu": d.weights_gb_per_gpu, "kv_capacity_tokens": d.kv_capacity_tokens,
    }
    dep = d.as_params()
    return write_cost_model(out, lin, params={
        "source_detail": "first-principles roofline, not measured", "model": name,
        **{k: dep[k] for k in DEPLOYMENT_KEYS}, "deployment": dep,
        "hbm_tbps": r.hbm_tbps, "tflops_bf16": r.tflops, "bandwidth_efficiency": r.efficiency,
        "overhead_us_per_layer": r.overhead_us, "reference_context": context,
        "roofline": "step_ms = max(memory, compute) + n_layers*overhead, per GPU; memory = (dense/TP + charged "
                    "experts' weights (union at 1/TP each; with EP the busiest rank's, whole) + every request's "
                    "KV at its context) / (HBM bandwidth x efficiency)",
        "calibration": calibration_params(dev if device else None, name, r),
        "linearisation": "coefficients are the memory-bound form per MoE layer, KV at reference_context",
        "facts": asdict(f), "n_layers": f.moe_layers, "num_experts": f.num_experts},
        metrics=metrics)


register_source("roofline", RooflineCostModel.from_params)  # CostModel.load of a roofline artifact
