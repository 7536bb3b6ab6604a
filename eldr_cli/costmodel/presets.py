"""Named model and device presets for the roofline cost model (`eldr bench cost-model`).

Model facts are the public Hugging Face ``config.json`` values, normalised by :func:`model_facts` into
:class:`ModelFacts` (what the roofline and the deployment check read); device facts are the vendors' HBM
bandwidth, peak *dense* BF16 tensor FLOP/s (no structured sparsity) and HBM capacity per GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class ModelFacts:
    n_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    heads: int
    expert_params: int          # one routed expert (gate, up, down)
    dense_params: int           # every non-routed weight read per step (incl. LM head)
    kv_elems_per_token_layer: int
    attn_dim: int               # heads * head dim (attention FLOPs per context token)
    kv_heads: int = 0           # KV heads split over TP ranks; 0 = an MLA latent cache (every rank holds it)
    embed_params: int = 0       # the input embedding table when untied (resident, only B rows read)


def model_facts(cfg: dict) -> ModelFacts:
    """Normalise a Hugging Face config (Qwen-MoE, Mixtral, GPT-OSS, DeepSeek-V3, Llama-4 layouts)."""
    def g(key: str) -> Any:
        return cfg.get(key)
    E = g("num_experts") or g("num_local_experts") or g("n_routed_experts") or 0
    k = g("num_experts_per_tok") or g("moe_topk") or 0
    if not E or not k or E < 2:
        raise EldrError("--model: config.json is not a mixture-of-experts model (no num_experts / "
                        "num_local_experts / n_routed_experts with num_experts_per_tok)")
    try:
        H, L = int(g("hidden_size")), int(g("num_hidden_layers"))
        heads = int(g("num_attention_heads"))
    except (TypeError, ValueError):
        raise EldrError("--model: config.json lacks hidden_size / num_hidden_layers / num_attention_heads") from None
    kvh = int(g("num_key_value_heads") or heads)
    hd = int(g("head_dim") or H // heads)
    I_e = int(g("moe_intermediate_size") or g("intermediate_size"))
    I_d = int(g("intermediate_size_mlp") or g("intermediate_size") or I_e)
    from eldr_cli.costmodel.layer_kinds import moe_layer_flags, shared_experts

    moe_layers = sum(moe_layer_flags(cfg))  # Llama-4's moe_layers, Qwen's mlp_only_layers, first-k-dense, ...
    shared, I_s = shared_experts(cfg)  # a Llama-4 config.json has no key for its one shared expert
    if g("kv_lora_rank"):  # MLA: low-rank q and joint kv, cache holds the compressed kv + rope key
        qr, kr, rope = int(g("q_lora_rank") or 0), int(g("kv_lora_rank")), int(g("qk_rope_head_dim"))
        nope, vd = int(g("qk_nope_head_dim")), int(g("v_head_dim"))
        q = H * qr + qr * heads * (nope + rope) if qr else H * heads * (nope + rope)
        attn = q + H * (kr + rope) + kr * heads * (nope + vd) + heads * vd * H
        kv_elems, attn_dim = kr + rope, heads * (nope + rope)
    else:
        attn = H * heads * hd * 2 + 2 * H * kvh * hd
        kv_elems, attn_dim = 2 * kvh * hd, heads * hd
    dense_mlp = 3 * H * I_d
    dense = L * attn + (L - moe_layers) * dense_mlp + moe_layers * (shared * 3 * H * I_s + H * E)
    vocab = int(g("vocab_size") or 0)
    dense += vocab * H  # LM head (the embedding lookup reads only B rows)
    return ModelFacts(n_layers=L, moe_layers=moe_layers, num_experts=int(E), top_k=int(k), hidden=H, heads=heads,
                      expert_params=3 * H * I_e, dense_params=dense, kv_elems_per_token_layer=kv_elems,
                      attn_dim=attn_dim, kv_heads=0 if g("kv_lora_rank") else kvh,
                      embed_params=0 if g("tie_word_embeddings") else vocab * H)
