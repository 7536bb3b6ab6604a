"""The decode router: *the* object that chooses a decode worker at the prefill -> decode handoff.

The proxy, the simulator, the emulator (through the proxy), trace replay and placement evaluation each
hold one :class:`DecodeRouter` built by :func:`make_router` (the only factory, which also builds the
oracle) and call :meth:`DecodeRouter.decide` for every request, then :meth:`~DecodeRouter.on_dispatch`
and :meth:`~DecodeRouter.on_finish` around its decode. Nothing else chooses a decode worker. Its
configuration (policy, routing model, tau) is fixed once built; an admin change builds a new router and
swaps it in. Per-request state (round-robin's turn, the random policies' generators, a stateful
policy's live set) lives inside and is reset only by building a new router.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from eldr_cli.errors import EldrError
from eldr_cli.routing.model import RoutingModel
from eldr_cli.routing.policies import Policy, Ranking
from eldr_cli.routing.registry import LOAD_BALANCERS, REGISTRY, ROUTERS, check_policy

__all__ = ["LOAD_BALANCERS", "ROUTERS", "Decision", "DecodeRouter", "make_router"]


@dataclass(frozen=True, slots=True)
class Decision:
    """One decode choice and what it was based on (the proxy's decision log records it)."""

    worker: int
    signature: str                          # "ok" | "missing" | "malformed" | "unused"
    similarities: np.ndarray | None = None  # [K] cosine to each centroid (band policies)
    band: np.ndarray | None = None          # worker indices inside the locality band
    predicted_ms: np.ndarray | None = None  # [K] predicted added latency per candidate (eldr-live)
    ranking: Ranking | None = None          # the policy's answer (its first choice may differ from worker)

    @property
    def first(self) -> int:
        """The policy's first choice (``worker`` differs when that one was down or the reservation moved it)."""
        return self.worker if self.ranking is None else self.ranking.first

    @property
    def detail(self) -> Any:
        """What the policy needs back at dispatch (its ranking's ``detail``; None without a ranking)."""
        return None if self.ranking is None else self.ranking.detail


SignatureFn = Callable[[Any, Any], Any]  # (counts, key) -> the signature (or the policy's request entry) or None


class Offer(NamedTuple):
    """The replicas' reservation's choice for one decision: ``order`` (worker indices, in the tie order of
    :func:`eldr_cli.routing.policies.rerank`) and ``slack`` (the load cap over the least reserved, on Redis's
    exact counts); with a cost-aware policy, each candidate's predicted cost and its growth per request the
    decision's loads left out (in ``order``), and the tie fraction: then Redis takes the least ``cost + (exact -
    seen) * growth`` within the cap, which is the policy's own rule (``rerank``) redone on exact counts; without
    them, the first in order within the cap."""

    order: list[int]
    slack: int
    cost: list[float] | None = None
    growth: list[float] | None = None
    tie: float = 0.0


class DecodeRouter:
    """A decode routing policy with its signature source. Build with :func:`make_router`."""

    __slots__ = ("_policy", "_model", "_signature_of", "_n")

    def __init__(self, policy: Policy, n_workers: int, model: RoutingModel | None,
                 signature_of: SignatureFn | None):
        self._policy = policy
        self._n = int(n_workers)
        self._model = model
        self._signature_of = signature_of

    # -- what it is ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._policy.name

    @property
    def n_workers(self) -> int:
        return self._n

    @property
    def model(self) -> RoutingModel | None:
        return self._model

    @property
    def needs_signature(self) -> bool:
        """Whether :meth:`decide` uses the request's prefill counts (callers may skip decoding them)."""
        return self._policy.needs_signature and self._policy.needs_counts

    @property
    def stateful(self) -> bool:
        """Whether the policy follows requests' lives (callers must then call on_dispatch / on_finish)."""
        return type(self._policy).on_finish is not Policy.on_finish

    @property
    def policy(self) -> Policy:
        """The rule inside (read-only use: tests)."""
        return self._policy

    @property
    def live_set(self) -> Any:
        """The policy's live set (:class:`eldr_cli.routing.live_set.LiveSet`: eldr-live and its clairvoyant twin;
        None for the others): what shadows read an assignment's predicted steps from."""
        return getattr(self._policy, "live", None)

    def export_state(self, worker: int) -> list[int] | None:
        """This replica's share of a stateful policy's state on ``worker`` (None: the policy shares none)."""
        return self._policy.export_state(worker)

    def merge_state(self, worker: int, vector: list[int] | None) -> None:
        """The other replicas' summed shares of ``worker`` (see :meth:`Policy.merge_state`)."""
        self._policy.merge_state(worker, vector)

    @property
    def tau(self) -> float | None:
        tau = getattr(self._policy, "tau", None)
        return None if tau is None else float(tau)

    def facts(self) -> dict[str, int]:
        """Counters a run reports (requests without a domain label under the Domain policy)."""
        n = getattr(self._policy, "unlabelled", None)
        return {} if n is None else {"unlabelled_domain": int(n)}

    # -- the decision and the request's life ------------------------------------------------------
    def decide(self, counts: np.ndarray | None, loads: Sequence[int] | np.ndarray, *, domain: str | None = None,
               healthy: Sequence[bool] | None = None, key: Any = None, tokens: int | None = None) -> Decision:
        """The decode worker for one request.

        ``counts`` int [L, E]: the request's prefill expert counts (None when it has none); ``loads``: in-flight
        requests per decoder; ``domain``: the Domain baseline's label; ``healthy`` (one flag per worker): a pick
        marked down is replaced by the least-loaded healthy worker; ``key``: a stable request key (a trace row)
        under which offline callers let the router reuse the request's signature; ``tokens``: the context
        tokens the request will hold on its decoder (prompt + expected output; cost-aware policies).
        """
        sig, state = self._signature(counts, key)
        r = self._policy.rank(loads, sig, domain, tokens)
        idx = r.first
        if healthy is not None and not healthy[idx]:
            up = [i for i, h in enumerate(healthy) if h]
            if up:
                idx = min(up, key=lambda i: loads[i])
        return Decision(int(idx), state, r.similarities, r.band, r.predicted_ms, r)

    def on_dispatch(self, decision: Decision, key: Any) -> None:
        """The request ``key`` is sent where ``decision`` says, or moved there if it was dispatched before. Call it
        right after :meth:`decide`, before anything awaits, so that no other decision sees a live set without it."""
        self._policy.on_dispatch(decision.worker, key, decision.detail)

    def on_finish(self, worker: int, key: Any) -> None:
        self._policy.on_finish(worker, key)

    def reservation(self, decision: Decision, loads) -> Offer | None:
        """What the replicas' reservation may do with ``decision`` (an :class:`Offer`); None when the policy does
        not reserve (its choice stands)."""
        r = decision.ranking
        if r is None or r.slack is None:
            return None
        order = r.preference(decision.worker, loads)
        cg = r.costs()  # as the rule ranks them (eldr-live's band prior included)
        if cg is None:
            return Offer(order, r.slack)
        cost, growth = cg
        return Offer(order, r.slack, [cost[k] for k in order], [growth[k] for k in order], r.tie)

    def _signature(self, counts, key) -> tuple[np.ndarray | None, str]:
        if self._signature_of is None:
            return None, "unused"
        if counts is None and self._policy.needs_counts:
            return None, "missing"
        try:
            sig = self._signature_of(counts, key)
        except EldrError:
            return None, "malformed"
        return (sig, "ok") if sig is not None else (None, "missing")


def _cached(fn: Callable[..., Any]) -> SignatureFn:
    cache: dict[Any, np.ndarray] = {}

    def signature_of(counts, key):
        if key is None:
            return fn(counts)
        sig = cache.get(key)
        if sig is None:
            sig = cache[key] = fn(counts)
        return sig

    return signature_of


def make_router(name: str, n_workers: int, *, model: RoutingModel | None = None, tau: float | None = None,
                seed: int = 0, domain_share: dict[str, float] | None = None, oracle=None,
                cost=None) -> DecodeRouter:
    """Build any decode router by name (one of :data:`ROUTERS`).

    ``model``: the routing artifact (eldr, eldr-live; its domain mix for domain); ``tau`` overrides the artifact's;
    ``cost``: the step cost model eldr-live predicts with (None: a relative default shape, see routing.live);
    ``seed`` seeds the random policies; ``oracle``: an :class:`eldr_cli.routing.oracle.OracleModel` fitted on
    the served rows' decode counts (see :func:`eldr_cli.routing.oracle.fit_oracle`), needed by ``oracle``,
    whose signature is the request's own decode pattern looked up by ``key``, and by ``clairvoyant``, fed its
    ``future`` (each served row's true per-step decode activations, by ``key``).
    """
    check_policy(name)
    if n_workers < 1:
        raise EldrError("at least one decode worker is needed")
    if name == "oracle":
        from eldr_cli.routing.oracle import OraclePolicy

        if oracle is None:
            raise EldrError("the oracle router needs the served rows' decode patterns (fit_oracle builds them)")
        return DecodeRouter(OraclePolicy(n_workers, oracle, tau=tau), n_workers, model,
                            lambda counts, key: oracle.patterns.get(key))
    if name == "clairvoyant":
        from eldr_cli.routing.clairvoyant import ClairvoyantPolicy

        future = None if oracle is None else oracle.future
        if future is None:
            raise EldrError("the clairvoyant router needs the served rows' true decode activations "
                            "(fit_oracle with decode_steps builds them)")
        cp = ClairvoyantPolicy(n_workers, model=model, cost=cost, future=future)
        return DecodeRouter(cp, n_workers, model, cp.request)
    if domain_share is None and model is not None:
        domain_share = model.domain_share
    build = REGISTRY[name].build
    assert build is not None
    policy = build(n_workers, model=model, tau=tau, seed=seed, domain_share=domain_share,
                                  cost=cost)
    sig = None
    request = getattr(policy, "request", None)  # a policy that predicts from the counts itself (eldr-live)
    if request is not None:
        sig = _cached(request)
    elif policy.needs_signature and model is not None:
        sig = _cached(model.signature if policy.unit_signature else functools.partial(model.signature, unit=False))
    return DecodeRouter(policy, n_workers, model, sig)
