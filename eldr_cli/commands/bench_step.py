"""`eldr bench decode-step | replay`: the measured whole decode step, and the trace replay of active experts
(with ``--device``: their MoE time, MEASURED). Registered on ``bench_app`` by ``commands.bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import replacing, split_option, tau_option
from eldr_cli.commands.bench import FORCE, SEED, _ints, bench_app


def _print_step(out: Path) -> None:
    """The summary of a measured decode step: per kind, then the step, then what was not timed."""
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console

    a = Artifact(out)
    p, c, m = a.params, a.params["coefficients_ms"], a.metrics
    k = p["layer_ms"]
    console.print(f"MEASURED decode step of {p['model']} TP{p['tp']} on {p['device']} ({p['timed']}): {p['step']}")
    console.print(f"  MoE layer x {p['n_layers']}: {k['k0'] * 1e3:.1f} + {k['kb'] * 1e3:.2f}*active + "
                  f"{k['kt'] * 1e3:.3f}*requests us + {k['kv'] * 1e6:.3f} ns per KV token; {m['fit_points']} "
                  f"points, median |residual| {100 * m['fit_median_abs_rel_error']:.1f}%, max "
                  f"{100 * m['fit_max_abs_rel_error']:.1f}%")
    if isinstance(p.get("shared_expert_ms"), dict):
        s = p["shared_expert_ms"]
        console.print(f"    of which the shared expert (timed alone): {s['d0'] * 1e3:.1f} + "
                      f"{s['dt'] * 1e3:.3f}*requests us")
    d = p.get("dense_layer_ms")
    if isinstance(d, dict):
        console.print(f"  dense layer x {p['dense_layers']}: {d['d0'] * 1e3:.1f} + {d['dt'] * 1e3:.3f}*requests us + "
                      f"{d['dv'] * 1e6:.3f} ns per KV token; median |residual| "
                      f"{100 * m['dense_fit_median_abs_rel_error']:.1f}%")
    h = p.get("lm_head_ms")
    if isinstance(h, dict):
        console.print(f"  LM head x 1: {h['h0'] * 1e3:.1f} + {h['h1'] * 1e3:.3f}*requests us")
    console.print(f"  per MoE layer, as the simulator charges it: [bold]{c['a'] * 1e3:.1f} + {c['b'] * 1e3:.2f}*active "
                  f"+ {c['c'] * 1e3:.3f}*requests us + {c.get('kv', 0.0) * 1e6:.3f} ns per KV token[/]")
    console.print("  not timed: " + "; ".join(p.get("not_timed") or ["-"]))
    for kind, src in (p.get("measured_parts") or {}).items():
        console.print(f"  {kind} from {src}")
    if "kv_capacity_tokens" not in p:
        console.print(p.get("deployment_note") or "no KV capacity: the GPU is not a preset (H100-SXM, H200)"
                      + ", so decoders are not KV-capped")
    console.print(f"-> {out} (decode_step_timings.parquet"
                  + (", dense_layer_timings.parquet" if isinstance(d, dict) else "") + ")")


@bench_app.command("decode-step")
def decode_step_cmd(
    out: Path = typer.Option(Path("artifacts/cost-model"), "--out"),
    model: str = typer.Option("Qwen3-30B-A3B", "--model", help="A preset (Qwen3-30B-A3B, Llama-4-Maverick, ...) or "
                              "a Hugging Face config.json: every layer kind it has (MoE, dense) at its heads, KV "
                              "heads, experts, shared experts and widths."),
    tp: int = typer.Option(1, "--tp", min=1, help="Time one tensor-parallel rank's share of each layer."),
    from_measured: Optional[str] = typer.Option(None, "--from-measured", help="No timing: fit the decode step "
                                                "measured on this GPU preset and shipped with eldr (Qwen3-30B-A3B TP1 "
                                                "on H100-SXM and H200; Llama-4-Maverick TP8 on H200)."),
    batches: str = typer.Option("8,64,256", "--batches", help="Batch sizes (running requests)."),
    actives: str = typer.Option("8,32,64,128", "--active", help="Distinct active experts per MoE layer."),
    contexts: str = typer.Option("512,2048,8192", "--contexts", help="Context tokens per request."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 (GPU default) or float32 (CPU default); "
                                        "with --from-measured only bf16 is shipped."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Compile each layer with "
                                           "torch.compile (one whole graph per shape; a fallback is an error) before "
                                           "the CUDA graph, as vLLM does (default: on a GPU)."),
    repeats: int = typer.Option(20, "--repeats", min=1),
    seed: int = SEED,
    force: bool = FORCE,
) -> None:
    """Time every decoder-layer kind of the model (MoE layers with their shared experts, dense layers) and the
    LM head at batch x active experts x context, in CUDA graphs on a GPU; fit each kind and sum them into the
    simulator's step form; write a cost model for simulate, report, serve-proxy. A model with a layer kind
    that cannot be timed (MLA, sliding-window attention) is refused whole."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.console import console
    from eldr_cli.costmodel import decode_step as ds
    from eldr_cli.costmodel import measured_step as ms
    from eldr_cli.costmodel.moe_layer import resolve_backend, resolve_device
    from eldr_cli.errors import EldrError

    if from_measured:
        ms.shipped_kinds(from_measured, model, tp, compile, dtype)  # fails before anything is written
        check_output(out, "cost-model", force=force or None)
        with replacing(out, force):
            ms.run_decode_step_from_measured(out, device=from_measured, model=model, tp=tp, compiled=compile,
                                             dtype=dtype)
    else:
        grid = _ints(batches, "batches"), _ints(actives, "active"), _ints(contexts, "contexts")
        shape = ds.layer_shape(model, tp)
        dev = resolve_device(device)
        resolve_backend("auto", "auto", dev, dtype or ("bfloat16" if dev == "cuda" else "float32"))
        if len(ds.grid(*grid, shape["top_k"], shape["num_experts"])) < 4:
            raise EldrError("fewer than 4 timeable (batch, active, context) points: the fit needs 4",
                            hint="active <= experts and batch x top-k; batch x context <= 524,288")
        if shape["dense_layers"] and len(ds.dense_grid(grid[0], grid[2])) < 3:
            raise EldrError("fewer than 3 timeable (batch, context) points for the dense layers: their fit needs 3",
                            hint="give more --batches or --contexts (batch x context <= 524,288)")
        check_output(out, "cost-model", force=force or None)  # before minutes of timing
        with console.status("timing the decoder layers ...") as st, replacing(out, force):
            ms.run_decode_step(out, model=model, tp=tp, batches=grid[0], actives=grid[1], contexts=grid[2],
                               device=dev, dtype=dtype, repeats=repeats, seed=seed, compile=compile,
                               progress=lambda kind, i, n: st.update(f"timing the {kind}: point {i}/{n}"))
    _print_step(out)


