"""Router hooks record exactly the experts the model used; pad tokens never count."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_cli.capture.hf import TransformersBackend
from eldr_cli.checkpoints.tiny import build_tiny_moe

TEXTS = ["def add(a, b):\n    return a + b", "Janet has 16 eggs and eats three. How many are left?",
         "Does aspirin reduce the risk of stroke?", "A contract needs offer and acceptance."]


def _experts_inputs(model):
    """Independent witness: the top_k_index each experts module is actually called with."""
    calls, handles = [], []
    for name, mod in model.named_modules():
        if name.endswith(".experts") and hasattr(mod, "forward"):
            def pre(m, args, kwargs, name=name):
                idx = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
                calls.append((name, idx.detach().clone()))
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    return calls, handles


@pytest.fixture(scope="module")
def backend(tiny_moe_dir):
    return TransformersBackend(tiny_moe_dir)


def test_prefill_and_decode_picks_equal_the_experts_the_model_ran(backend):
    tok = backend.tokenize(TEXTS[1])
    calls, handles = _experts_inputs(backend.model)
    try:
        cap = backend.run_batch([tok], 3)[0]
    finally:
        for h in handles:
            h.remove()
    L, E, k = backend.num_layers, backend.num_experts, backend.top_k
    assert len(calls) == L * 4  # prefill + 3 decode steps, every MoE layer
    pre = np.stack([np.bincount(c[1].numpy().ravel(), minlength=E) for c in calls[:L]])
    np.testing.assert_array_equal(cap.prefill_counts, pre)
    assert cap.prefill_counts.sum() == len(tok) * L * k
    for s in range(3):
        step = np.stack([np.sort(c[1].numpy().ravel()) for c in calls[L * (s + 1):L * (s + 2)]])
        np.testing.assert_array_equal(cap.decode_picks[s], step)


def test_picks_equal_topk_of_the_models_own_router_logits(backend):
    import torch

    tok = backend.tokenize(TEXTS[0])
    cap = backend.run_batch([tok], 0)[0]
    with torch.no_grad():
        out = backend.model(torch.tensor([tok]), output_router_logits=True)
    logits = out.router_logits
    assert len(logits) == backend.num_layers
    for li, lg in enumerate(logits):
        top = torch.topk(torch.softmax(lg.float(), -1), backend.top_k, dim=-1).indices
        np.testing.assert_array_equal(cap.prefill_counts[li],
                                      np.bincount(top.numpy().ravel(), minlength=backend.num_experts))
        probs = torch.softmax(lg.float(), -1).sum(0).numpy()
        np.testing.assert_allclose(cap.prefill_gate_prob[li], probs, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(cap.prefill_gate_logit[li], lg.float().sum(0).numpy(), rtol=1e-4, atol=1e-3)


def test_batching_with_left_padding_changes_nothing(backend):
    toks = [backend.tokenize(t) for t in TEXTS]
    assert len({len(t) for t in toks}) > 1  # really padded
    batch = backend.run_batch(toks, 5)
    for t, b in zip(toks, batch, strict=True):
        one = backend.run_batch([t], 5)[0]
        np.testing.assert_array_equal(one.prefill_counts, b.prefill_counts)
        np.testing.assert_array_equal(one.decode_picks, b.decode_picks)
        assert b.prefill_counts.sum() == len(t) * backend.num_layers * backend.top_k  # no pad counted
        assert b.decode_picks.shape == (5, backend.num_layers, backend.top_k)
        np.testing.assert_allclose(one.prefill_gate_prob, b.prefill_gate_prob, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmoe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_other_families_are_found_by_router_structure(tmp_path, family):
    d = build_tiny_moe(tmp_path / family, family, num_layers=3, num_experts=8, top_k=2, vocab_size=300,
                       prompts=TEXTS * 10)
    be = TransformersBackend(d)
    assert be.family == family and be.num_experts == 8 and be.top_k == 2
    expect_layers = [1, 2] if family == "deepseek_v3" else [0, 1, 2]  # first layer of DeepSeek-V3 is dense
    assert be.moe_layer_ids == expect_layers
    tok = be.tokenize(TEXTS[2])
    calls, handles = _experts_inputs(be.model)
    try:
        cap = be.run_batch([tok], 2)[0]
    finally:
        for h in handles:
            h.remove()
    L = be.num_layers
    pre = np.stack([np.bincount(c[1].numpy().ravel(), minlength=8) for c in calls[:L]])
    np.testing.assert_array_equal(cap.prefill_counts, pre)
    np.testing.assert_array_equal(cap.decode_picks[1], np.stack([np.sort(c[1].numpy().ravel())
                                                                 for c in calls[2 * L:3 * L]]))
