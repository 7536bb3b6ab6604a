"""Train a tiny MoE on the shipped prompts so its experts specialize (``eldr model tiny --train``).

A random-weight MoE routes noise: its decode experts have nothing to do with the prompt's domain,
so ELDR has nothing to exploit. A few minutes of causal-LM training on the CPU, with the usual
load-balancing auxiliary loss, makes routing depend on the text the way real MoE models' does.

- Data: the shipped ``task`` and ``language`` prompt sets. Each prompt id is assigned once, by a
  hash of the id, to ``training`` or ``heldout`` (calibration and serving); the split is written
  as ``split.json`` next to the checkpoint so capture can sample only held-out prompts.
- Deterministic: same data, config, seed and steps -> the same weights (one process, fixed
  thread count, seeded init and batch order).
- One torch thread by default: on a shared 2-core machine two OpenMP threads spend most of their
  CPU waiting for each other (measured ~10x the CPU time per step under load), while one thread is
  within ~20% of two on a quiet machine.
- Cached: the checkpoint records a content hash of (data, config, seed, steps); a second call with
  the same inputs returns the existing directory without training.
- Atomic: everything is written to a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from eldr_cli.data import prompts_file
from eldr_cli.errors import EldrError

MARKER = "eldr_train.json"
TRAIN_FRACTION = 0.5


def split_of(prompt_id: str) -> str:
    """``training`` or ``heldout``: a fixed function of the id (stable across runs and machines)."""
    h = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16)
    return "training" if h / 0xFFFFFFFF < TRAIN_FRACTION else "heldout"


def load_rows(files: list[Path]) -> list[dict]:
    rows: list[dict] = []
    for f in files:
        if not Path(f).is_file():
            continue
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    raise EldrError(f"{f}: a line is not valid JSON") from None
                if isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip():
                    rows.append({"id": str(r.get("id", f"{Path(f).stem}/{len(rows)}")), "prompt": r["prompt"],
                                 "domain": str(r.get("domain", "unknown"))})
    return rows


def _weights_hash(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


DEFAULT_STEPS = 400


def train_tiny_moe(out, *, steps: int = DEFAULT_STEPS, seed: int = 0, num_layers: int = 4, num_experts: int = 16,
                   top_k: int = 2, hidden_size: int = 128, head_dim: int = 32, vocab_size: int = 2048,
                   seq_len: int = 128, batch_size: int = 32, lr: float = 3e-3, aux_coef: float = 0.01,
                   threads: int = 1, prompt_files: list[Path] | None = None, log=None) -> Path:
    """Train (or reuse) a tiny qwen3_moe checkpoint in ``out``; returns ``out``. See module docstring."""
    for name, v in (("steps", steps), ("layers", num_layers), ("experts", num_experts), ("top_k", top_k),
                    ("hidden", hidden_size), ("seq_len", seq_len), ("batch_size", batch_size),
                    ("vocab", vocab_size)):
        if v <= 0:
            raise EldrError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    out = Path(out)
    files = [Path(f) for f in (prompt_files or [prompts_file("task"), prompts_file("language")])]
    rows = load_rows(files)
    if not rows:
        raise EldrError(f"no prompts to train on (looked in {', '.join(str(f) for f in files)})")
    train_rows = [r for r in rows if split_of(r["id"]) == "training"]
    if not train_rows:
        raise EldrError("the training split is empty (too few prompts)")
    config = dict(family="qwen3_moe", num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                  hidden_size=hidden_size, head_dim=head_dim, vocab_size=vocab_size, seq_len=seq_len,
                  batch_size=batch_size, lr=lr, aux_coef=aux_coef, steps=steps, seed=seed,
                  train_fraction=TRAIN_FRACTION, threads=threads)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for r in rows:
        h.update(f"{r['id']}\0{r['prompt']}\0".encode())
    key = h.hexdigest()
    if out.exists():
        marker = out / MARKER
        if marker.is_file():
            try:
                old = json.loads(marker.read_text()).get("cache_key")
            except (OSError, json.JSONDecodeError):
                old = None
            if old == key:
                return out
            raise EldrError(f"{out} holds a trained checkpoint with other inputs (data, config, seed or steps)",
                            hint="pass another --out, or delete that directory first")
        if not out.is_dir() or any(out.iterdir()):
            raise EldrError(f"{out} exists and is not a checkpoint trained by eldr; refusing to write into it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _train(tmp, rows, train_rows, config, key, threads, log)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _train(tmp: Path, rows, train_rows, config: dict, key: str, threads: int, log) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from eldr_cli.checkpoints.tiny import EOS, _config, train_tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(config["seed"])
    tok = train_tokenizer([r["prompt"] for r in train_rows], config["vocab_size"])
    eos = tok.convert_tokens_to_ids(EOS)
    cfg = _config("qwen3_moe", num_layers=config["num_layers"], num_experts=config["num_experts"],
                  top_k=config["top_k"], hidden_size=config["hidden_size"], head_dim=config["head_dim"],
                  vocab_size=config["vocab_size"], eos_id=eos)
    cfg.dtype = "float32"
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = config["aux_coef"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # one token stream (prompts in a seeded order, EOS-separated) cut into seq_len windows
    order = np.random.default_rng(config["seed"]).permutation(len(train_rows))
    ids: list[int] = []
    for i in order:
        ids.extend(tok(train_rows[i]["prompt"])["input_ids"] + [eos])
    L, B = config["seq_len"], config["batch_size"]
    n_win = len(ids) // L
    data = torch.tensor(ids[: n_win * L], dtype=torch.long).view(n_win, L)
    gen = torch.Generator().manual_seed(config["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    steps = config["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * max(0.1, 1 - s / steps))
    model.train()
    losses, aux_losses = [], []
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        batch = data[torch.randint(0, n_win, (B,), generator=gen)]
        res = model(input_ids=batch, labels=batch, output_router_logits=True)
        opt.zero_grad()
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(float(res.loss.detach()), 5))
        aux_losses.append(round(float(res.aux_loss.detach()), 5) if res.aux_loss is not None else None)
        if log is not None and (step % 25 == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f}s)")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    model.eval()
    entropy = _expert_entropy(model, data[: min(32, n_win)], config["num_experts"], config["top_k"])
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
                                               do_sample=False)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    split = {"rule": f"sha256(id) < {TRAIN_FRACTION} -> training", "training": [r["id"] for r in train_rows],
             "heldout": [r["id"] for r in rows if split_of(r["id"]) != "training"]}
    (tmp / "split.json").write_text(json.dumps(split) + "\n")
    tokens = steps * B * L
    train_log = {"loss": losses, "aux_loss": aux_losses, "tokens_seen": tokens, "wall_s": round(wall, 2),
                 "cpu_s": round(cpu, 2),
                 "tokens_per_s": round(tokens / wall, 1), "threads": threads,
                 "load_avg_1m": round(os.getloadavg()[0], 2),
                 "expert_load_entropy_bits": entropy,
                 "max_entropy_bits": round(float(np.log2(config["num_experts"])), 4),
                 "n_training_prompts": len(train_rows), "n_heldout_prompts": len(split["heldout"]),
                 "training_tokens_available": len(ids)}
    (tmp / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")
    _plot(tmp / "loss.png", losses)
    marker = dict(config, cache_key=key, note="trained by eldr model tiny --train",
                  weights_sha256=_weights_hash(tmp))
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    (tmp / "eldr_tiny.json").write_text(json.dumps(dict(config, note="trained weights (eldr model tiny --train)"),
                                                   indent=2) + "\n")


def _expert_entropy(model, windows, n_experts: int, top_k: int) -> list[float]:
    """Per MoE layer: entropy (bits) of the share of top-k picks each expert gets on ``windows``."""
    import torch

    with torch.no_grad():
        res = model(input_ids=windows, output_router_logits=True)
    out = []
    for logits in res.router_logits:
        picks = logits.topk(top_k, dim=-1).indices.flatten()
        p = torch.bincount(picks, minlength=n_experts).double()
        p = p / p.sum()
        out.append(round(float(-(p[p > 0] * p[p > 0].log2()).sum()), 4))
    return out


def _plot(path: Path, losses: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (LM + aux)")
    ax.set_title("eldr model tiny --train")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