@bench_app.command("replay")
def replay_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace artifact with per-step decode picks."),
    routing: Path = typer.Option(..., "--routing", help="Routing (or fit) artifact; K = its decoders."),
    out: Path = typer.Option(Path("artifacts/replay"), "--out"),
    policies: str = typer.Option("round-robin,random,jsq,p2c,domain,eldr,oracle", "--policies",
                                 help="Routing policies; oracle = the step-cluster oracle (clusters the served rows' "
                                      "own decode steps), clairvoyant = eldr-live's rule fed the true future."),
    batch_sizes: str = typer.Option("1,4,16,64", "--batch-sizes", help="Decode batch sizes per decoder."),
    split: str = split_option("evaluation", help="Rows to replay."),
    tau: Optional[float] = tau_option(),
    device: Optional[str] = typer.Option(None, "--device", help="Also MEASURE the replayed steps' MoE time: cuda "
                                         "(the model's MoE layers, one TP rank, CUDA graphs) or cpu with --tiny."),
    model: Optional[str] = typer.Option(None, "--model", help="With --device: the model whose MoE layers run "
                                        "(a preset or a config.json; its layers, experts, top-k must be the trace's)."),
    tp: int = typer.Option(1, "--tp", min=1, help="With --device: time one tensor-parallel rank's expert share."),
    dtype: str = typer.Option("bf16", "--dtype", help="With --device cuda: bf16 or fp8 (e4m3, compute capability "
                                                       ">= 9.0)."),
    tiny: bool = typer.Option(False, "--tiny", help="With --device: a tiny layer shape (hidden 64, expert width 32) "
                                                    "instead of the model's, for tests; its times are no GPU's."),
    cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="With --device: the cost model whose "
                                              "prediction for the same steps is shown beside the measurement."),
    max_steps: int = typer.Option(100, "--max-steps", min=2, help="With --device: decode steps timed per policy "
                                  "and batch size (a seeded sample of the steady-state steps)."),
    seed: int = SEED,
    force: bool = FORCE,
) -> None:
    """Distinct active experts per decode step by policy and batch size (Fig. 13), replaying the trace's own
    decode picks closed-loop through each routing policy; no clock, no cost model. The step-cluster oracle
    clusters the served rows' own decode steps (not a limit: ELDR can beat it); clairvoyant is eldr-live's
    rule fed each request's true future (needs --policies ...,clairvoyant). With --device cuda, each policy's
    replayed steps also run as the model's MoE layers on this GPU: MEASURED MoE time per step, its 95%
    interval, the difference to the best load balancer and the cost model's prediction of it."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.console import console
    from eldr_cli.errors import EldrError
    from eldr_cli.pipeline.replay import print_measured, print_replay, run_replay, write_replay

    names = [r.strip() for r in policies.split(",") if r.strip()]
    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise EldrError(f"--batch-sizes must be comma-separated integers, got {batch_sizes!r}") from None
    if not names or not sizes:
        raise EldrError("--policies and --batch-sizes must not be empty")
    measure = None
    if device is not None:
        from eldr_cli.simulator.moe_replay import MeasuredReplay

        measure = MeasuredReplay(device=device, model=model, tp=tp, dtype=dtype, tiny=tiny, cost_model=cost_model,
                                 max_steps=max_steps, seed=seed)
    elif tiny or cost_model is not None:
        raise EldrError("--tiny and --cost-model belong to a measured replay", hint="add --device cuda (or cpu)")
    check_output(out, "replay", [p for p in (trace, routing, cost_model) if p], force=force or None)
    with console.status("replaying ...") as st, replacing(out, force):
        res = run_replay(trace, routing=routing, policies=names, batch_sizes=sizes, split=split, tau=tau, seed=seed,
                         progress=lambda p, b: st.update(f"replaying: {p} at batch {b}"), measure=measure)
        write_replay(out, res, trace=trace, routing=routing, seed=seed)
    print_replay(res)
    if measure is not None:
        print_measured(res)
    console.print(f"REPLAY results -> {out} (replay.json, results.parquet, "
                  + ("moe_time.parquet, " if measure is not None else "") + "fig13_replay.png)")


def register(app: typer.Typer) -> None:
    """decode-step and replay are commands of ``eldr bench`` (bench_app, which commands.bench adds to the app)."""
