"""`eldr model tiny`: build a small MoE checkpoint (random weights, or trained with --train) for CPU runs."""

from __future__ import annotations

from pathlib import Path

import typer

model_app = typer.Typer(help="Model utilities (tiny random-weight MoE checkpoints).", no_args_is_help=True)


@model_app.command("tiny")
def tiny_cmd(
    out: Path = typer.Option(Path("artifacts/tiny-moe"), "--out", help="Checkpoint directory to write."),
    family: str = typer.Option("qwen3_moe", "--family",
                               help="qwen3_moe | olmoe | mixtral | gpt_oss | qwen2_moe | deepseek_v3"),
    layers: int = typer.Option(4, "--layers", help="Decoder layers."),
    experts: int = typer.Option(16, "--experts", help="Routed experts per MoE layer."),
    top_k: int = typer.Option(4, "--top-k"),
    hidden: int = typer.Option(128, "--hidden"),
    head_dim: int = typer.Option(32, "--head-dim", help=">= 32 (vLLM CPU attention)."),
    vocab: int = typer.Option(2048, "--vocab", help="BPE vocabulary size of the locally trained tokenizer."),
    prompts: Path = typer.Option(None, "--prompts", help="JSONL/CSV/Parquet prompts to train the tokenizer "
                                                         "on (default: shared task.jsonl sample)."),
    seed: int = typer.Option(0, "--seed"),
    train: bool = typer.Option(False, "--train", help="Train a qwen3_moe on the training split of the shipped "
                                                      "task+language prompts (CPU, a few minutes; cached)."),
    steps: int = typer.Option(400, "--steps", help="--train: optimizer steps (of 32 x 128 tokens)."),
    top_k_train: int = typer.Option(2, "--train-top-k", help="--train: experts per token."),
) -> None:
    """Write a deterministic MoE checkpoint + locally trained tokenizer (no network); random or trained weights."""
    from eldr_cli.console import console

    if train:
        import json

        from eldr_cli.checkpoints.train import train_tiny_moe

        files = [prompts] if prompts is not None else None
        path = train_tiny_moe(out, steps=steps, seed=seed, num_layers=layers, num_experts=experts,
                              top_k=top_k_train, hidden_size=hidden, head_dim=head_dim, vocab_size=vocab,
                              prompt_files=files, log=lambda m: console.print(m, highlight=False))
        log = json.loads((path / "train_log.json").read_text())
        console.print(f"[green]trained tiny qwen3_moe[/] -> {path}: {layers} layers, {experts} experts, "
                      f"top-{top_k_train}, hidden {hidden}; final loss {log['loss'][-1]:.3f}, "
                      f"{log['tokens_seen']} tokens in {log['wall_s']:.0f}s "
                      f"(load avg {log['load_avg_1m']}); split.json, train_log.json, loss.png")
        return
    from eldr_cli.checkpoints.tiny import build_tiny_moe

    texts = None
    if prompts is not None:
        from eldr_cli.capture.prompts import load_prompts

        texts = [p.text for p in load_prompts(prompts, tokenizer=None)]
    path = build_tiny_moe(out, family, num_layers=layers, num_experts=experts, top_k=top_k, hidden_size=hidden,
                          head_dim=head_dim, vocab_size=vocab, prompts=texts, seed=seed)
    console.print(f"[green]tiny {family}[/] -> {path}: {layers} layers, {experts} experts, top-{top_k}, "
                  f"hidden {hidden}, head_dim {head_dim}, vocab {vocab} (random weights)")


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
