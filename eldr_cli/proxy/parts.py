"""The attributes and helpers of :class:`eldr_cli.proxy.app.ProxyApp` that its admin and health mixins
use, declared here so that each module type-checks on its own (and :mod:`eldr_cli.proxy.base`, which the drift
watch, the metrics and the shadows read, imports none of them)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from eldr_cli.proxy.base import ProxyState
from eldr_cli.proxy.config import ProxyConfig
from eldr_cli.proxy.workers import Worker

if TYPE_CHECKING:
    from eldr_cli.proxy.decisionlog import DecisionLog
    from eldr_cli.proxy.drift import DriftWatch
    from eldr_cli.proxy.metrics import ProxyMetrics
    from eldr_cli.proxy.shadow import ShadowSet


class AppParts:
    """Declared for type checkers; :class:`eldr_cli.proxy.app.ProxyApp` provides them."""

    cfg: ProxyConfig
    state: ProxyState
    metrics: ProxyMetrics
    decision_log: DecisionLog | None
    drift: DriftWatch | None
    shadow: ShadowSet | None

    def _open(self, w: Worker) -> None:
        raise NotImplementedError

    def _build_dispatch(self) -> None:
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    async def _close_when_drained(self, w: Worker) -> None:
        raise NotImplementedError
