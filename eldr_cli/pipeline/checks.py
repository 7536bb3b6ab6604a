"""Cross-artifact checks, in one place: the stages that combine artifacts (fit, place, evaluate,
simulate, the proxy) ask here whether they fit together, and all say it the same way.

- same trace: an artifact fitted on a trace records that trace's content hash;
- K: the routing artifact's number of centroids against decoders/placements/worker pools;
- tau, batch size: checked against their one declaration in :mod:`eldr_cli.constraints`, worded
  with the flag that set them.

These raise the :mod:`eldr_cli.errors` family (they compare user-supplied artifacts and flags).
"""

from __future__ import annotations

from typing import Any

from eldr_cli.constraints import validate_n_clusters, validate_parameter
from eldr_cli.errors import EldrError


def check_tau(tau: Any, *, flag: str = "--tau") -> float | None:
    """None (use the routing artifact's) or a number in the declared range."""
    return None if tau is None else validate_parameter("tau", tau, what=flag)


def check_batch_size(batch_size: Any, *, flag: str = "--batch-size") -> int | None:
    return None if batch_size is None else validate_parameter("batch_size", batch_size, what=flag)


def check_k_range(decoders: Any, n: int, *, flag: str = "--decoders") -> int:
    """K between 1 and the number of calibration signatures N."""
    return validate_n_clusters(decoders, n, hint=f"pass {flag} K with 1 <= K <= {n}")


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
