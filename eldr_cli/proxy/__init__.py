"""`eldr serve-proxy`: the OpenAI-compatible PD routing proxy (ELDR §4.3.2 at the prefill->decode handoff).

- :func:`create_app` builds the ASGI app from a :class:`ProxyConfig` (tests, demo, emulator use it in-process);
- :class:`ServerThread` serves any ASGI app on 127.0.0.1 in a background thread;
- :mod:`eldr_cli.proxy.stub_worker` is a tiny PD-speaking worker for fault tests and benchmarks.
The decode decision itself is made by the shared policies of :mod:`eldr_cli.stages.routing`.
"""

from eldr_cli.proxy.app import ProxyApp, create_app
from eldr_cli.proxy.config import ProxyConfig, build_config
from eldr_cli.proxy.server import ServerThread, free_port, serve

__all__ = ["ProxyApp", "ProxyConfig", "ServerThread", "build_config", "create_app", "free_port", "serve"]
