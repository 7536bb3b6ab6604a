"""``eldr-live``: the cost-aware decode policy (issue 21; beyond the paper's locality band).

Per decoder it keeps the live set of its in-flight requests (:class:`eldr_cli.routing.live_set.LiveSet`), each
as the per-step decode activation its prefill predicts (:class:`eldr_cli.routing.live_set.PrefillPredictor`: the
nearest prototype's mean, shrunk per layer toward the request's own prefill distribution where the fit found
that better; :mod:`eldr_cli.method.live`), and their context tokens. For each candidate decoder d it predicts
the next decode step with and without the new request through the cost model's step form (``CostModel.step_terms``)::

    q_d(l, e)  = prod over d's requests r of (1 - a_r(l, e))      P(expert e of layer l idle in a step)
    A_d        = sum_{l,e} (1 - q_d(l, e))                        expected distinct active experts
    dA_d       = sum_{l,e} q_d(l, e) * a_new(l, e)                experts the new request adds
    T_d        = step(A_d, B_d, C_d)                              (0 for an idle decoder)
    T'_d       = step(A_d + dA_d, B_d + 1, C_d + c_new)
    cost_d     = T'_d + B_d * (T'_d - T_d)                        new request's TPOT + slowdown of the others

and picks the decoder with the least cost among those within a load cap of the least loaded. Under load
(decoders run ``LOW_LOAD_MEAN`` or more requests on average) each cost is ranked times eldr's band as a prior::

    prior_d    = 1 + BAND_PRIOR * (max_j s_j - s_d) / tau         s_d: the request's cosine to d's centroid

(the paper's band, §4.3.2, made soft: a decoder far from the request's cluster must be that much cheaper; it
keeps each decoder's batch drawn from a stable share of the traffic, which the one-request-ahead cost does not
see). Only where the fit found the band tight (:func:`band_prior_weight`, the artifact's ``band_prior``); none
without the fit's centroids for these K decoders or the request's prefill counts. Each request's prior is
computed once, with its prediction (``LiveEntry.prior``). Ties go to
fewer in flight, then to the decoder sent a request longest ago (as round-robin would); while decoders run
fewer than ``LOW_LOAD_MEAN`` requests on average, costs within ``COST_TIE`` count as ties, because in-flight
counts then say little about the work left and there is little to share (measured: without it eldr-live
matched JSQ at 20% load, 2% above round-robin). An idle decoder costs one lone step, so at low load
requests spread; under load a decoder whose batch already runs the request's experts adds the least, as
in ELDR; the cap bounds how uneven batches may get (the tail). B_d are the loads the caller passes (local
+ remote in the proxy).

Replicas share the live set as integer counts per (decoder, prototype) plus context tokens
(:meth:`EldrLivePolicy.export_state` / :meth:`EldrLivePolicy.merge_state`), which sum across replicas: another
replica's request counts as its prototype's mean, a replica's own requests as their own prediction.

The ranking it returns holds the predicted costs, their growth per request in flight that the loads left out
(``d cost / d B = T1 - T + kt``), the prior and the load cap (slack): the replicas' reservation redoes this rule
on Redis's exact counts (the least ``(cost + (exact - seen) * growth) * prior`` among the decoders within the
cap of the least reserved, ties within ``COST_TIE`` to fewer in flight), so that neither the cap nor the
ranking rests on this replica's stale view of the others' requests.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from eldr_cli.costmodel import StepTerms
from eldr_cli.errors import EldrError
from eldr_cli.routing.compiled import live_choice
from eldr_cli.routing.live_set import ActivationSource, LiveEntry, LiveSet, PrefillPredictor
from eldr_cli.routing.model import RoutingModel
from eldr_cli.routing.policies import Policy, Ranking, rerank

# Without a cost model: the shape of the paper's Fig. 2 (MI300X, Qwen3-30B-A3B, batch 64: 16 -> 128
# active experts raise a layer's latency 4.7x; batch barely moves it), in units of one expert's read.
# (a + 128 b) / (a + 16 b) = 4.7  ->  a = 14.27 b. A relative shape, not a time: decisions only compare.
DEFAULT_STEP_TERMS_PER_LAYER = (14.27, 1.0, 0.01)  # (per layer, per active expert, per request per layer)
COST_TIE = 0.03          # costs within 3% are ties ...
LOW_LOAD_MEAN = 4.0      # ... while decoders run fewer than this many requests on average
LOAD_CAP_MIN = 2          # a decoder may run this many more requests than the least loaded ...
LOAD_CAP_FRACTION = 0.25  # ... or this share of the mean load, whichever is larger
# Under load (LOW_LOAD_MEAN or more in flight on average) each decoder's cost is ranked times
# 1 + BAND_PRIOR * (max_j s_j - s_k) / tau, s_k the request's cosine to decoder k's centroid (the band's) ...
BAND_PRIOR = 0.5
# ... where the fit finds the band tight: its calibration requests' mean cosine to their nearest centroid is at
# least 1 - BAND_TRUST * tau (they sit well inside their own band; band_prior_weight)
BAND_TRUST = 0.5


class LiveDetail(NamedTuple):
    """What eldr-live needs back at dispatch (``Ranking.detail``): the request's live entry and context tokens."""

    entry: LiveEntry
    tokens: int

    @property
    def prototype(self) -> int:
        return self.entry.prototype

    @property
    def cells(self) -> np.ndarray | None:
        """The request's Eq. 2 cells (float64 [N* x E], not normalized; None when not predicted from its counts)."""
        return self.entry.cells


