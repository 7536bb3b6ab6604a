"""`eldr capture`: record expert selections of an MoE model on prompts, or import public traces."""

from __future__ import annotations

from pathlib import Path

import typer

from eldr_cli.commands._common import force_option, fraction, replacing, skip_teardown


def capture_cmd(
    out: Path = typer.Option(Path("artifacts/trace"), "--out", help="Trace artifact directory to write."),
    model: Path = typer.Option(None, "--model", help="Local MoE checkpoint directory (no downloads)."),
    prompts: Path = typer.Option(None, "--prompts", help="JSONL, Parquet or CSV with a 'prompt' or 'messages' "
                                                         "column; optional id, domain, language."),
    from_trace: Path = typer.Option(None, "--from-trace", help="Import an Orders-in-Chaos trace directory "
                                                               "(<org>/<model>/<benchmark>/<subject>/<n>.json)."),
    backend: str = typer.Option("transformers", "--backend", help="transformers | vllm"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Greedy decode steps (EOS ignored)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    chunk_size: int = typer.Option(64, "--chunk-size", min=1, help="Requests per flushed chunk (resume granularity)."),
    limit: int = typer.Option(None, "--limit", min=1, help="Use only the first N prompts."),
    sample: int = typer.Option(None, "--sample", min=1, help="Sample N prompts uniformly (with --seed)."),
    seed: int = typer.Option(0, "--seed"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction", callback=fraction,
                                        help="Share of requests (per domain) held out as the evaluation split."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted capture from its last chunk."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (transformers backend)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 | float16"),
    gate_sums: bool = typer.Option(True, "--gate-sums/--no-gate-sums",
                                   help="Record summed gate probabilities/logits over prompt tokens."),
    num_experts: int = typer.Option(None, "--num-experts", min=1, help="--from-trace: experts per layer "
                                                                "(default: largest id seen + 1)."),
    top_k: int = typer.Option(None, "--top-k", min=1, help="--from-trace: experts per token (default: from the data)."),
    workers: int = typer.Option(1, "--workers", min=1, help="--from-trace: parser processes."),
    exclude_training: bool = typer.Option(None, "--exclude-training/--include-training",
                                          help="Drop the model's training prompts (its split.json); default: on "
                                               "when the model directory has split.json."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    force: bool = force_option(),
) -> None:
    """Record which experts each request uses in prefill and decode -> the trace artifact for `eldr fit`."""
    from eldr_cli.console import console, err_console
    from eldr_cli.errors import EldrError

    def log(msg: str) -> None:
        err_console.print(msg)

    if from_trace is not None:
        if model is not None or prompts is not None:
            raise EldrError("--from-trace imports recorded picks; do not combine it with --model/--prompts")
        from eldr_cli.artifacts.guard import check_output
        from eldr_cli.capture.import_trace import import_trace

        check_output(out, "trace", [from_trace], force=force or None)  # before reading the tree
        with replacing(out, force):
            res = import_trace(from_trace, out, num_experts=num_experts, top_k=top_k, seed=seed,
                               eval_fraction=eval_fraction, workers=workers, progress=progress, log=log)
        _summary(console, out, res.metrics, title=f"imported {from_trace}")
        skip_teardown()
        return
    if model is None or prompts is None:
        raise EldrError("eldr capture needs --model DIR and --prompts FILE (or --from-trace DIR)")
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.pipeline.capture import run_capture

    check_output(out, "trace", [model, prompts], force=force or None)  # before loading the model
    try:
        with replacing(out, force):
            res = run_capture(model, prompts, out, backend=backend, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, chunk_size=chunk_size, limit=limit, sample=sample, seed=seed,
                              eval_fraction=eval_fraction, resume=resume, device=device, dtype=dtype,
                              gate_sums=gate_sums, progress=progress, log=log, exclude_training=exclude_training)
    except KeyboardInterrupt:
        from eldr_cli.capture.staging import staging_dir

        if staging_dir(out).exists():
            err_console.print(f"interrupted; flushed chunks are kept in {staging_dir(out)}: rerun the same command "
                              "with --resume to continue")
        raise
    if res.already_complete:
        console.print(f"{out} is already a complete capture of this model and prompt selection; nothing to do")
    _summary(console, out, res.metrics, title=f"captured {model}")


def _summary(console, out: Path, m: dict, *, title: str) -> None:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import table

    art = Artifact(out, kind="trace")
    p = art.params
    t = table("", "", title=title, show_header=False, numeric_from=2)

    def add(k, v):
        if v is not None:
            t.add_row(k, str(v))

    add("model", f"{p.get('model')} ({p.get('family', '?')}): L={p['num_layers']} MoE layers, "
                 f"E={p['num_experts']}, top-{p['top_k']}")
    add("requests", m.get("n_requests"))
    if m.get("n_calibration") is not None:
        add("split", f"{m['n_calibration']} calibration / {m['n_evaluation']} evaluation")
    add("skipped (too long)", m.get("n_skipped_too_long"))
    add("skipped (empty)", m.get("n_skipped_empty") or None)
    add("skipped (unreadable files)", m.get("n_skipped_files"))
    add("resumed requests", m.get("n_resumed_requests") or None)
    add("prompt tokens", m.get("prompt_tokens_total"))
    add("decode steps", m.get("decode_steps_total"))
    if m.get("requests_per_s") is not None:
        add("throughput", f"{m['requests_per_s']:.2f} req/s, {m.get('tokens_per_s', 0):.0f} tok/s")
    if m.get("files_per_s") is not None:
        add("import rate", f"{m['files_per_s']:.0f} files/s")
    add("domains", m.get("n_domains"))
    if m.get("prefill_decode_corr_mean") is not None:
        add("prefill/decode corr (Fig. 3)", f"{m['prefill_decode_corr_mean']:.3f} mean over layers")
    figs = sorted(x.name for x in Path(out).glob("*.png"))
    add("figures", ", ".join(figs) or None)
    add("artifact", str(out))
    console.print(t)


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_cmd)
