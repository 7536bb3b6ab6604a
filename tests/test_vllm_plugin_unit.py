"""The plugin's cheap parts (no vLLM engine): activation switch, memory share, signature check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eldr_cli import vllm_plugin
from eldr_cli.kernels import signature_cache as sck
from eldr_cli.vllm_plugin.capture import QWEN3_30B_A3B, CaptureState, signature_share


def test_register_is_a_no_op_unless_enabled(monkeypatch):
    from eldr_cli.vllm_plugin import patches

    calls = []
    monkeypatch.setattr(patches, "install", lambda: calls.append(1))
    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.delenv("ELDR_SIGNATURES", raising=False)
    vllm_plugin.register()
    assert calls == [] and not vllm_plugin._registered
    for off in ("0", "", "no"):
        monkeypatch.setenv("ELDR_SIGNATURES", off)
        vllm_plugin.register()
        assert calls == []
    monkeypatch.setenv("ELDR_SIGNATURES", "1")
    vllm_plugin.register()
    vllm_plugin.register()  # idempotent: vLLM may call it more than once per process
    assert calls == [1]


def test_qwen3_30b_a3b_share_is_under_one_percent():
    # per block: 48 x 128 int8 cells + 4 fill bytes vs 2 (K,V) x 48 layers x 4 heads x 128 x 16 tokens x 2 B
    share = signature_share(block_size=16, **QWEN3_30B_A3B)
    assert share == pytest.approx((48 * 128 + 4) / (2 * 48 * 4 * 128 * 16 * 2))
    assert 0.0039 < share < 0.0040  # 0.391%: the paper's "well under 1%"


def _state(num_blocks=8, L=2, E=4, bs=4):
    st = CaptureState(layers=L, experts=E, top_k=2, bound=True)
    st.sc = sck.SignatureCache.allocate(num_blocks, L, E, bs, 2)
    return st


def test_signatures_sum_blocks_and_check_token_counts():
    st = _state()
    st.sc.cache[1] = 1
    st.sc.cache[3] = 2
    st.sc.fill[1], st.sc.fill[3] = 4, 2
    out = st.signatures([("ok", [1, 3], 6), ("short", [1, 3], 7), ("blocks", [1], 6)])
    counts, n, why = out["ok"]
    assert n == 6 and why == "" and counts.dtype == np.int32
    np.testing.assert_array_equal(counts, np.full((2, 4), 3))
    assert out["short"][0] is None and "6 captured tokens, prompt has 7" in out["short"][2]
    assert out["blocks"][0] is None
    sck.invalidate_blocks(st.sc, [3])
    counts, _, why = st.signatures([("ext", [1, 3], 6)])["ext"]
    assert counts is None and "external KV load" in why


def test_signatures_when_disabled_name_the_reason():
    st = CaptureState(disabled="the model has no MoE layers")
    assert st.signatures([("r", [0], 3)]) == {"r": (None, 3, "the model has no MoE layers")}
    assert st.signatures([]) == {}


def test_capture_only_copies_and_rows_change_only_in_a_bound_step():
    st = _state()
    st.picks = torch.zeros(2, 16, 2, dtype=torch.int32)
    st.token_blocks = torch.zeros(16, dtype=torch.int64)
    st.capture(1, torch.tensor([[3, 1], [2, 0], [1, 3]], dtype=torch.int32))  # a plain copy
    assert st.picks[1, :3].tolist() == [[3, 1], [2, 0], [1, 3]]
    st.after_forward()  # not in a bound step: nothing accumulated
    assert int(st.sc.cache.abs().sum()) == 0 and int(st.sc.fill.abs().sum()) == 0
    st.capture(0, torch.zeros(40, 2, dtype=torch.int32))  # more tokens than the buffer: ignored
    assert int(st.picks[0].abs().sum()) == 0


def test_graph_captured_workers_are_allowed_unless_switched_off(monkeypatch):
    from enum import Enum
    from types import SimpleNamespace

    from eldr_cli.vllm_plugin.patches import _graph_mode

    class Graph(Enum):
        NONE = 0
        PIECEWISE = 1

    def cfg(cg):
        return SimpleNamespace(compilation_config=SimpleNamespace(mode=3, cudagraph_mode=cg))

    assert _graph_mode(cfg(Graph.NONE)) is None  # eager or torch.compile without CUDA graphs
    monkeypatch.delenv("ELDR_SIGNATURES_CUDAGRAPHS", raising=False)
    assert _graph_mode(cfg(Graph.PIECEWISE)) is None  # the hook replays inside CUDA graphs (gpu-check)
    monkeypatch.setenv("ELDR_SIGNATURES_CUDAGRAPHS", "0")  # the operator's switch back to refusing
    why = _graph_mode(cfg(Graph.PIECEWISE))
    assert "PIECEWISE" in why and "ELDR_SIGNATURES_CUDAGRAPHS=0" in why and "--enforce-eager" in why
    assert _graph_mode(cfg(Graph.NONE)) is None
    dp = cfg(Graph.NONE)
    dp.parallel_config = SimpleNamespace(data_parallel_size=2)
    assert "data parallelism" in _graph_mode(dp)
