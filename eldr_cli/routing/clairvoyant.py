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

from typing import Any

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing.live import EldrLivePolicy
from eldr_cli.routing.live_set import A_MAX, FutureSource, PrefillPredictor


def future_activations(decode_counts: np.ndarray, decode_steps: np.ndarray, rows: np.ndarray) -> dict[int, np.ndarray]:
    """{row: its true per-step activation probabilities [L*E] (float32)} for the served ``rows`` with a decode step."""
    out: dict[int, np.ndarray] = {}
    for r in np.unique(np.asarray(rows, dtype=np.int64)).tolist():
        steps = float(decode_steps[r])
        if steps > 0:
            a = np.asarray(decode_counts[r], dtype=np.float64).reshape(-1) / steps
            out[int(r)] = np.clip(a, 0.0, A_MAX).astype(np.float32)
    return out


class ClairvoyantPolicy(EldrLivePolicy):
    """eldr-live's rule on each request's true future activations: the same policy with a :class:`FutureSource`."""

    name = "clairvoyant"
    needs_counts = False  # the request's entry is its own future, looked up by the request's key

    def __init__(self, n_workers: int, model=None, cost=None, future: dict[int, np.ndarray] | None = None,
                 **kw: Any):
        if future is None:
            raise EldrError("the clairvoyant router needs the served rows' decode activations "
                            "(routing.clairvoyant.future_activations builds them)")
        if model is None:
            raise EldrError("the clairvoyant router needs a routing artifact (--routing DIR)")
        pred = PrefillPredictor(model)  # a row the trace has no decode for: the mean request, as eldr-live
        super().__init__(n_workers, model=model, cost=cost, source=FutureSource(future, pred.mean(), pred.table), **kw)
        # its entries (the truth) carry no band prior: eldr-live's prior hedges its prediction with the band, and
        # given the truth there is nothing to hedge (with it the twin carried +22.6%, not +28.9%, on the demo's trace)

    def export_state(self, worker: int) -> list[int]:
        raise EldrError("the clairvoyant router needs the future and cannot be served by replicas")

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        raise EldrError("the clairvoyant router needs the future and cannot be served by replicas")
