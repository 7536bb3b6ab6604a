"""The cost model of one MoE forward step on a machine (ELDR §2, Fig. 2), kind "cost-model".

A decode (or prefill) step of a batch over L MoE layers costs, in milliseconds::

    step_ms = sum_l (a + b * active_l + c * tokens)      # MoE part: weights of the distinct experts
            + L * (e + d * tokens)                       # non-MoE part (attention projections, norms)

``active_l`` is the number of *distinct* experts the step's tokens activate at layer l (the union
over the batch), ``tokens`` the tokens in the step (= running requests for decode). The emulator
and the simulator both use :meth:`CostModel.step_ms`, so their step times agree by construction.
Parameters come from ``eldr bench moe-layer`` (real torch timings on this CPU, least squares fit).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from eldr_cli.errors import EldrError

KIND = "cost-model"
# cost-model subclasses by the ``source`` their artifacts carry: how CostModel.load builds one from its params
# (the subclass's module registers itself; the package imports every such module, so the table is complete
# whenever CostModel can be reached: see eldr_cli/costmodel/__init__.py)
_SOURCES: dict[str, Callable[[dict], Any]] = {}


def register_source(source: str, build: Callable[[dict], Any]) -> None:
    """Have :meth:`CostModel.load` build artifacts whose ``params["source"]`` is ``source`` (and that carry their
    ``facts``) with ``build(params)``: a subclass's loader, without the base class importing the subclass."""
    _SOURCES[source] = build


class StepTerms(NamedTuple):
    """A decode step's form, all in ms: ``const + max(m0 + kb*A + kv*C, kc*B + ka*C) + kt*B`` for A charged
    experts (summed over MoE layers), B requests (tokens) and C their summed context (tokens). A tuple, so
    positional readers and numpy (``np.asarray(terms)``, the simulator's compiled loop) keep working."""

    const: float   # fixed per step (per-layer overheads)
    kb: float      # per charged expert: its weight read
    kt: float      # per request (token), outside the roof
    m0: float      # memory constant: the dense weights read once per step
    kv: float      # per context token: its KV read
    kc: float      # compute per request (token)
    ka: float      # compute per context token (attention)
    roof: float    # 1.0: the step is the larger of memory and compute; 0.0: the memory form alone (linear)


def step_ms_from_terms(terms, charged, batch, context):
    """THE decode step (ms): ``const + max(m0 + kb*A + kv*C, kc*B + ka*C) + kt*B`` for A charged experts
    (summed over MoE layers), B requests (tokens) and C their summed context, ``terms`` =
    ``cost.step_terms()`` (:class:`StepTerms`, or the same eight numbers as a tuple or array). Without a roof
    (a measured linear model) the memory form is taken as is. Every consumer evaluates a step through this
    function: the cost models' ``step_ms``, the trace replay, eldr-live's prediction (numpy arrays over
    decoders) and the simulator's compiled loop (``simulator.core.step_time`` is this function compiled by
    numba, which unpacks an array as it does a tuple)."""
    const, kb, kt, m0, kv, kc, ka, roof = terms
    mem = m0 + kb * charged + kv * context
    if roof != 0.0:
        mem = np.maximum(mem, kc * batch + ka * context)
    return const + mem + kt * batch


def _context_sum(context) -> float:
    return 0.0 if context is None else float(np.sum(np.asarray(context, dtype=float)))


