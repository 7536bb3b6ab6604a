"""Cross-artifact checks, in one place: the stages that combine artifacts (fit, place, evaluate,
simulate, the proxy) ask here whether they fit together, and all say it the same way.

- same trace: an artifact fitted on a trace records that trace's content hash;
- K: the routing artifact's number of centroids against decoders/placements/worker pools;
- tau: the locality band width, one range everywhere (:data:`TAU_RANGE`);
- batch size: decode concurrency per decoder, a positive integer.

These raise :class:`~eldr_cli.errors.EldrError` (they compare user-supplied artifacts and flags);
parameter checks of the estimators themselves live in ``eldr_cli.stages.validation``.
"""

from __future__ import annotations

import numbers

from eldr_cli.errors import EldrError

# Cosine similarities lie in [-1, 1], so a band wider than 2 changes nothing; with non-negative
# (count) signatures any tau >= 1 already admits every worker (pure least-loaded).
TAU_RANGE = (0.0, 2.0)


def check_tau(tau, *, flag: str = "--tau") -> float | None:
    """None (use the routing artifact's) or a number in TAU_RANGE."""
    if tau is None:
        return None
    lo, hi = TAU_RANGE
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not lo <= float(tau) <= hi:
        raise EldrError(f"{flag} must be a number in [{lo:g}, {hi:g}], got {tau!r}")
    return float(tau)


def check_batch_size(batch_size, *, flag: str = "--batch-size") -> int | None:
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or int(batch_size) < 1:
        raise EldrError(f"{flag} must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def check_k_range(decoders, n: int, *, flag: str = "--decoders") -> int:
    """K between 1 and the number of calibration signatures N."""
    if isinstance(decoders, bool) or not isinstance(decoders, numbers.Integral) or not 1 <= int(decoders) <= n:
        raise EldrError(f"the number of decoders K must be between 1 and the number of calibration "
                        f"signatures N={n}, got {decoders}", hint=f"pass {flag} K with 1 <= K <= {n}")
    return int(decoders)


def check_k_matches(routing, decoders, *, what: str = "--decoders") -> int:
    """The routing artifact's K; EldrError if ``decoders`` (a flag, a placement, a pool size) differs."""
    K = int(routing.params["n_clusters"])
    if decoders is not None and int(decoders) != K:
        raise EldrError(f"K mismatch: {what} is {decoders} but routing artifact {routing.path} has K={K} "
                        "decoders (centroids)", hint=f"use K={K} or refit with `eldr fit --decoders {decoders}`")
    return K


def check_same_trace(art, trace, what: str) -> None:
    """``art`` (an Artifact) was fitted on ``trace`` (a Trace): same content hash."""
    got = art.manifest.get("inputs", {}).get("trace", {}).get("content_hash")
    if got != trace.content_hash:
        raise EldrError(f"{what} {art.path} was fitted on another trace than {trace.path} "
                        f"(trace content hash {str(got)[:12]} in its manifest, {str(trace.content_hash)[:12]} here)",
                        hint=f"pass the trace it was fitted on, or rerun the earlier stages on {trace.path} "
                             "(`eldr fit`)")


def check_same_model_shape(art, trace, what: str) -> None:
    shape = (art.params.get("num_layers"), art.params.get("num_experts"))
    if shape != (trace.num_layers, trace.num_experts):
        raise EldrError(f"{what} is for L={shape[0]}, E={shape[1]}; the trace has "
                        f"L={trace.num_layers}, E={trace.num_experts}")
