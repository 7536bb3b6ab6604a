"""The KV-connector wrapper that carries signatures out of a prefill worker.

With ``ELDR_SIGNATURES=1`` the plugin wraps whatever connector ``--kv-transfer-config`` configures
(NixlConnector, ExampleConnector, ...) in :class:`EldrSignatureConnector`; every call is delegated to
the wrapped connector, and three things are added:

- scheduler side, ``build_connector_meta``: the requests whose prefill completes in this step (with
  their prompt blocks and length) and the blocks whose KV is written without a forward (external
  loads, copy-on-write targets) ride to the worker inside the connector metadata;
- worker side: ``bind_connector_metadata`` applies the invalidations and switches capture on for the
  step; ``build_connector_worker_meta`` (after the forward) sums the completed requests' block rows
  (the reduce kernel) and returns the counts in the worker metadata, i.e. with the step's output;
- scheduler side: the counts are taken from the step's output before the scheduler finishes
  requests (see ``patches.ingest_before_update``), and ``request_finished`` adds
  ``kv_transfer_params["eldr_signature"] = handoff.encode_counts(counts, tokens=prompt_len)``.

The wrapper can also be named directly (no wrapped connector) for single-instance use:
``--kv-transfer-config '{"kv_connector": "EldrSignatureConnector", "kv_connector_module_path":
"eldr_cli.vllm_plugin.connector", "kv_role": "kv_producer"}'``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from eldr_cli.handoff import SIGNATURE_KEY, encode_counts
from eldr_cli.vllm_plugin.capture import STATE, _log


@dataclass
class EldrConnectorMetadata(KVConnectorMetadata):
    inner: Any = None
    complete: list = field(default_factory=list)  # [(req_id, prompt block ids, prompt tokens)]
    invalid: list = field(default_factory=list)  # block ids written without a forward


@dataclass
class EldrWorkerMetadata(KVConnectorWorkerMetadata):
    inner: Any = None
    signatures: dict = field(default_factory=dict)  # req_id -> (counts | None, tokens, reason)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, EldrWorkerMetadata):
            other = EldrWorkerMetadata(inner=other)
        inner = self.inner
        if inner is None:
            inner = other.inner
        elif other.inner is not None:
            inner = inner.aggregate(other.inner)
        sigs = dict(other.signatures)
        sigs.update(self.signatures)  # TP ranks capture the same picks; keep one
        return EldrWorkerMetadata(inner=inner, signatures=sigs)


class _NoConnector(KVConnectorBase_V1):
    """Inner connector when EldrSignatureConnector is used on its own: transfers nothing."""

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self):
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()


class EldrSignatureConnector(KVConnectorBase_V1):
    """Delegates to ``inner``; adds the signature path (see module docstring)."""

    def __init__(self, vllm_config=None, role=None, kv_cache_config=None, *, inner=None):
        # KVConnectorBase_V1.__init__ is deliberately not called: all state lives in ``inner``.
        if inner is None:
            inner = _NoConnector(vllm_config, role, kv_cache_config)
        object.__setattr__(self, "_inner", inner)
        self._eldr_role = role
        self._eldr_block_size = int(vllm_config.cache_config.block_size) if vllm_config is not None else 16
        self._eldr_pending: dict[str, tuple[np.ndarray | None, int, str]] = {}
        self._eldr_prompt_len: dict[str, int] = {}
        self._eldr_local: dict[str, int] = {}
        self._eldr_invalid: list[int] = []
        self._eldr_complete: list = []
        self._eldr_kv_manager = None
        self._eldr_warned: set[str] = set()
        if isinstance(inner, _NoConnector) and role == KVConnectorRole.SCHEDULER:
            from eldr_cli.vllm_plugin.env import ENV, enabled

            if not enabled():
                _log().warning("EldrSignatureConnector is configured but %s=1 is not set: no signatures", ENV)
        if role == KVConnectorRole.WORKER and kv_cache_config is not None and vllm_config is not None:
            STATE.allocate(kv_cache_config, vllm_config)

    # -- delegation ------------------------------------------------------------------------------
    def __getattr__(self, name):  # attributes the base class does not define (connector specifics)
        return getattr(object.__getattribute__(self, "_inner"), name)

    @property
    def role(self):
        return getattr(self._inner, "role", self._eldr_role)

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(getattr(self._inner, "requires_kv_delivery", False))

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(getattr(self._inner, "supports_divergent_local_hybrid_hits", False))

    # -- scheduler side ----------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._eldr_kv_manager = kv_cache_manager
        self._inner.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._eldr_local[request.request_id] = int(num_computed_tokens)
        return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens and num_external_tokens > 0:
            local = self._eldr_local.get(request.request_id, int(request.num_computed_tokens))
            bs = self._eldr_block_size
            ids = blocks.get_block_ids()[0]
            self._eldr_invalid.extend(ids[local // bs: math.ceil((local + num_external_tokens) / bs)])
        return self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        inner_meta = self._inner.build_connector_meta(scheduler_output)
        bs = self._eldr_block_size
        complete = []
        n_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            self._eldr_local.pop(rid, None)
            if new.prompt_token_ids is None:
                continue  # prompt embeddings: no token ids to count against
            n = len(new.prompt_token_ids)
            if new.num_computed_tokens + n_sched.get(rid, 0) >= n:
                complete.append((rid, list(new.block_ids[0][: math.ceil(n / bs)]), n))
            else:
                self._eldr_prompt_len[rid] = n
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            prompt_len = self._eldr_prompt_len.get(rid)
            if prompt_len is None:
                continue
            if cached.num_computed_tokens[i] + n_sched.get(rid, 0) >= prompt_len:
                blocks = self._request_blocks(rid)
                if blocks is not None:
                    complete.append((rid, blocks[: math.ceil(prompt_len / bs)], prompt_len))
                del self._eldr_prompt_len[rid]
        invalid = self._eldr_invalid
        self._eldr_invalid = []
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or []:
            invalid.append(int(copy.dst_block_id))
        return EldrConnectorMetadata(inner=inner_meta, complete=complete, invalid=invalid)

    def _request_blocks(self, rid: str) -> list[int] | None:
        mgr = self._eldr_kv_manager
        if mgr is None:
            return None
        try:
            return list(mgr.get_block_ids(rid)[0])
        except Exception:  # pragma: no cover - request vanished
            return None

    def ingest(self, kv_connector_output) -> None:
        """Take this step's signatures out of the worker metadata (before requests are finished)."""
        meta = getattr(kv_connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, EldrWorkerMetadata):
            self._eldr_pending.update(meta.signatures)
            kv_connector_output.kv_connector_worker_meta = meta.inner

    def update_connector_output(self, connector_output):
        self.ingest(connector_output)
        return self._inner.update_connector_output(connector_output)

    def _attach(self, request, params):
        rid = request.request_id
        self._eldr_prompt_len.pop(rid, None)
        self._eldr_local.pop(rid, None)
        entry = self._eldr_pending.pop(rid, None)
        if entry is None:
            return params
        counts, tokens, why = entry
        if counts is None:
            if why not in self._eldr_warned:
                self._eldr_warned.add(why)
                _log().warning("eldr: no signature for request %s (%s); the proxy falls back", rid, why)
            return params
        out = dict(params) if params else {}
        out[SIGNATURE_KEY] = encode_counts(counts, tokens=tokens)
        return out

    def request_finished(self, request, block_ids):
        delay, params = self._inner.request_finished(request, block_ids)
        return delay, self._attach(request, params)

    def request_finished_all_groups(self, request, block_ids):
        delay, params = self._inner.request_finished_all_groups(request, block_ids)
        return delay, self._attach(request, params)

    # -- worker side -------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata) -> None:
        if isinstance(connector_metadata, EldrConnectorMetadata):
            STATE.begin_step(connector_metadata.invalid)
            self._eldr_complete = connector_metadata.complete
            connector_metadata = connector_metadata.inner
        self._inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        STATE.end_step()
        self._inner.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata):
        if isinstance(kv_connector_metadata, EldrConnectorMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        return self._inner.handle_preemptions(kv_connector_metadata)

    def build_connector_worker_meta(self):
        STATE.after_forward()  # called after the step's forward, inside its forward context
        inner = self._inner.build_connector_worker_meta()
        complete, self._eldr_complete = self._eldr_complete, []
        if not complete:
            return inner
        return EldrWorkerMetadata(inner=inner, signatures=STATE.signatures(complete))


# Delegate every other public KVConnectorBase_V1 method to the wrapped connector.
_OWN = set(vars(EldrSignatureConnector))


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name, _val in inspect.getmembers(KVConnectorBase_V1):
    if _name.startswith("__") or _name in _OWN or isinstance(inspect.getattr_static(KVConnectorBase_V1, _name),
                                                              (classmethod, staticmethod, property)):
        continue
    if callable(_val):
        setattr(EldrSignatureConnector, _name, _delegate(_name))
EldrSignatureConnector.__abstractmethods__ = frozenset()


class EldrSignatureConnectorHMA(EldrSignatureConnector, SupportsHMA):
    """Wrapper for connectors that support the hybrid memory allocator."""


def wrap(inner, vllm_config, role, kv_cache_config):
    cls = EldrSignatureConnectorHMA if isinstance(inner, SupportsHMA) else EldrSignatureConnector
    return cls(vllm_config, role, kv_cache_config, inner=inner)
