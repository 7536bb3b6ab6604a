"""The decode policies behind :class:`eldr_cli.routing.router.DecodeRouter`: ELDR's locality band
(§4.3.2) and the baselines (round-robin, random, JSQ, P2C, Domain). Callers never use a policy directly:
they hold a router built by :func:`eldr_cli.routing.router.make_router`.

- :func:`locality_band` is the pure ELDR decision over (signature, centroids, loads, tau);
- every policy implements ``rank(loads, signature, domain, tokens) -> Ranking``: a value holding its first
  choice, the candidates in the tie order of :func:`rerank` (the one re-ranking rule), their predicted costs,
  the load cap (slack) it allows and what it needs back at dispatch; nothing is read back from a policy's
  attributes. Stateful policies follow each request's life through ``on_dispatch`` / ``on_finish`` and share
  their state across replicas through ``export_state`` / ``merge_state``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing.model import RoutingModel


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


def rerank(cost: Sequence[float], loads: Sequence[int], slack: int, tie: float, order: Sequence[int]) -> int:
    """The one re-ranking rule: eldr-live's choice and the replicas' reservation (its Lua script in
    :mod:`eldr_cli.proxy.replicas.reserve`, which is checked against this function) both follow it.

    Among ``order`` (candidate worker indices, in the rule's tie order), those whose load is within ``slack`` of the
    least load among them; of these, those whose ``cost`` is within ``tie`` (a fraction) of the least cost; of
    these, the fewest in flight, then the first in ``order``. ``cost`` and ``loads`` are indexed by worker. A rule
    without costs (the band, JSQ) is this one with each candidate's position in ``order`` as its cost and
    ``tie`` 0: the first in order within the slack.
    """
    least = min(loads[k] for k in order)
    within = [k for k in order if loads[k] <= least + slack]
    lo = min(cost[k] for k in within)
    lim = lo * (1 + tie) if lo >= 0 else lo * (1 - tie)  # the same float operations in Lua (IEEE doubles)
    best = -1
    for k in within:
        if cost[k] <= lim and (best < 0 or loads[k] < loads[best]):
            best = k
    return best


@dataclass(frozen=True, slots=True)
class Ranking:
    """What a policy answers for one request: its first choice and how it ranks the others.

    ``slack``: the load cap over the least loaded that the replicas' reservation may allow (None: the policy
    does not reserve; its choice stands); ``candidates``: the workers the reservation may choose among, in the
    tie order of :func:`rerank` (None: every worker, by ``predicted_ms`` within the cap, then the rest);
    ``detail``: what the policy needs back in ``on_dispatch`` (eldr-live: the request's prototype and context tokens);
    ``growth_ms`` (with ``predicted_ms``): how much each worker's predicted cost grows per request in flight
    there that the decision's loads left out, so that the reservation can redo the decision on Redis's exact
    counts (``predicted_ms + (exact - seen) * growth_ms``, ties within ``tie`` to fewer in flight); ``prior``: a
    factor per worker on both that the rule ranks by (eldr-live's band prior; None: 1), :meth:`costs`.
    """

    first: int
    slack: int | None = None
    candidates: tuple[int, ...] | None = None
    similarities: np.ndarray | None = None  # [K] cosine to each centroid (band policies)
    band: np.ndarray | None = None          # worker indices inside the locality band
    predicted_ms: np.ndarray | None = None  # [K] predicted cost per candidate (eldr-live)
    detail: Any = None
    growth_ms: np.ndarray | None = None  # [K] predicted cost's growth per request the decision did not see
    tie: float = 0.0                     # costs within this fraction of the least are ties (fewer in flight wins)
    prior: np.ndarray | None = None      # [K] factor on predicted cost and growth that the rule ranks by

    def costs(self) -> tuple[list[float], list[float]] | None:
        """(cost, growth) per worker as the rule ranks them: ``predicted_ms`` and ``growth_ms`` times ``prior``
        (None without predicted costs)."""
        if self.predicted_ms is None or self.growth_ms is None:
            return None
        if self.prior is None:
            return self.predicted_ms.tolist(), self.growth_ms.tolist()
        return (self.predicted_ms * self.prior).tolist(), (self.growth_ms * self.prior).tolist()

    def rerank(self, loads: Sequence[int], seen: Sequence[int] | None = None,
               candidates: Sequence[int] | None = None) -> int:
        """The worker :func:`rerank` picks on the in-flight counts ``loads`` (the reservation's exact counts) among
        ``candidates`` (default: :meth:`preference` of the first choice on ``seen``), each predicted cost corrected
        by its growth per request that ``seen`` (the decision's loads; default ``loads``) left out; without
        costs, by position in the order. What the reservation's Lua script computes in Redis."""
        seen = loads if seen is None else seen
        order = list(self.preference(self.first, seen) if candidates is None else candidates)
        cg = self.costs()
        if cg is None:
            cost = [0.0] * len(loads)
            for j, k in enumerate(order):
                cost[k] = float(j)
            return rerank(cost, loads, self.slack or 0, 0.0, order)
        c, g = cg
        adj = [c[k] + (loads[k] - seen[k]) * g[k] for k in range(len(loads))]
        return rerank(adj, loads, self.slack or 0, self.tie, order)

    def preference(self, worker: int, loads: Sequence[int]) -> list[int]:
        """The reservation's candidates in order of preference when the decision is ``worker`` (the first
        choice, or the healthy stand-in for it): ``candidates`` as given; without them, ``worker``, then the
        others within ``slack`` of the least loaded, then the rest, each by predicted cost (index without one)."""
        if self.candidates is not None:
            return list(self.candidates)
        n = len(loads)
        p = self.predicted_ms
        cost = list(range(n)) if p is None else (p if self.prior is None else p * self.prior).tolist()
        cap = min(loads) + (self.slack or 0)
        return [worker, *sorted((k for k in range(n) if k != worker), key=lambda k: (loads[k] > cap, cost[k]))]


def jsq(loads) -> int:
    """Join-shortest-queue: the least-loaded worker, ties to the lowest index."""
    return int(np.argmin(np.asarray(loads)))


# -- policies: one interface for the proxy, the simulator and replay ---------------------------

class Policy:
    """A decode routing policy: :meth:`rank` ranks all workers (a :class:`Ranking`); stateful policies also follow
    each request's life through :meth:`on_dispatch` and :meth:`on_finish` (the router calls them)."""

    name = "policy"
    needs_signature = False
    needs_counts = True     # with needs_signature: the signature is computed from the request's prefill counts
    unit_signature = True  # False: the policy only ranks dot products with the signature (scale-free)

    def __init__(self, n_workers: int, **_: Any) -> None:
        """Every policy is built from the worker count and the factory's keywords (each takes what it needs)."""

    def rank(self, loads, signature: np.ndarray | None = None, domain: str | None = None,
             tokens: int | None = None) -> Ranking:
        """``tokens``: the context tokens the request will hold on its decoder (cost-aware policies)."""
        raise NotImplementedError

    def on_dispatch(self, worker: int, key: Any, detail: Any = None) -> None:
        """A request (``key``) was sent to ``worker`` (again: moved there); ``detail`` is its ranking's."""

    def on_finish(self, worker: int, key: Any) -> None:
        """The request ``key`` left ``worker`` (finished, failed or cancelled)."""

    # -- what a stateful policy shares across replicas (integer vectors that sum) ----------------------
    def export_state(self, worker: int) -> list[int] | None:
        """This replica's share of the policy's state on ``worker``; None: the policy shares nothing."""
        return None

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        """The other replicas' summed :meth:`export_state` of ``worker`` (None or [] when there are none)."""


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, n_workers: int, **_):
        self.n = n_workers
        self._next = 0

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        w = self._next % len(loads)
        self._next = w + 1
        return Ranking(w)


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        return Ranking(int(self.rng.integers(len(loads))))


class JSQ(Policy):
    name = "jsq"

    def __init__(self, n_workers: int, **_):
        pass

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        return Ranking(jsq(loads), slack=0, candidates=tuple(range(len(loads))))  # reserved: the least of all


class P2C(Policy):
    """Power of two choices: sample two distinct workers, take the less loaded."""

    name = "p2c"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        n = len(loads)
        if n == 1:
            return Ranking(0)
        a, b = self.rng.choice(n, size=2, replace=False)
        return Ranking(int(a if loads[a] <= loads[b] else b))


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

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        group = self.groups.get(domain) if domain is not None else None
        if group is None:
            self.unlabelled += 1
            return Ranking(jsq(loads))
        ld = np.asarray(loads)[group]
        return Ranking(int(group[int(np.argmin(ld))]))


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

    def rank(self, loads, signature=None, domain=None, tokens=None) -> Ranking:
        return band_ranking(signature, self.model.centroids, loads, self.tau)


def band_ranking(signature: np.ndarray | None, centroids: np.ndarray, loads, tau: float) -> Ranking:
    """The band rule as a ranking: reserved as the least reserved in the band (JSQ over all without a signature)."""
    if signature is None:
        return Ranking(jsq(loads), slack=0, candidates=tuple(range(len(loads))))
    b = locality_band(signature, centroids, loads, tau)
    return Ranking(b.worker, slack=0, candidates=tuple(int(k) for k in b.band), similarities=b.similarities,
                   band=b.band)