@dataclass(frozen=True)
class CostModel:
    a_ms: float           # per MoE layer, per step
    b_ms: float           # per distinct active expert (per layer)
    c_ms: float           # per token per MoE layer
    e_ms: float = 0.0     # non-MoE, per layer per step
    d_ms: float = 0.0     # non-MoE, per token (= per running decode request) per layer
    source: str = "measured"
    device: str = "cpu"
    top_k: int | None = None  # experts per token in the timed layer (scales the per-token MoE term)
    # a GPU deployment (roofline): tp, ep, dtype, gpus_per_instance, kv_capacity_tokens, ...; None for a
    # measured model (no memory limit: decoders are not KV-capped)
    deployment: dict | None = field(default=None, hash=False)
    kv_ms: float = 0.0    # per context token (KV read) per layer: a measured whole decode step has one
    model: str | None = None  # the model whose layer was timed (a measured decode step); None: per layer/expert

    @property
    def ep_ranks(self) -> int:
        """Expert-parallel ranks per instance: a step charges the busiest rank's experts when > 1."""
        return 1

    def spread_active(self, active_total: float) -> float:
        """For estimates without the step's bit sets: the experts charged for a union of ``active_total``
        spread evenly over the EP ranks (a lower bound on the busiest rank's); the union at EP 1."""
        return active_total / self.ep_ranks

    def token_scale(self, top_k: int | None) -> float:
        """A token's expert compute grows with its top-k: a trace of a top-4 model on a cost model timed
        at top-8 pays half the per-token MoE term (the expert-weight term b is unaffected)."""
        return float(top_k) / self.top_k if top_k and self.top_k else 1.0

    def step_ms(self, active_total: float, n_layers: int, tokens: float, token_scale: float = 1.0,
                context=None) -> float:
        """One step: ``active_total`` = sum over the L layers of distinct active experts. ``context`` (the
        running requests' context lengths) feeds a GPU roofline's KV term; a layer timed on this CPU has
        no KV term, so it is ignored here."""
        return float(step_ms_from_terms(self.step_terms(n_layers, token_scale), active_total, tokens,
                                        _context_sum(context)))

    def coefficients(self, token_scale: float = 1.0) -> tuple[float, float, float]:
        """(per-step constant per layer, per active expert, per token per layer) for fast loops."""
        return (self.a_ms + self.e_ms, self.b_ms, self.c_ms * token_scale + self.d_ms)

    def step_terms(self, n_layers: int, token_scale: float = 1.0) -> StepTerms:
        """The simulator's step form (:class:`StepTerms`; A = active experts summed over layers, B = requests,
        C = their summed context). A linear model has no memory constant, compute terms or roof."""
        k0, kb, kt = self.coefficients(token_scale)
        return StepTerms(const=n_layers * k0, kb=kb, kt=n_layers * kt, m0=0.0, kv=n_layers * self.kv_ms, kc=0.0,
                         ka=0.0, roof=0.0)

    def as_params(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        from eldr_cli.artifacts.store import Artifact

        p = Path(path)
        if p.is_file():
            raise EldrError(f"{p} is a file; a cost model is an artifact directory",
                            hint="write one with `eldr bench moe-layer --out DIR`")
        art = Artifact(p, kind=KIND)
        build = _SOURCES.get(str(art.params.get("source")))
        if build is not None and "facts" in art.params:  # a subclass's artifact (a roofline): that subclass
            return build(art.params)
        from eldr_cli.costmodel.deployment import deployment_from_params

        c = art.params["coefficients_ms"]
        # a measured decode step on a known GPU carries its deployment (KV capacity per instance)
        return cls(a_ms=c["a"], b_ms=c["b"], c_ms=c["c"], e_ms=c.get("e", 0.0), d_ms=c.get("d", 0.0),
                   deployment=deployment_from_params(art.params),
                   source=art.params.get("source", "measured"), device=art.params.get("device", "cpu"),
                   top_k=art.params.get("top_k"), kv_ms=c.get("kv", 0.0), model=art.params.get("model"))


class ScaledCostModel:
    """``base`` with its per-expert term (kb: one charged expert's weight read) and its fixed per-step term
    (const: the per-layer fixed costs) scaled: the report's sensitivity of the verdict to the cost model.
    Everything else (KV, dense weights, compute, deployment) is ``base``'s."""

    def __init__(self, base: CostModel, per_expert_scale: float, fixed_scale: float):
        self.base, self.per_expert_scale, self.fixed_scale = base, float(per_expert_scale), float(fixed_scale)

    def step_terms(self, n_layers: int, token_scale: float = 1.0) -> StepTerms:
        t = StepTerms._make(float(x) for x in self.base.step_terms(n_layers, token_scale))
        return t._replace(const=t.const * self.fixed_scale, kb=t.kb * self.per_expert_scale)

    def step_ms(self, active_total: float, n_layers: int, tokens: float, token_scale: float = 1.0,
                context=None) -> float:
        return float(step_ms_from_terms(self.step_terms(n_layers, token_scale), active_total, tokens,
                                        _context_sum(context)))

    def __getattr__(self, name: str):
        return getattr(self.base, name)


MODEL_BOUND = ("roofline", "measured-decode-step")  # cost-model sources that describe one model's whole layer


def model_mismatch(params: dict, n_layers: int, num_experts: int) -> str | None:
    """Why a cost model (its artifact ``params``) does not describe a model of ``n_layers`` MoE layers and
    ``num_experts`` experts, or None. A measured MoE layer alone (``bench moe-layer``) is per layer and per
    expert, usable for any model; a roofline or a measured whole decode step describes one model."""
    if params.get("source") not in MODEL_BOUND:
        return None
    L, E = params.get("n_layers"), params.get("num_experts")
    if (L, E) == (n_layers, num_experts):
        return None
    what = "roofline" if params.get("source") == "roofline" else "measured decode step"
    return f"is a {what} of {params.get('model')} (L={L}, E={E}), not of a model with L={n_layers}, E={num_experts}"


def check_model(path: str | os.PathLike, n_layers: int, num_experts: int) -> None:
    """Refuse the cost model at ``path`` for a trace of another model (L or E): a roofline or a measured
    decode step describes one model; a measured MoE layer alone is per layer and per expert, never refused."""
    from eldr_cli.artifacts.store import Artifact

    why = model_mismatch(Artifact(path).params, n_layers, num_experts)
    if why:
        raise EldrError(f"the cost model {path} {why} (the trace's)",
                        hint="write one for the trace's model: eldr bench cost-model --model CONFIG --device ... "
                             "(or eldr bench decode-step on its GPU)")


def write_cost_model(out: str | os.PathLike, model: CostModel, *, params: dict | None = None,
                     metrics: dict | None = None, tables: dict | None = None, figures=None) -> Path:
    from eldr_cli.artifacts.store import ArtifactWriter

    coeff = {"a": model.a_ms, "b": model.b_ms, "c": model.c_ms, "e": model.e_ms, "d": model.d_ms}
    formula = "step_ms = sum_l (a + b*active_l + c*tokens*top_k_trace/top_k) + L*(e + d*tokens)"
    if model.kv_ms or model.source == "measured-decode-step":  # a measured step states its KV term, 0 or not
        coeff["kv"] = model.kv_ms
        formula += " + L*kv*sum(context)"
    extra = {"model": model.model} if model.model else {}
    with ArtifactWriter(out, kind=KIND, params={
        "kind": "moe-step", "formula": formula, "coefficients_ms": coeff, "source": model.source,
        "device": model.device, "top_k": model.top_k, **extra, **(params or {})}) as w:
        for name, df in (tables or {}).items():
            w.write_table(name, df)
        w.metrics.update(metrics or {})
        if figures is not None:
            figures(w.path)
    return Path(out)
