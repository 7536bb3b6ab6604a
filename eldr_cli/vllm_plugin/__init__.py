"""eldr's vLLM general plugin: exact prefill expert signatures returned in ``kv_transfer_params``.

Entry point ``vllm.general_plugins: eldr_signatures = eldr_cli.vllm_plugin:register`` (vLLM calls
:func:`register` in every process it starts). It does nothing unless ``ELDR_SIGNATURES=1``. Then:

- after the model loads (``BaseModelLoader.load_model``), it binds a capture function to every MoE
  layer's router (:mod:`eldr_cli.vllm_plugin.capture`);
- the configured KV connector is wrapped (:mod:`eldr_cli.vllm_plugin.connector`): the worker keeps
  the block-granular signature cache, the scheduler adds ``kv_transfer_params["eldr_signature"]``
  (``eldr_cli.handoff.encode_counts``) to a request's prefill answer;
- ``Scheduler.update_from_output`` first takes the step's signatures out of the worker output, so a
  request that finishes in the step that completes its prefill (the PD prefill, ``max_tokens=1``)
  already has its signature when the connector's ``request_finished`` runs.

Without a ``--kv-transfer-config`` there is no ``kv_transfer_params`` to carry the signature: the
plugin says so once and vLLM serves normally.
"""

from __future__ import annotations

from eldr_cli.vllm_plugin.env import ENV, enabled

__all__ = ["ENV", "enabled", "register"]
_registered = False


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; a no-op unless ELDR_SIGNATURES=1."""
    global _registered
    if _registered or not enabled():
        return
    _registered = True
    from eldr_cli.vllm_plugin import patches

    patches.install()
