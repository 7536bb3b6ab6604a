"""What the proxy's concern modules share: :class:`ProxyState` (pools, decode router, routing model, counters).
The app's attributes the exchange, admin and health mixins use are declared in :mod:`eldr_cli.proxy.parts`."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from eldr_cli.proxy.config import ProxyConfig
from eldr_cli.proxy.replicas.shared import LocalState
from eldr_cli.proxy.workers import WorkerPool
from eldr_cli.routing import DecodeRouter, RoutingModel, make_router
from eldr_cli.routing.prefill import PrefixHashPrefill


class RouterState(Protocol):
    """What the metrics (:mod:`eldr_cli.proxy.metrics`) and the shadow policies (:mod:`eldr_cli.proxy.shadow`) read
    of a router's state: :class:`ProxyState`, or the Dynamo router's (:class:`eldr_cli.dynamo.router.InstanceRouter`,
    whose decode pool is Dynamo's instances)."""

    @property
    def prefill(self) -> WorkerPool: ...
    @property
    def decode(self) -> WorkerPool: ...
    @property
    def router(self) -> DecodeRouter: ...
    @property
    def model(self) -> RoutingModel | None: ...
    @property
    def cost(self) -> Any: ...
    @property
    def tau_override(self) -> float | None: ...
    @property
    def in_progress(self) -> int: ...
    @property
    def shared(self) -> LocalState: ...
    @property
    def policy_name(self) -> str: ...

    def tau_effective(self) -> float: ...

    def make(self, name: str, n: int, model: RoutingModel | None, tau: float | None) -> DecodeRouter: ...


def make_shared_state(cfg: ProxyConfig) -> LocalState:
    """Local, or Redis with the connection and key resolved (and checked) by ``cfg.validate()``."""
    from eldr_cli.proxy.replicas.state import open_state

    return open_state(cfg.state, key_file=cfg.state_key_file, admin_token=cfg.admin_token, prefix=cfg.state_prefix,
                      password_file=cfg.state_password_file, ca_file=cfg.state_ca_file,
                      reserve_ms=cfg.state_reserve_ms)


def default_policy(model: RoutingModel | None, path: str | None) -> str:
    """eldr-live when the routing artifact carries its decode-activation model; else the paper's eldr, said once."""
    if model is not None and model.live is not None:
        return "eldr-live"
    logging.getLogger("eldr.proxy").warning(
        "routing artifact %s was fitted before eldr-live (no decode-activation model): serving with the paper's "
        "eldr policy; refit it with `eldr fit` to use the default eldr-live", path)
    return "eldr"


def load_step_cost(path: str | None, model: RoutingModel | None) -> Any:
    """The cost model eldr-live predicts with; a roofline of another model (L or E) than the routing artifact's
    is refused naming both."""
    if path is None:
        return None
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.costmodel import CostModel, model_mismatch
    from eldr_cli.errors import EldrError

    cost = CostModel.load(path)
    why = model_mismatch(Artifact(path).params, *model.shape) if model is not None else None
    if why:
        raise EldrError(f"--cost-model {path} {why}: the routing artifact's model",
                        hint="write a cost model of the served model: eldr bench cost-model --model CONFIG "
                             "(or eldr bench decode-step on its GPU)")
    return cost


class ProxyState:
    """Everything one proxy instance knows: pools, the decode router, routing model, counters. An admin
    change replaces ``router`` as a whole (built by ``make``); nothing else chooses a decode worker."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.prefill = WorkerPool("prefill", cfg.prefill)
        self.decode = WorkerPool("decode", cfg.decode)
        self.model = RoutingModel.load(cfg.routing) if cfg.routing else None
        self.cost = load_step_cost(cfg.cost_model, self.model)
        self.routing_path = cfg.routing
        self.tau_override = cfg.tau
        if cfg.policy is None:
            cfg.policy = default_policy(self.model, cfg.routing)
        self.router = self.make(cfg.policy, len(self.decode), self.model, cfg.tau)
        self.prefix = PrefixHashPrefill(cfg.prefix_block_chars, cfg.prefix_blocks, cfg.prefill_overload_factor)
        self.in_progress = 0
        self.started = 0
        self.shared = make_shared_state(cfg)  # local, or counts and changes shared via Redis
        self.outcomes: dict[str, int] = {}

    def make(self, name: str, n: int, model: RoutingModel | None, tau: float | None) -> DecodeRouter:
        return make_router(name, n, model=model, tau=tau, seed=self.cfg.seed, cost=self.cost)

    @property
    def policy_name(self) -> str:
        return self.router.name

    def tau_effective(self) -> float:
        tau = self.router.tau
        if tau is not None:
            return float(tau)
        if self.tau_override is not None:
            return float(self.tau_override)
        return float(self.model.tau) if self.model is not None else float("nan")
