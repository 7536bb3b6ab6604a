"""Several eldr router replicas inside one Dynamo deployment share what the proxy replicas share
(``serve-proxy --state``, :mod:`eldr_cli.proxy.replicas`): the signed in-flight counts and eldr-live's live
sets over Redis, and the atomic select-and-reserve of a decode slot (the herd), with the same code.

The Dynamo router is the shared state's host (:class:`eldr_cli.dynamo.router.InstanceRouter`: its instances
are ``Worker`` objects keyed ``decode|dynamo://<instance id>``, the same on every replica since Dynamo's
instance ids are global), and the proxy's dispatcher (:class:`eldr_cli.proxy.dispatch.Dispatcher`) reserves each
decision's slot in it, as in ``serve-proxy``.
"""

from __future__ import annotations

from eldr_cli.proxy.replicas.shared import LocalState


def make_state(state: str | None, *, key_file: str | None = None, password_file: str | None = None,
               ca_file: str | None = None, prefix: str = "eldr-dynamo", reserve_ms: float = 50.0) -> LocalState:
    """``local`` (default) or the proxy's ``RedisState`` over ``redis[s]://...``, opened as ``serve-proxy --state``
    opens it, Redis checked now (the Dynamo component has no config validation step)."""
    from eldr_cli.proxy.replicas.state import open_state

    return open_state(state, key_file=key_file, prefix=prefix, password_file=password_file, ca_file=ca_file,
                      reserve_ms=reserve_ms, check_reachable=True)