def step_form(cost, n_layers: int) -> StepTerms:
    """The decode step's form (``CostModel.step_terms``) eldr-live predicts with."""
    if cost is None:
        a, b, c = DEFAULT_STEP_TERMS_PER_LAYER
        return StepTerms(n_layers * a, b, n_layers * c, 0.0, 0.0, 0.0, 0.0, 0.0)
    terms = StepTerms(*(float(x) for x in cost.step_terms(n_layers, 1.0)))
    # A_d is an expected union; with expert parallelism a step pays for the busiest rank's experts, taken
    # here as the union spread evenly over the ranks (CostModel.spread_active; x 1 without EP)
    return terms._replace(kb=terms.kb * cost.spread_active(1.0))


def band_prior_weight(drift: dict | None, tau: float) -> float:
    """The band prior's weight ``eldr fit`` stores (``params.band_prior``) from its calibration figures (``drift``:
    :func:`eldr_cli.routing.drift.calibration_stats`): :data:`BAND_PRIOR` where the calibration requests' mean
    cosine to their nearest centroid is at least ``1 - BAND_TRUST * tau``, else 0 (no prior)."""
    mean = ((drift or {}).get("centroid") or {}).get("mean")
    return BAND_PRIOR if mean is not None and float(mean) >= band_bar(tau) else 0.0


def band_bar(tau: float) -> float:
    """The calibration requests' mean cosine to their centroid at which the fit trusts the band (1 - BAND_TRUST tau)."""
    return 1.0 - BAND_TRUST * float(tau)


def live_set(n_workers: int, model: RoutingModel | None, cost=None,
             source: ActivationSource | None = None) -> LiveSet:
    """A live set over ``n_workers`` decoders predicting with the routing artifact's decode-activation model (or
    ``source``) and the cost model's step form: eldr-live's own, or a shadow's predictor of an assignment."""
    if model is None:
        raise EldrError("the eldr-live policy needs a routing artifact (--routing DIR)")
    src = source if source is not None else PrefillPredictor(model)
    return LiveSet(n_workers, src, step_form(cost, model.shape[0]))


