"""The decoder-layer kinds of a model config, and one TP rank's shape of each: what `eldr bench decode-step`
times so that a measured step is the whole model, not its MoE layers alone.

Two kinds are timed (both with the same attention block: RMSNorm, QKV, grouped-query attention over the KV
cache, O projection + residual):

- ``moe``: RMSNorm, router GEMM + top-k, the routed experts (only the active ones) and the shared expert(s)
  where the model has them (Llama-4, Qwen2-MoE, DeepSeek), + residual;
- ``dense``: RMSNorm, a dense SwiGLU MLP (Llama-4's ``intermediate_size_mlp``; else ``intermediate_size``),
  + residual.

Which layer is which follows the config as Hugging Face's modelling code reads it: Llama-4's ``moe_layers``
(default every ``interleave_moe_layer_step``-th), Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``,
DeepSeek's ``first_k_dense_replace`` and ``moe_layer_freq``. A model with a layer kind the timed layers do not
model (MLA attention, sliding-window attention) is refused as a whole, never half-timed.
"""

from __future__ import annotations

from eldr_cli.errors import EldrError

HINT = "time a GQA model with full attention (Qwen3-30B-A3B, Llama-4-Maverick, Mixtral-8x7B, ...)"


def _int(cfg: dict, *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return int(v)
    return default


def moe_layer_flags(cfg: dict) -> list[bool]:
    """Per decoder layer: True where it is an MoE layer (see the module docstring for the keys read)."""
    L = _int(cfg, "num_hidden_layers")
    if isinstance(cfg.get("moe_layers"), list):  # Llama-4 states them
        idx = {int(i) for i in cfg["moe_layers"]}
        return [i in idx for i in range(L)]
    first = _int(cfg, "first_k_dense_replace")
    step = _int(cfg, "interleave_moe_layer_step", "decoder_sparse_step", default=1) or 1
    freq = _int(cfg, "moe_layer_freq", default=1) or 1
    mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    return [i >= first and (i + 1) % step == 0 and i % freq == 0 and i not in mlp_only for i in range(L)]


def shared_experts(cfg: dict) -> tuple[int, int]:
    """(shared experts per MoE layer, each one's intermediate width): DeepSeek's ``n_shared_experts`` (width
    ``moe_intermediate_size``), Qwen2-MoE's ``shared_expert_intermediate_size``, Llama-4's one shared expert
    (width ``intermediate_size``; its config has no key for it, so it is recognised by its model type or its
    ``interleave_moe_layer_step``)."""
    width = _int(cfg, "shared_expert_intermediate_size", "moe_intermediate_size", "intermediate_size")
    if cfg.get("n_shared_experts") is not None:
        return int(cfg["n_shared_experts"]), width
    if cfg.get("shared_expert_intermediate_size"):
        return 1, width
    if str(cfg.get("model_type", "")).startswith("llama4") or "interleave_moe_layer_step" in cfg:
        return 1, width
    return 0, width


def untimeable(cfg: dict) -> str | None:
    """Why the timed layer kinds cannot represent this model's layers, or None."""
    if cfg.get("q_lora_rank") is not None or cfg.get("kv_lora_rank"):
        return "uses MLA attention, which the timed decoder layer (grouped-query attention) does not model"
    kinds = {str(t) for t in cfg.get("layer_types") or []} - {"full_attention"}
    if kinds:
        return f"has {', '.join(sorted(kinds))} layers, which the timed layer (full attention) does not model"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window") is not False:
        return (f"uses sliding-window attention (window {cfg['sliding_window']}), which the timed layer "
                "(full attention over the whole KV cache) does not model")
    return None


def not_timed(cfg: dict) -> list[str]:
    """What a step of this model does that the timed layers leave out (small, stated in the artifact)."""
    out = ["rotary embeddings on q/k (elementwise, one token per request)",
           "sampling beyond the greedy pick; the embedding lookup (B rows); collectives between TP ranks "
           "(one rank is timed)"]
    if cfg.get("use_qk_norm") or "qk_norm" in str(cfg.get("model_type", "")) or cfg.get("model_type") == "qwen3_moe":
        out.append("the q/k RMSNorms")
    if cfg.get("attention_chunk_size"):
        out.append(f"chunked local attention (attention_chunk_size {cfg['attention_chunk_size']}) timed as full "
                   "attention: exact while a request's context is within one chunk, a KV over-charge beyond")
    return out


def layer_kinds(name: str, cfg: dict, tp: int = 1) -> dict:
    """One TP rank's shape of every layer kind of the model ``name`` with Hugging Face config ``cfg`` (a preset's
    or a config.json's, ``costmodel.presets.model_config``): {"model", "tp", "attention", "moe", "dense" (None
    without dense layers), "vocab", "not_timed", "layers" (kind per layer)}."""
    why = untimeable(cfg)
    if why:
        raise EldrError(f"{name} {why}; its decode step cannot be timed whole, so none of it is", hint=HINT)
    if tp < 1:
        raise EldrError("--tp must be >= 1")
    try:
        H, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        E = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"])
        I_e = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        top_k = int(cfg["num_experts_per_tok"])
        flags = moe_layer_flags(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise EldrError(f"--model {name}: not an MoE config with heads, experts and top-k ({e!r} missing)") from None
    n_shared, I_s = shared_experts(cfg)
    I_d = _int(cfg, "intermediate_size_mlp", "intermediate_size", default=I_e)
    n_dense = flags.count(False)
    widths = [("query heads", heads), ("expert width", I_e)] + ([("shared-expert width", I_s)] if n_shared else []) \
        + ([("dense MLP width", I_d)] if n_dense else [])
    bad = [f"{w} {v}" for w, v in widths if v % tp]
    if bad:
        raise EldrError(f"--tp {tp} does not divide {name}'s {', '.join(bad)}")
    if not flags.count(True):
        raise EldrError(f"--model {name}: none of its {len(flags)} layers is an MoE layer")
    return {"model": name, "tp": tp, "layers": ["moe" if f else "dense" for f in flags],
            "attention": {"hidden": H, "heads": heads // tp, "kv_heads": max(1, kv // tp),
                          "head_dim": int(cfg.get("head_dim") or H // heads)},
            "moe": {"layers": flags.count(True), "num_experts": E, "intermediate": I_e // tp, "top_k": top_k,
                    "shared_experts": n_shared, "shared_intermediate": I_s // tp if n_shared else 0},
            "dense": {"layers": n_dense, "intermediate": I_d // tp} if n_dense else None,
            "vocab": int(cfg.get("vocab_size") or 0) // tp, "not_timed": not_timed(cfg)}
