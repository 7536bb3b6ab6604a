"""Several eldr router replicas inside one Dynamo deployment share what the proxy replicas share
(``serve-proxy --state``, :mod:`eldr_cli.proxy.replicas`): the signed in-flight counts and eldr-live's live
sets over Redis, and the atomic select-and-reserve of a decode slot (the herd), with the same code.

The Dynamo router is the shared state's host (:class:`eldr_cli.dynamo.router.InstanceRouter`: its instances
are ``Worker`` objects keyed ``decode|dynamo://<instance id>``, the same on every replica since Dynamo's
instance ids are global). :func:`reserve` runs the proxy's :func:`eldr_cli.proxy.replicas.reserve.reserve_decode`
on a view of the router shaped like the proxy's state; the proxy's dispatch object
(``eldr_cli/proxy/dispatch.py``) is to take this over for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from eldr_cli.dynamo.router import Choice, InstanceRouter
from eldr_cli.proxy.replicas.conn import parse_state_url
from eldr_cli.proxy.replicas.shared import LocalState


def make_state(state: str | None, *, key_file: str | None = None, password_file: str | None = None,
               ca_file: str | None = None, prefix: str = "eldr-dynamo", reserve_ms: float = 50.0) -> LocalState:
    """``local`` (default) or the proxy's ``RedisState`` over ``redis[s]://...`` (checked, key resolved: the
    same EldrErrors, naming the same options, as ``serve-proxy --state``)."""
    if parse_state_url(state) == "local":
        return LocalState()
    from eldr_cli.proxy.replicas.auth import resolve_state_key
    from eldr_cli.proxy.replicas.conn import build_state_conn, check_state_reachable
    from eldr_cli.proxy.replicas.shared import RedisState

    assert state is not None
    key, _ = resolve_state_key(key_file, None, state)
    conn = build_state_conn(state, prefix, password_file, ca_file)
    check_state_reachable(conn)
    return RedisState(conn, key, reserve_ms)


@dataclass
class _Pool:
    router: InstanceRouter

    @property
    def workers(self) -> list[Any]:  # the instances of now (a rebuild during the round trip is seen)
        return self.router.slots

    def loads(self, use_scraped: bool = False) -> list[int]:
        return self.router.loads


async def reserve(router: InstanceRouter, choice: Choice) -> Any:
    """The replicas' reservation for ``choice`` (made with ``record=False``): it may move the request to
    another instance (:meth:`InstanceRouter.move`). Returns the reserved slot (give it back with
    :func:`release` when the stream ends), None when nothing was reserved (local state, a policy that does
    not reserve, Redis late or down)."""
    from eldr_cli.proxy.replicas.reserve import reserve_decode

    if router.shared.reserver is None or choice.slot is None or router.router is None:
        return None
    sh = router.shared
    offer = None if sh.in_outage else router.router.reservation(choice.decision, choice.loads)
    moved, slot = await reserve_decode(sh.reserver, offer, cast(Any, _Pool(router)), choice.decision, choice.loads)
    if choice.rid in router.live and choice.slot is not None and 0 <= moved.worker < len(router.slots):
        router.move(choice, moved.worker)
    return slot


def release(router: InstanceRouter, slot: Any) -> None:
    if slot is not None and router.shared.reserver is not None:
        router.shared.reserver.release(slot)
