"""The tiny random-weight MoE checkpoints used by tests, demo and benchmarks."""

from __future__ import annotations

import hashlib

import pytest

from eldr_cli.checkpoints.tiny import FAMILIES, build_tiny_moe
from eldr_cli.errors import EldrError


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_tiny_fixture_loads_and_generates(tiny_moe_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id
    assert model.config.num_experts == 16 and model.config.num_experts_per_tok == 4
    assert model.config.head_dim >= 32
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    ids = tok("def add(a, b):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4


def test_tiny_is_deterministic(tmp_path):
    prompts = ["the quick brown fox jumps over the lazy dog"] * 20 + ["def f(x): return x * 2"] * 20
    a = build_tiny_moe(tmp_path / "a", num_layers=2, num_experts=8, top_k=2, vocab_size=300, prompts=prompts)
    b = build_tiny_moe(tmp_path / "b", num_layers=2, num_experts=8, top_k=2, vocab_size=300, prompts=prompts)
    c = build_tiny_moe(tmp_path / "c", num_layers=2, num_experts=8, top_k=2, vocab_size=300, prompts=prompts, seed=1)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_and_runs(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM

    d = build_tiny_moe(tmp_path / family, family, num_layers=2, num_experts=8, top_k=2, vocab_size=300,
                       prompts=["hello world, a small prompt"] * 30)
    model = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 300) and torch.isfinite(logits).all()


def test_bad_arguments(tmp_path):
    with pytest.raises(EldrError, match="head_dim"):
        build_tiny_moe(tmp_path / "x", head_dim=16, hidden_size=128)
    with pytest.raises(EldrError, match="family"):
        build_tiny_moe(tmp_path / "y", "llama")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "notes.txt").write_text("mine")
    with pytest.raises(EldrError, match="not a checkpoint"):
        build_tiny_moe(tmp_path / "z")