class EldrLivePolicy(Policy):
    name = "eldr-live"
    needs_signature = True
    unit_signature = False

    def __init__(self, n_workers: int, model: RoutingModel | None = None, cost=None,
                 source: ActivationSource | None = None, **_: Any):
        self.n = n_workers
        self.live = live_set(n_workers, model, cost, source)  # the public live-set API (routing.live_set)
        self.terms = self.live.terms
        self._terms = np.asarray(self.terms, dtype=np.float64)  # what the compiled cost loop reads
        # the band prior (each request's entry carries it) needs a centroid per decoder: a fit for another K has none
        self._band_ok = model is not None and model.n_clusters == n_workers

    def request(self, counts: Any, key: Any = None) -> LiveEntry | None:
        """The request's live entry from its prefill counts (what the router passes to :meth:`rank`)."""
        return self.live.source.entry(counts, key)

    # -- the decision ---------------------------------------------------------------------------------
    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        """``signature``: the request's :class:`LiveEntry` (what the router passes; None: the mean request; a bare
        vector: what the source makes of it, see ``ActivationSource.of_vector``)."""
        src = self.live.source
        entry = signature if isinstance(signature, LiveEntry) else src.mean() if signature is None \
            else src.of_vector(signature)
        c_new = int(tokens or 0)
        return self._choose(loads, entry.activation, c_new, LiveDetail(entry, c_new))

    def _choose(self, loads, a_new: np.ndarray, c_new: int, detail: Any) -> Ranking:
        """The rule on the new request's per-step activation probabilities ``a_new`` [L*E]."""
        q, active, C = self.live.view()
        ld = loads.tolist() if isinstance(loads, np.ndarray) else list(loads)
        # each decoder's next step without and with the request (its expected new experts and its context), by
        # the one step formula the simulator and the replay use, compiled over the K decoders (routing.compiled:
        # the same double operations in the same order as on Python floats); the growth is d cost / d B: one more
        # request there that these loads left out makes the new one's step kt longer and adds one more request it
        # slows down by (T1 - T) (the replicas' reservation redoes this rule on Redis's exact counts)
        predicted, growth = live_choice(self._terms, np.asarray(ld, dtype=np.int64), active, C, q @ a_new, c_new)
        slack = max(LOAD_CAP_MIN, math.ceil(LOAD_CAP_FRACTION * sum(ld) / len(ld)))
        # near idle, in-flight counts say little about the work left and there is little to share: costs within
        # COST_TIE are ties, which rotate like round-robin; under load the least predicted cost wins outright
        tie = COST_TIE if sum(ld) < LOW_LOAD_MEAN * len(ld) else 1e-9
        # the one rule (policies.rerank), tie order: the decoder sent a request longest ago first (then index)
        order = sorted(range(len(ld)), key=self.live.last_add.__getitem__)
        # under load only (near idle requests spread as before): the request's band prior (LiveEntry.prior)
        entry = getattr(detail, "entry", None)
        prior = entry.prior if self._band_ok and tie <= 1e-9 and entry is not None else None
        cost = (predicted if prior is None else predicted * prior).tolist()
        w = rerank(cost, ld, slack, tie, order)
        return Ranking(w, slack=slack, candidates=tuple(order), predicted_ms=predicted, detail=detail,
                       growth_ms=growth, tie=tie, prior=prior)

    # -- the live set ---------------------------------------------------------------------------------
    def on_dispatch(self, worker: int, key: Any, detail: Any = None) -> None:
        if isinstance(detail, LiveDetail):
            self.live.add(worker, key, detail.entry, detail.tokens)
        else:
            self.live.add(worker, key, None, 0)

    def on_finish(self, worker: int, key: Any) -> None:
        self.live.remove(key)

    def idle_probabilities(self) -> np.ndarray:
        """q [K, L*E], up to date (tests, inspection)."""
        return self.live.view()[0]

    def is_empty(self) -> bool:
        return self.live.is_empty()

    # -- replicas: integer vectors that sum ------------------------------------------------------------
    def export_state(self, worker: int) -> list[int]:
        return self.live.export(worker)

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        self.live.merge(worker, vector)
