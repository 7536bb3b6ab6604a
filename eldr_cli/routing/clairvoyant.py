"""``clairvoyant``: eldr-live's rule fed each request's *true* future decode activations (replay and simulation only).

eldr-live predicts a request's per-step expert activation probabilities by its nearest prototype's mean
(``routing.live``); this policy is the same rule, the same step formula (``costmodel.step_ms_from_terms``),
the same load cap and ties, with every in-flight request's own activations taken from the trace being
replayed::

    a_r(l, e) = decode_counts_r(l, e) / decode_steps_r

It is the best any predictor of eldr-live's rule could do: the distance from eldr-live to it is what a better
predictor could still buy. It needs the future, so the proxy cannot serve it (``registry``: servable=False);
the simulator, ``eldr report`` and replay build it through ``make_router`` with the served rows' activations
(:func:`future_activations`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing.live import EldrLivePolicy
from eldr_cli.routing.policies import Ranking

A_MAX = 1.0 - 1e-6  # an expert active in every step: log(1 - a) stays finite (the live set subtracts it again)


def future_activations(decode_counts: np.ndarray, decode_steps: np.ndarray, rows: np.ndarray) -> dict[int, np.ndarray]:
    """{row: its true per-step activation probabilities [L*E] (float32)} for the served ``rows`` with a decode step."""
    out: dict[int, np.ndarray] = {}
    for r in np.unique(np.asarray(rows, dtype=np.int64)).tolist():
        steps = float(decode_steps[r])
        if steps > 0:
            a = np.asarray(decode_counts[r], dtype=np.float64).reshape(-1) / steps
            out[int(r)] = np.clip(a, 0.0, A_MAX).astype(np.float32)
    return out


class FutureDetail(NamedTuple):
    """What the clairvoyant policy needs back at dispatch: the request's true log(1 - a) and context tokens."""

    log_idle: np.ndarray
    tokens: int


class ClairvoyantPolicy(EldrLivePolicy):
    """eldr-live's rule on each request's true future activations (its ``signature`` is that vector)."""

    name = "clairvoyant"
    needs_counts = False  # the signature is the request's own future, looked up by the request's key

    def __init__(self, n_workers: int, model=None, cost=None, future: dict[int, np.ndarray] | None = None,
                 **kw: Any):
        if future is None:
            raise EldrError("the clairvoyant router needs the served rows' decode activations "
                            "(routing.clairvoyant.future_activations builds them)")
        super().__init__(n_workers, model=model, cost=cost, **kw)
        self.future = future
        self._live_logs: dict[Any, np.ndarray] = {}

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        if self._dirty:
            self._refresh()
        c_new = int(tokens or 0)
        if signature is None:  # a row the trace has no decode for: the mean request, as eldr-live would
            a = self.act[-1]
            log_idle = self.log_idle[-1]
        else:
            a = np.clip(np.asarray(signature, dtype=np.float32), 0.0, A_MAX)
            log_idle = np.log1p(-a.astype(np.float64)).astype(np.float32)
        return self._choose(loads, a, c_new, FutureDetail(log_idle, c_new))

    def on_dispatch(self, worker: int, key: Any, detail: Any = None) -> None:
        if not isinstance(detail, FutureDetail):
            detail = FutureDetail(self.log_idle[-1], 0)
        old = self.where.pop(key, None)
        if old is not None:  # dispatched again (a retry elsewhere) without a finish: move it
            self._remove(*old, key=key)
        self.where[key] = (worker, -1, detail.tokens)
        self._live_logs[key] = detail.log_idle
        self._seq += 1
        self.last_dispatch[worker] = self._seq
        self._n_live[worker] += 1
        self.tokens[worker] += detail.tokens
        self._changed(worker, detail.log_idle, 1)

    def on_finish(self, worker: int, key: Any) -> None:
        rec = self.where.pop(key, None)
        if rec is not None:
            self._remove(*rec, key=key)

    def _remove(self, worker: int, m: int, tok: int, key: Any = None) -> None:
        log_idle = self._live_logs.pop(key, self.log_idle[-1])
        self._n_live[worker] -= 1
        self.tokens[worker] -= tok
        self._changed(worker, log_idle, -1)

    def _exact_log_q(self, d: int) -> np.ndarray:
        self._recount[:] = 0.0
        for key, (w, _, _) in self.where.items():
            if w == d:
                self._recount += self._live_logs[key]
        return self._recount

    def export_state(self, worker: int) -> list[int]:
        raise EldrError("the clairvoyant router needs the future and cannot be served by replicas")

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        raise EldrError("the clairvoyant router needs the future and cannot be served by replicas")
