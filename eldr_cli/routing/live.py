"""``eldr-live``: the cost-aware decode policy (issue 21; beyond the paper's locality band).

Per decoder it keeps the live set of its in-flight requests, each as the decode-activation prototype its
prefill signature predicts (:class:`eldr_cli.method.live.DecodeActivation`, fitted into the routing
artifact), and their context tokens. For each candidate decoder d it predicts the next decode step with
and without the new request through the cost model's step form (``CostModel.step_terms``)::

    q_d(l, e)  = prod over d's requests of (1 - a_m(l, e))        P(expert e of layer l idle in a step)
    A_d        = sum_{l,e} (1 - q_d(l, e))                        expected distinct active experts
    dA_d       = sum_{l,e} q_d(l, e) * a_new(l, e)                experts the new request adds
    T_d        = step(A_d, B_d, C_d)                              (0 for an idle decoder)
    T'_d       = step(A_d + dA_d, B_d + 1, C_d + c_new)
    cost_d     = T'_d + B_d * (T'_d - T_d)                        new request's TPOT + slowdown of the others

and picks the decoder with the least cost among those within a load cap of the least loaded. Ties go to
fewer in flight, then to the decoder sent a request longest ago (as round-robin would); while decoders run
fewer than ``LOW_LOAD_MEAN`` requests on average, costs within ``COST_TIE`` count as ties, because in-flight
counts then say little about the work left and there is little to share (measured: without it eldr-live
matched JSQ at 20% load, 2% above round-robin). An idle decoder costs one lone step, so at low load
requests spread; under load a decoder whose batch already runs the request's experts adds the least, as
in ELDR; the cap bounds how uneven batches may get (the tail). B_d are the loads the caller passes (local
+ remote in the proxy).

Replicas share the live set as integer counts per (decoder, prototype) plus context tokens
(:meth:`EldrLivePolicy.export_state` / :meth:`EldrLivePolicy.merge_state`), which sum across replicas.

The ranking it returns holds the predicted costs, their growth per request in flight that the loads left out
(``d cost / d B = T1 - T + kt``) and the load cap (slack): the replicas' reservation redoes this rule on Redis's
exact counts (the least ``cost + (exact - seen) * growth`` among the decoders within the cap of the least
reserved, ties within ``COST_TIE`` to fewer in flight), so that neither the cap nor the ranking rests on this
replica's stale view of the others' requests.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from eldr_cli.costmodel import step_ms_from_terms
from eldr_cli.errors import EldrError
from eldr_cli.routing.model import RoutingModel
from eldr_cli.routing.policies import Policy, Ranking, rerank

# Without a cost model: the shape of the paper's Fig. 2 (MI300X, Qwen3-30B-A3B, batch 64: 16 -> 128
# active experts raise a layer's latency 4.7x; batch barely moves it), in units of one expert's read.
# (a + 128 b) / (a + 16 b) = 4.7  ->  a = 14.27 b. A relative shape, not a time: decisions only compare.
DEFAULT_STEP_TERMS_PER_LAYER = (14.27, 1.0, 0.01)  # (per layer, per active expert, per request per layer)
LOG_Q_FLOOR = -60.0
RECOUNT_EVERY = 4096  # changes of a decoder's live set between exact recounts of its log q
COST_TIE = 0.03          # costs within 3% are ties ...
LOW_LOAD_MEAN = 4.0      # ... while decoders run fewer than this many requests on average
LOAD_CAP_MIN = 2          # a decoder may run this many more requests than the least loaded ...
LOAD_CAP_FRACTION = 0.25  # ... or this share of the mean load, whichever is larger


class LiveDetail(NamedTuple):
    """What eldr-live needs back at dispatch (``Ranking.detail``): the request's prototype and context tokens."""

    prototype: int
    tokens: int


def step_form(cost, n_layers: int) -> tuple[float, ...]:
    """(const, kb, kt, m0, kv, kc, ka, roof) of a decode step (see ``CostModel.step_terms``)."""
    if cost is None:
        a, b, c = DEFAULT_STEP_TERMS_PER_LAYER
        return (n_layers * a, b, n_layers * c, 0.0, 0.0, 0.0, 0.0, 0.0)
    terms = [float(x) for x in cost.step_terms(n_layers, 1.0)]
    # A_d is an expected union; with expert parallelism a step pays for the busiest rank's experts, taken
    # here as the union spread evenly over the ranks (CostModel.spread_active; x 1 without EP)
    terms[1] *= cost.spread_active(1.0)
    return tuple(terms)


