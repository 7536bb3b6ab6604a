"""`eldr serve-proxy`: the OpenAI-compatible PD routing proxy (ELDR §4.3.2 at the prefill->decode handoff).

- :func:`create_app` builds the ASGI app from a :class:`ProxyConfig` (tests, demo, emulator use it in-process);
- :func:`serve` runs it in the foreground (uvicorn); tests use :mod:`eldr_cli.testing`.
The decode decision itself is made by the one decode router of :mod:`eldr_cli.routing`.
"""

from eldr_cli.proxy.app import ProxyApp, create_app
from eldr_cli.proxy.config import ProxyConfig, build_config
from eldr_cli.proxy.server import serve

__all__ = ["ProxyApp", "ProxyConfig", "build_config", "create_app", "serve"]
