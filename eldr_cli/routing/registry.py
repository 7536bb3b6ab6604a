"""The one registry of decode policies: their names, what each needs and one line on what it does. The CLI's
choices and help texts, the proxy's config and admin checks, replay's and the report's router lists, and
:func:`eldr_cli.routing.make_router` all derive from it, and every unknown name gets the same message
(:func:`check_policy`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from eldr_cli.errors import EldrError
from eldr_cli.routing import policies as P


def _live(n_workers: int, **kw: Any) -> P.Policy:
    from eldr_cli.routing.live import EldrLivePolicy

    return EldrLivePolicy(n_workers, **kw)


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    summary: str
    build: Callable[..., P.Policy] | None  # None: built by make_router from data only it is given (the oracle)
    needs_routing: bool = False            # a routing artifact (eldr, eldr-live; domain: its domain mix)
    load_balancer: bool = False            # the baselines comparisons are made against
    servable: bool = True                  # the proxy can serve it (the oracle needs each request's decode pattern)


REGISTRY: dict[str, PolicyInfo] = {p.name: p for p in (
    PolicyInfo("eldr", "the paper's locality band: least loaded among the centroids within tau of the nearest",
               P.EldrPolicy, needs_routing=True),
    PolicyInfo("eldr-live", "cost-aware: least predicted step cost over each decoder's live set, within a load cap "
               "(the proxy's default)", _live, needs_routing=True),
    PolicyInfo("round-robin", "each decoder in turn", P.RoundRobin, load_balancer=True),
    PolicyInfo("random", "a decoder at random", P.RandomPolicy, load_balancer=True),
    PolicyInfo("jsq", "join the shortest queue (fewest in flight)", P.JSQ, load_balancer=True),
    PolicyInfo("p2c", "power of two choices", P.P2C, load_balancer=True),
    PolicyInfo("domain", "the request's domain label -> that domain's decoders, JSQ within", P.DomainPolicy,
               needs_routing=True),
    PolicyInfo("oracle", "the band rule on each request's own decode pattern (replay and simulation only)", None,
               servable=False),
    PolicyInfo("clairvoyant", "eldr-live's rule fed each request's true future decode activations: the limit of "
               "its predictor (replay and simulation only)", None, needs_routing=True, servable=False),
)}

ROUTERS = tuple(REGISTRY)                                                  # every name make_router builds
LOAD_BALANCERS = tuple(n for n, p in REGISTRY.items() if p.load_balancer)
SERVABLE = tuple(n for n, p in REGISTRY.items() if p.servable)            # what the proxy and placement serve
NEEDS_ROUTING = tuple(n for n, p in REGISTRY.items() if p.needs_routing)


def check_policy(name: Any, *, servable: bool = False) -> str:
    """``name`` if it is a registered policy (one the proxy can serve, with ``servable``); otherwise the one
    message every entry point (CLI, config file, admin endpoint, a remote change) gives."""
    names = SERVABLE if servable else ROUTERS
    if not isinstance(name, str) or name not in names:
        raise EldrError(f"unknown policy {name!r}; expected one of {', '.join(names)}")
    return name


def policy_help(*, servable: bool = True, default: str | None = None) -> str:
    """The policies for a CLI help text, the default marked."""
    names = SERVABLE if servable else ROUTERS
    return ", ".join(f"{n} (default)" if n == default else n for n in names) + "."
