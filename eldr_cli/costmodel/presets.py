"""Named model and device presets for the roofline cost model (`eldr bench cost-model`).

Model facts are the public Hugging Face ``config.json`` values; device facts are the vendors' HBM
bandwidth, peak *dense* BF16 tensor FLOP/s (no structured sparsity) and HBM capacity per GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eldr_cli.errors import EldrError

# name -> HF-config-like dict (only the fields the roofline reads)
MODELS: dict[str, dict] = {
    "Qwen3-30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          vocab_size=151936, tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                            vocab_size=151936, tie_word_embeddings=False),
    # every other layer attends over a 128-token sliding window (what `bench decode-step` refuses to time)
    "GPT-OSS-120B": dict(hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                         head_dim=64, num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880,
                         vocab_size=201088, tie_word_embeddings=False, sliding_window=128),
    "Mixtral-8x7B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                         vocab_size=32000, tie_word_embeddings=False),
    # MLA attention (q/kv low-rank); the first 3 layers are dense MLPs; one shared expert per MoE layer
    "DeepSeek-V3": dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        n_shared_experts=1, intermediate_size=18432, first_k_dense_replace=3,
                        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, vocab_size=129280, tie_word_embeddings=False),
    # every other layer is MoE (128 routed + 1 shared, top-1); the rest are dense MLPs
    "Llama-4-Maverick": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                             head_dim=128, num_local_experts=128, num_experts_per_tok=1, intermediate_size=8192,
                             intermediate_size_mlp=16384, interleave_moe_layer_step=2, n_shared_experts=1,
                             vocab_size=202048, tie_word_embeddings=False),
}

# name -> (HBM TB/s, peak dense BF16 TFLOP/s, HBM GB per GPU); B200 as shipped in HGX/DGX B200 (180 GB)
DEVICES: dict[str, tuple[float, float, float]] = {
    "H100-SXM": (3.35, 989.0, 80.0),
    "H200": (4.8, 989.0, 141.0),
    "MI300X": (5.3, 1307.0, 192.0),
    "A100-80GB": (2.04, 312.0, 80.0),
    "L40S": (0.864, 362.0, 48.0),
    "B200": (8.0, 2250.0, 180.0),
}

# bytes per weight; mxfp4 = 4-bit values + one 8-bit scale per 32
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp4": 4.25 / 8}
# tensor-core throughput relative to BF16
DTYPE_FLOPS = {"bf16": 1.0, "fp8": 2.0, "mxfp4": 2.0}


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _lookup(table: dict, name: str, what: str):
    hit = {_norm(k): k for k in table}.get(_norm(name))
    if hit is None:
        raise EldrError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return hit, table[hit]


def model_config(spec: str | os.PathLike) -> tuple[str, dict]:
    """(name, config dict) for a preset name or a path to a Hugging Face config.json."""
    p = Path(spec)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise EldrError(f"--model {p}: not a readable JSON config ({e})") from None
        if not isinstance(cfg, dict):
            raise EldrError(f"--model {p}: a config.json must be a JSON object")
        cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
        return str((cfg.get("architectures") or [p.resolve().parent.name])[0]), cfg
    if str(spec).endswith(".json"):
        raise EldrError(f"--model {spec}: no such file")
    return _lookup(MODELS, str(spec), "model preset")


def device_facts(name: str) -> tuple[str, float, float, float]:
    """(name, HBM TB/s, dense BF16 TFLOP/s, HBM GB per GPU)."""
    hit, (bw, tf, gb) = _lookup(DEVICES, name, "device")
    return hit, bw, tf, gb
