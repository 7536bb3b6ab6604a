"""The switch of the vLLM plugin (``ELDR_SIGNATURES=1``), below the modules that read it: the entry point
(:mod:`eldr_cli.vllm_plugin`) and the connector wrapper both ask here, so neither imports the other."""

from __future__ import annotations

import os

ENV = "ELDR_SIGNATURES"


def enabled() -> bool:
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")
