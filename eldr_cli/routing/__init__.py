"""The serving-time decode decision (ELDR §4.3.2 and the baselines).

Where is the routing decision made? In :class:`eldr_cli.routing.router.DecodeRouter`, built by
:func:`eldr_cli.routing.router.make_router`; the proxy, the simulator, replay and placement evaluation all
hold one. ``policies`` holds the rules (locality band, round-robin, random, JSQ, P2C, Domain), ``model`` the
routing artifact in memory (Eq. 2 on handed-off counts), ``oracle`` the step-cluster oracle and
``clairvoyant`` eldr-live's rule on true future activations (the limit), both offline only.
"""

from eldr_cli.routing.model import RoutingModel, load_routing_artifact
from eldr_cli.routing.router import LOAD_BALANCERS, ROUTERS, Decision, DecodeRouter, make_router

__all__ = ["LOAD_BALANCERS", "ROUTERS", "Decision", "DecodeRouter", "RoutingModel", "load_routing_artifact",
           "make_router"]