class EldrLivePolicy(Policy):
    name = "eldr-live"
    needs_signature = True
    unit_signature = False  # only the nearest prototype (argmax of dot products) is needed

    def __init__(self, n_workers: int, model: RoutingModel | None = None, cost=None, **_: Any):
        if model is None:
            raise EldrError("the eldr-live policy needs a routing artifact (--routing DIR)")
        if model.live is None:
            raise EldrError("the routing artifact has no decode-activation model, which the eldr-live policy "
                            "needs (it was fitted before eldr-live existed)",
                            hint="refit it with `eldr fit` (or `eldr cluster`); the other policies still serve")
        protos, act = model.live
        L, E = model.shape
        if act.shape[1:] != (L, E):
            raise EldrError(f"the routing artifact's decode-activation model is {act.shape[1]}x{act.shape[2]}, "
                            f"its signatures {L}x{E}", hint="refit it with `eldr fit`")
        self.n = n_workers
        self.protos = np.ascontiguousarray(protos, dtype=np.float32)      # float32: half the matvec
        self.act = np.ascontiguousarray(act.reshape(act.shape[0], -1), dtype=np.float32)  # [M + 1, L*E]
        # log(1 - a), float32 like q: half the memory traffic per dispatch; the rounding a sum of float32
        # updates accumulates is wiped by an exact recount every RECOUNT_EVERY changes of a decoder
        self.log_idle = np.log1p(-self.act.astype(np.float64)).astype(np.float32)
        self.terms = step_form(cost, L)
        M1 = self.act.shape[0]
        self.counts = np.zeros((n_workers, M1), dtype=np.int64)           # local live set
        self.remote = np.zeros((n_workers, M1), dtype=np.int64)           # other replicas' (summed)
        self.tokens = np.zeros(n_workers, dtype=np.int64)
        self.remote_tokens = np.zeros(n_workers, dtype=np.int64)
        self.log_q = np.zeros((n_workers, self.act.shape[1]), dtype=np.float32)
        self._changes = [0] * n_workers
        self.q = np.ones((n_workers, self.act.shape[1]), dtype=np.float32)
        self._scratch = np.zeros(self.act.shape[1], dtype=np.float32)
        self._recount = np.zeros(self.act.shape[1])
        self.active = np.zeros(n_workers)                                   # A_d
        self.ctx = np.zeros(n_workers)                                      # C_d (all replicas)
        self._n_live = [0] * n_workers                                      # requests, all replicas
        self._dirty: set[int] = set()  # decoders whose q is stale: refreshed once, at the next pick
        self.where: dict[Any, tuple[int, int, int]] = {}
        self.last_dispatch = [0] * n_workers  # ties go to the decoder that was sent a request longest ago
        self._seq = 0

    # -- the decision ---------------------------------------------------------------------------------
    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        if self._dirty:
            self._refresh()
        m = self.act.shape[0] - 1 if signature is None else \
            int((self.protos @ signature.astype(np.float32, copy=False)).argmax())
        c_new = int(tokens or 0)
        return self._choose(loads, self.act[m], c_new, LiveDetail(m, c_new))

    def _choose(self, loads, a_new: np.ndarray, c_new: int, detail: Any) -> Ranking:
        """The rule on the new request's per-step activation probabilities ``a_new`` [L*E] (its prototype's
        here; its true future ones in :class:`eldr_cli.routing.clairvoyant.ClairvoyantPolicy`)."""
        ld = loads.tolist() if isinstance(loads, np.ndarray) else list(loads)
        B = np.array(ld, dtype=np.float64)
        C = self.ctx
        # each decoder's next step without and with the request (its expected new experts and its context),
        # by the one step formula the simulator and the replay use
        Tb = step_ms_from_terms(self.terms, self.active, B, C)
        T = Tb * (B > 0)  # an idle decoder runs no step
        T1 = step_ms_from_terms(self.terms, self.active + self.q @ a_new, B + 1, C + c_new)
        cost = T1 + B * (T1 - T)
        slack = max(LOAD_CAP_MIN, math.ceil(LOAD_CAP_FRACTION * sum(ld) / len(ld)))
        # near idle, in-flight counts say little about the work left and there is little to share: costs within
        # COST_TIE are ties, which rotate like round-robin; under load the least predicted cost wins outright
        tie = COST_TIE if sum(ld) < LOW_LOAD_MEAN * len(ld) else 1e-9
        # the one rule (policies.rerank), tie order: the decoder sent a request longest ago first (then index)
        order = sorted(range(len(ld)), key=self.last_dispatch.__getitem__)
        w = rerank(cost.tolist(), ld, slack, tie, order)
        # d cost / d B: one more request there that these loads left out makes the new one's step kt longer
        # and adds one more request it slows down by (T1 - T) (the replicas' reservation redoes this rule on
        # Redis's exact counts)
        growth = T1 - Tb + self.terms[2]
        return Ranking(w, slack=slack, candidates=tuple(order), predicted_ms=cost, detail=detail, growth_ms=growth,
                       tie=tie)

    # -- the live set ---------------------------------------------------------------------------------
    def on_dispatch(self, worker: int, key: Any, detail: Any = None) -> None:
        m, tok = (detail.prototype, detail.tokens) if isinstance(detail, LiveDetail) else (self.act.shape[0] - 1, 0)
        old = self.where.pop(key, None)
        if old is not None:  # dispatched again (a retry elsewhere) without a finish: move it
            self._remove(*old)
        self.where[key] = (worker, m, tok)
        self._seq += 1
        self.last_dispatch[worker] = self._seq
        self.counts[worker, m] += 1
        self._n_live[worker] += 1
        self.tokens[worker] += tok
        self._changed(worker, self.log_idle[m], 1)

    def on_finish(self, worker: int, key: Any) -> None:
        rec = self.where.pop(key, None)
        if rec is not None:
            self._remove(*rec)

    def _remove(self, worker: int, m: int, tok: int) -> None:
        self.counts[worker, m] -= 1
        self._n_live[worker] -= 1
        self.tokens[worker] -= tok
        self._changed(worker, self.log_idle[m], -1)

    def _changed(self, d: int, log_delta: np.ndarray, sign: int) -> None:
        """Decoder d's log q changed by ``sign * log_delta`` (in place); q and A follow at the next pick."""
        if self._n_live[d]:
            row = self.log_q[d]
            (np.add if sign > 0 else np.subtract)(row, log_delta, out=row)
        else:
            self.log_q[d] = 0.0  # exactly empty again, whatever rounding accumulated
        self._changes[d] += 1
        self._dirty.add(d)

    def _refresh(self) -> None:
        """q_d and A_d of the decoders whose live set changed since the last pick (lazily: a dispatch and a
        finish on one decoder between two decisions cost one refresh)."""
        for d in self._dirty:
            self.ctx[d] = float(self.tokens[d] + self.remote_tokens[d])
            if not self._n_live[d]:
                self.q[d] = 1.0
                self.active[d] = 0.0
            else:
                if self._changes[d] >= RECOUNT_EVERY:  # exact again, from the integer counts
                    self._changes[d] = 0
                    self.log_q[d] = self._exact_log_q(d)
                # floored at e^-60 (~1e-26, a normal float32): no denormals in the products, nothing lost
                np.maximum(self.log_q[d], LOG_Q_FLOOR, out=self._scratch)
                np.exp(self._scratch, out=self.q[d])
                self.active[d] = self.q.shape[1] - float(self.q[d].sum())
        self._dirty.clear()

    def idle_probabilities(self) -> np.ndarray:
        """q [K, L*E], up to date (tests, inspection)."""
        if self._dirty:
            self._refresh()
        return self.q

    def is_empty(self) -> bool:
        """No request anywhere in the live set (reads only: safe to call from another thread)."""
        return not (self.where or self.counts.any() or self.remote.any() or self.tokens.any()
                    or self.remote_tokens.any() or self.log_q.any())

    # -- replicas: integer vectors that sum ------------------------------------------------------------
    def export_state(self, worker: int) -> list[int]:
        """This replica's live set on ``worker``: requests per prototype, then context tokens."""
        return [*self.counts[worker].tolist(), int(self.tokens[worker])]

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        """The other replicas' summed :meth:`export_state` of ``worker`` (None or [] when there are none)."""
        M1 = self.counts.shape[1]
        new = np.zeros(M1, dtype=np.int64) if not vector or len(vector) != M1 + 1 else np.asarray(vector[:M1])
        delta = new - self.remote[worker]
        nz = np.flatnonzero(delta)
        if nz.size:
            self.remote[worker] = new
            self._n_live[worker] += int(delta[nz].sum())
            self._changed(worker, (delta[nz] @ self.log_idle[nz]).astype(np.float32), 1)
        tok = int(vector[M1]) if vector and len(vector) == M1 + 1 else 0
        if tok != self.remote_tokens[worker]:
            self.remote_tokens[worker] = tok
            self._dirty.add(worker)

    def _exact_log_q(self, d: int) -> np.ndarray:
        """Decoder d's log q recounted from the integer counts of its live set (all replicas)."""
        n = (self.counts[d] + self.remote[d]).astype(np.float64)
        np.dot(n, self.log_idle, out=self._recount)
        return self._recount
