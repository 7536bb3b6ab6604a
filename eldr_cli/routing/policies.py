"""The decode routing decision (ELDR §4.3.2) and the baselines, shared by the proxy, the
simulator, the emulator and offline replay. This module is *the* place a decode worker is chosen.

- :func:`locality_band` is the pure ELDR decision over (signature, centroids, loads, tau);
- :class:`RoutingModel` turns handed-off counts [L, E] into a signature (transform, IDF, layer
  mask, L2 norm) using a routing artifact;
- :func:`make_policy` builds any policy (eldr, round-robin, random, jsq, p2c, domain) behind one
  ``choose(loads, signature=None, domain=None) -> worker index`` interface.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from eldr_cli.errors import EldrError

POLICIES = ("eldr", "round-robin", "random", "jsq", "p2c", "domain")


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


def jsq(loads, rng=None) -> int:
    """Join-shortest-queue: the least-loaded worker, ties to the lowest index."""
    return int(np.argmin(np.asarray(loads)))


class RoutingModel:
    """The routing artifact in memory: transform, per-cell weights [L, E], layer mask, centroids."""

    def __init__(self, transform: str, weights: np.ndarray, mask: np.ndarray, centroids: np.ndarray,
                 tau: float = 0.1, domain_share: dict[str, float] | None = None):
        from eldr_cli.stages.signature import SERVABLE_TRANSFORMS

        if transform not in SERVABLE_TRANSFORMS:
            raise EldrError(f"routing artifact uses transform {transform!r}, which cannot be computed from "
                            f"handed-off counts; refit with one of {', '.join(SERVABLE_TRANSFORMS)}")
        self.transform = transform
        self.weights = np.asarray(weights, dtype=np.float64)
        self.mask = np.asarray(mask, dtype=np.int64)
        self.centroids = np.ascontiguousarray(centroids, dtype=np.float64)
        self.tau = float(tau)
        self.domain_share = dict(domain_share or {})
        self._w = self.weights[self.mask]  # [N*, E]

    @property
    def n_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weights.shape)

    @classmethod
    def load(cls, path) -> "RoutingModel":
        from eldr_cli.artifacts.store import Artifact

        art = Artifact(path, kind=("routing", "fit"))
        if art.kind == "fit":
            from pathlib import Path

            art = Artifact(Path(path) / "routing", kind="routing")
        p = art.params
        return cls(p["transform"], art.array("weights"), art.array("mask"), art.array("centroids"),
                   tau=p["tau"], domain_share=p.get("domain_share"))

    def signature(self, counts: np.ndarray) -> np.ndarray:
        """Eq. 2 on one request's counts [L, E] -> unit signature [N* x E] (zeros if empty)."""
        c = np.asarray(counts)
        if c.shape != self.weights.shape:
            raise EldrError(f"signature has shape {c.shape}, the routing artifact expects {self.weights.shape}")
        x = c[self.mask].astype(np.float64)
        if self.transform == "sqrt":
            x = np.sqrt(x)
        elif self.transform == "binary":
            x = (x > 0).astype(np.float64)
        elif self.transform == "count-idf":
            x = x * self._w
        x = x.ravel()
        n = math.sqrt(float(x @ x))
        return x / n if n > 0 else x

    def decide(self, counts: np.ndarray, loads, tau: float | None = None) -> BandDecision:
        return locality_band(self.signature(counts), self.centroids, loads, self.tau if tau is None else tau)


# -- policies: one interface for the proxy, the simulator and replay ---------------------------

class Policy:
    """A decode routing policy. Subclasses implement :meth:`pick`; callers use :meth:`choose`."""

    name = "policy"
    needs_signature = False

    def choose(self, loads, signature: np.ndarray | None = None, domain: str | None = None,
               healthy: Sequence[bool] | None = None) -> int:
        """The decode worker for one request. ``healthy`` (optional, one flag per worker): when the
        policy's pick is marked down, the least-loaded healthy worker instead, so the proxy (which
        knows health) and the simulator and replay (all healthy) decide the same way."""
        idx = self.pick(loads, signature, domain)
        if healthy is not None and not healthy[idx]:
            up = [i for i, h in enumerate(healthy) if h]
            if up:
                idx = min(up, key=lambda i: loads[i])
        return idx

    def pick(self, loads, signature: np.ndarray | None = None, domain: str | None = None) -> int:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, n_workers: int, **_):
        self.n = n_workers
        self._next = 0

    def pick(self, loads, signature=None, domain=None) -> int:
        w = self._next % len(loads)
        self._next = w + 1
        return w


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def pick(self, loads, signature=None, domain=None) -> int:
        return int(self.rng.integers(len(loads)))


class JSQ(Policy):
    name = "jsq"

    def __init__(self, n_workers: int, **_):
        pass

    def pick(self, loads, signature=None, domain=None) -> int:
        return jsq(loads)


class P2C(Policy):
    """Power of two choices: sample two distinct workers, take the less loaded."""

    name = "p2c"

    def __init__(self, n_workers: int, seed: int = 0, **_):
        self.rng = np.random.default_rng(seed)

    def pick(self, loads, signature=None, domain=None) -> int:
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

    def pick(self, loads, signature=None, domain=None) -> int:
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

    def pick(self, loads, signature=None, domain=None) -> int:
        if signature is None:
            self.last = None
            return jsq(loads)
        self.last = locality_band(signature, self.model.centroids, loads, self.tau)
        return self.last.worker


_POLICY_CLASSES = {"eldr": EldrPolicy, "round-robin": RoundRobin, "random": RandomPolicy, "jsq": JSQ,
                   "p2c": P2C, "domain": DomainPolicy}


def make_policy(name: str, n_workers: int, *, model: RoutingModel | None = None, tau: float | None = None,
                seed: int = 0, domain_share: dict[str, float] | None = None) -> Policy:
    if name not in _POLICY_CLASSES:
        raise EldrError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    if n_workers < 1:
        raise EldrError("at least one decode worker is needed")
    if domain_share is None and model is not None:
        domain_share = model.domain_share
    return _POLICY_CLASSES[name](n_workers, model=model, tau=tau, seed=seed, domain_share=domain_share)
