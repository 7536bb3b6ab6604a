"""Several eldr router replicas inside one Dynamo deployment share what the proxy replicas share
(``serve-proxy --state``, :mod:`eldr_cli.proxy.replicas`): the signed in-flight counts and eldr-live's live
sets over Redis, and the atomic select-and-reserve of a decode slot (the herd), with the same code.

The Dynamo router is the shared state's host (:class:`eldr_cli.dynamo.router.InstanceRouter`: its instances
are ``Worker`` objects keyed ``decode|dynamo://<instance id>``, the same on every replica since Dynamo's
instance ids are global), and the proxy's dispatcher (:class:`eldr_cli.proxy.dispatch.Dispatcher`) reserves each
decision's slot in it, as in ``serve-proxy``.
"""

from __future__ import annotations

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
