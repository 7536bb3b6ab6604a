"""The decode policies behind :class:`eldr_cli.routing.router.DecodeRouter`: ELDR's locality band
(§4.3.2) and the baselines (round-robin, random, JSQ, P2C, Domain). Callers never use a policy directly:
they hold a router built by :func:`eldr_cli.routing.router.make_router`.

- :func:`locality_band` is the pure ELDR decision over (signature, centroids, loads, tau);
- every policy implements ``pick(loads, signature, domain) -> worker index`` and may keep per-request state
  through ``on_dispatch`` / ``on_finish``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing.model import RoutingModel

POLICIES = ("eldr", "eldr-live", "round-robin", "random", "jsq", "p2c", "domain")


class BandDecision(NamedTuple):
    worker: int
    similarities: np.ndarray  # [K] cosine to each centroid
    band: np.ndarray          # worker indices with s_k >= s* - tau


def locality_band(signature: np.ndarray, centroids: np.ndarray, loads: Sequence[int] | np.ndarray,
                  tau: float) -> BandDecision:
    """§4.3.2: s_k = cos(signature, centroid_k); band = {k: s_k >= max s - tau}; least-loaded in band.

    ``signature`` [d] and ``centroids`` [K, d] are unit norm, so cosine is a dot product.
    Ties on load go to the higher similarity, then the lower index. tau=0 is top-1, tau>=1 is JSQ
    (cosines of non-negative vectors lie in [0, 1]).
    """
    sims = centroids @ signature
    band = np.flatnonzero(sims >= sims.max() - tau)
    if band.size == 1:
        return BandDecision(int(band[0]), sims, band)
    # K is small: plain Python over the band beats several tiny numpy calls
    sl = sims.tolist()
    ld = loads.tolist() if isinstance(loads, np.ndarray) else loads
    worker = min(band.tolist(), key=lambda k: (ld[k], -sl[k], k))
    return BandDecision(int(worker), sims, band)


def jsq(loads) -> int:
    """Join-shortest-queue: the least-loaded worker, ties to the lowest index."""
    return int(np.argmin(np.asarray(loads)))


# -- policies: one interface for the proxy, the simulator and replay ---------------------------

class Policy:
    """A decode routing policy: :meth:`pick` chooses among all workers; stateful policies also follow
    each request's life through :meth:`on_dispatch` and :meth:`on_finish` (the router calls them)."""

    name = "policy"
    needs_signature = False
    unit_signature = True  # False: the policy only ranks dot products with the signature (scale-free)

    def __init__(self, n_workers: int, **_: Any) -> None:
        """Every policy is built from the worker count and the factory's keywords (each takes what it needs)."""

    def pick(self, loads, signature: np.ndarray | None = None, domain: str | None = None,
             tokens: int | None = None) -> int:
        """``tokens``: the context tokens the request will hold on its decoder (cost-aware policies)."""
        raise NotImplementedError

    def on_dispatch(self, worker: int, key: Any, detail: Any = None) -> None:
        """A request (``key``) was sent to ``worker``; ``detail`` is what this policy's pick left in
        ``last`` for it."""

    def on_finish(self, worker: int, key: Any) -> None:
        """The request ``key`` left ``worker`` (finished, failed or cancelled)."""

    def reservation(self, worker: int, detail: Any, loads) -> tuple[list[int], int] | None:
        """For the replicas' atomic reservation (``eldr_cli.proxy.replicas.reserve``): the candidate decoders in order
        of preference and the slack over the least reserved that Redis may allow, for the decision ``worker``
        with ``detail`` (what pick left in ``last``); None: this policy does not reserve (its choice stands)."""
        return None


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, n_workers: int, **_):
        self.n = n_workers
        self._next = 0

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        w = self._next % len(loads)
        self._next = w + 1
        return w


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        return int(self.rng.integers(len(loads)))


class JSQ(Policy):
    name = "jsq"

    def __init__(self, n_workers: int, **_):
        pass

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        return jsq(loads)

    def reservation(self, worker, detail, loads) -> tuple[list[int], int]:
        return list(range(len(loads))), 0  # the least reserved of all


class P2C(Policy):
    """Power of two choices: sample two distinct workers, take the less loaded."""

    name = "p2c"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        n = len(loads)
        if n == 1:
            return 0
        a, b = self.rng.choice(n, size=2, replace=False)
        return int(a if loads[a] <= loads[b] else b)


def split_workers_by_share(shares: dict[str, float], n_workers: int) -> dict[str, list[int]]:
    """Give each domain a contiguous block of workers in proportion to its calibration share
    (largest remainder; every domain gets at least one worker while workers last)."""
    names = sorted(shares)
    if not names:
        return {}
    total = sum(shares.values())
    quota = {d: shares[d] / total * n_workers for d in names}
    alloc = {d: max(1, int(math.floor(quota[d]))) for d in names}
    while sum(alloc.values()) > n_workers:
        d = max((x for x in names if alloc[x] > 1), key=lambda x: alloc[x] - quota[x], default=None)
        if d is None:
            break
        alloc[d] -= 1
    while sum(alloc.values()) < n_workers:
        d = max(names, key=lambda x: quota[x] - alloc[x])
        alloc[d] += 1
    out, start = {}, 0
    for d in names:
        out[d] = [w % n_workers for w in range(start, start + alloc[d])]
        start += alloc[d]
    return out


class DomainPolicy(Policy):
    """Oracle domain label -> that domain's workers (split by calibration share), JSQ within."""

    name = "domain"

    def __init__(self, n_workers: int, domain_share: dict[str, float] | None = None, **_):
        if not domain_share:
            raise EldrError("the domain policy needs the calibration domain mix (a routing artifact fitted "
                            "on a trace with domain labels)")
        self.groups = split_workers_by_share(domain_share, n_workers)
        self.unlabelled = 0

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        group = self.groups.get(domain) if domain is not None else None
        if group is None:
            self.unlabelled += 1
            return jsq(loads)
        ld = np.asarray(loads)[group]
        return int(group[int(np.argmin(ld))])


class EldrPolicy(Policy):
    """Locality-band routing on the signature; JSQ when a request has no signature."""

    name = "eldr"
    needs_signature = True

    def __init__(self, n_workers: int, model: RoutingModel | None = None, tau: float | None = None, **_):
        if model is None:
            raise EldrError("the eldr policy needs a routing artifact (--routing DIR)")
        if model.n_clusters != n_workers:
            raise EldrError(f"routing artifact has K={model.n_clusters} centroids but there are {n_workers} "
                            "decode workers", hint=f"refit with `eldr fit --decoders {n_workers}`")
        self.model = model
        self.tau = model.tau if tau is None else float(tau)
        self.last: BandDecision | None = None

    def pick(self, loads, signature=None, domain=None, tokens=None) -> int:
        if signature is None:
            self.last = None
            return jsq(loads)
        self.last = locality_band(signature, self.model.centroids, loads, self.tau)
        return self.last.worker

    def reservation(self, worker, detail, loads) -> tuple[list[int], int]:
        band = getattr(detail, "band", None)  # no signature: JSQ over all
        return ([int(k) for k in band] if band is not None else list(range(len(loads)))), 0


def _live_policy(n_workers: int, **kw: Any) -> Policy:
    from eldr_cli.routing.live import EldrLivePolicy

    return EldrLivePolicy(n_workers, **kw)


POLICY_CLASSES: dict[str, Any] = {"eldr": EldrPolicy, "eldr-live": _live_policy, "round-robin": RoundRobin,
                                  "random": RandomPolicy, "jsq": JSQ, "p2c": P2C, "domain": DomainPolicy}
