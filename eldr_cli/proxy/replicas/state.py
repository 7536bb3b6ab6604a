"""Open the shared state a router replica keeps (``--state``): local, or the signed state over Redis. The one
place ``serve-proxy`` and ``serve-dynamo`` build it from their options."""

from __future__ import annotations

from eldr_cli.proxy.replicas.conn import parse_state_url
from eldr_cli.proxy.replicas.shared import LocalState


def open_state(state: str | None, *, key_file: str | None = None, admin_token: str | None = None,
               prefix: str = "eldr", password_file: str | None = None, ca_file: str | None = None,
               reserve_ms: float = 50.0, check_reachable: bool = False) -> LocalState:
    """``local`` (default) or ``RedisState`` over ``redis[s]://...`` with its key resolved (the same EldrErrors,
    naming the same options, for every caller); ``check_reachable``: fail now, with one message, if Redis does
    not answer (``serve-proxy`` checks it in ``ProxyConfig.validate``)."""
    if parse_state_url(state) == "local":
        return LocalState()
    from eldr_cli.proxy.replicas.auth import resolve_state_key
    from eldr_cli.proxy.replicas.conn import build_state_conn, check_state_reachable
    from eldr_cli.proxy.replicas.shared import RedisState

    assert state is not None
    key, _ = resolve_state_key(key_file, admin_token, state)
    conn = build_state_conn(state, prefix, password_file, ca_file)
    if check_reachable:
        check_state_reachable(conn)
    return RedisState(conn, key, reserve_ms)
