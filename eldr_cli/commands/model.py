"""`eldr model tiny`: build a small random-weight MoE checkpoint to run the real path on a CPU."""

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
) -> None:
    """Write a deterministic random-weight MoE checkpoint + locally trained tokenizer (no network)."""
    from eldr_cli.console import console
    from eldr_cli.models.tiny import build_tiny_moe

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
