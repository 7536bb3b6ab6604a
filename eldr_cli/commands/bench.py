"""`eldr bench serve | sweep | simulate | replay | moe-layer | cost-model`: load generation against real or emulated
endpoints, the discrete-event simulator, the trace replay of active experts, and the cost models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from eldr_cli.commands._common import force_option, positive, replacing, split_option, tau_option

bench_app = typer.Typer(help="TTFT/TPOT benchmarks: real endpoints, emulated clusters, the simulator, "
                             "and the MoE-layer cost model.", no_args_is_help=True)

RATES = typer.Option("20,40,60,80,100", "--rates", help="Request rates (req/s), comma separated.")
DURATION = typer.Option(120.0, "--duration", callback=positive, help="Measured seconds per rate.")
WARMUP = typer.Option(30.0, "--warmup", min=0.0, help="Seconds sent before measuring (excluded from the summary).")
MAX_TOKENS = typer.Option(512, "--max-tokens", min=1, help="Output tokens per request.")
BURST = typer.Option(1.0, "--burstiness", callback=positive,
                     help="Gamma shape of inter-arrivals (1 = Poisson, <1 burstier).")
SEED = typer.Option(0, "--seed")
TIMEOUT = typer.Option(600.0, "--timeout", callback=positive, help="Per-request timeout (s).")
FORCE = force_option()
WIDE = typer.Option(False, "--wide", help="Show every table column (the default fits 80 columns).")
SPLIT = split_option(None, help="With a trace as --prompts: calibration|evaluation|all (default all; with "
                                "--cluster and no --prompts: the split `eldr emulate` was given).")


def _serve_common(out, url, prompts, rates, duration, warmup, max_tokens, burstiness, seed, timeout, domain_header,
                  ignore_eos, model, mode, cluster, split, live, label, routers=None, tau=None, admin_token=None,
                  router_name="as-deployed", force=False, wide=False):
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.bench.results import print_bench
    from eldr_cli.bench.serve import run_bench
    from eldr_cli.bench.workload import parse_rates
    from eldr_cli.console import console
    from eldr_cli.errors import EldrError

    check_output(out, "bench", [p for p in (prompts,) if p], force=force or None)  # before minutes of load
    with replacing(out, force):
        run_bench(out, url=url, prompts=prompts, rates=parse_rates(rates), duration_s=duration, warmup_s=warmup,
                  max_tokens=max_tokens, burstiness=burstiness, seed=seed, timeout_s=timeout,
                  domain_header=domain_header, ignore_eos=ignore_eos, model=model, routers=routers, tau=tau,
                  admin_token=admin_token, mode=mode, cluster_file=cluster, split=split,
                  live=live and console.is_terminal, label=label, api_key=os.environ.get("OPENAI_API_KEY"),
                  router_name=router_name, console=console)
    summary = print_bench(out, wide=wide)
    done = sum(r["completed"] for r in summary["runs"])
    if done == 0:
        failed = sum(r["failed"] for r in summary["runs"])
        raise EldrError(f"every measured request failed ({failed} of {failed}); nothing was measured "
                        f"(the record is kept in {out})", hint="check --url, --model and the servers' logs")


@bench_app.command("serve")
def serve_cmd(
    url: str = typer.Option(..., "--url", help="OpenAI-compatible base URL (the proxy or one vLLM server)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts",
                                           help="JSONL with {\"prompt\", \"domain\"} per line, or a trace artifact "
                                                "(rows without text go as trace-row:<id>; default with --cluster: "
                                                "the emulated trace's split)."),
    out: Path = typer.Option(Path("artifacts/bench"), "--out"),
    rates: str = RATES, duration: float = DURATION, warmup: float = WARMUP, max_tokens: int = MAX_TOKENS,
    burstiness: float = BURST, seed: int = SEED,
    timeout: float = TIMEOUT,
    domain_header: bool = typer.Option(False, "--domain-header", help="Send X-Eldr-Domain (oracle Domain baseline)."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    model: Optional[str] = typer.Option(None, "--model", help="Model name to send (default: first of /v1/models)."),
    router_name: str = typer.Option("as-deployed", "--router-name", help="Label of the router being measured."),
    mode: Optional[str] = typer.Option(None, "--mode", help="real (default) or emulated."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster file of `eldr emulate` (mode emulated; "
                                                                   "fetches active-expert step logs)."),
    split: Optional[str] = SPLIT,
    live: bool = typer.Option(True, "--live/--no-live", help="Rich live view while running."),
    label: str = typer.Option("", "--label", help="Title for tables and figures."),
    force: bool = FORCE,
    wide: bool = WIDE,
) -> None:
    """Poisson (or gamma) load at each rate; per-request TTFT/TPOT/ITL/E2EL; vllm-bench-serve summary keys."""
    _serve_common(out, url, prompts, rates, duration, warmup, max_tokens, burstiness, seed, timeout, domain_header,
                  ignore_eos, model, mode, cluster, split, live, label, router_name=router_name, force=force, wide=wide)


@bench_app.command("sweep")
def sweep_cmd(
    url: str = typer.Option(..., "--url", help="The eldr proxy's URL."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="As for `bench serve` (default with --cluster: "
                                                                    "the emulated trace's split)."),
    out: Path = typer.Option(Path("artifacts/bench-sweep"), "--out"),
    routers: str = typer.Option("round-robin,random,jsq,p2c,domain,eldr", "--routers"),
    tau: Optional[float] = tau_option(help="ELDR band width (default: the routing artifact's)."),
    admin_token: Optional[str] = typer.Option(None, "--admin-token",
                                              help="Refused (a command line is visible to every user): set "
                                                   "$ELDR_ADMIN_TOKEN or use --admin-token-file."),
    admin_token_file: Optional[str] = typer.Option(None, "--admin-token-file",
                                                   help="File (mode 600) with the proxy's admin token (or "
                                                        "$ELDR_ADMIN_TOKEN)."),
    rates: str = RATES, duration: float = DURATION, warmup: float = WARMUP, max_tokens: int = MAX_TOKENS,
    burstiness: float = BURST, seed: int = SEED,
    timeout: float = TIMEOUT,
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    model: Optional[str] = typer.Option(None, "--model"),
    mode: Optional[str] = typer.Option(None, "--mode"),
    cluster: Optional[Path] = typer.Option(None, "--cluster"),
    split: Optional[str] = SPLIT,
    live: bool = typer.Option(True, "--live/--no-live"),
    label: str = typer.Option("", "--label"),
    force: bool = FORCE,
    wide: bool = WIDE,
) -> None:
    """Same rates for several decode routers on one worker pool (switched via the proxy's /admin/policy);
    one table with % change vs round-robin and vs the best load balancer; Fig. 11 (and Fig. 13 if emulated)."""
    from eldr_cli.errors import EldrError
    from eldr_cli.proxy.config import admin_token_from, refuse_command_line_secrets

    refuse_command_line_secrets(admin_token, None)  # visible to every user through `ps`
    names = [r.strip() for r in routers.split(",") if r.strip()]
    if not names:
        raise EldrError("--routers is empty")
    token = admin_token_from(admin_token_file)
    _serve_common(out, url, prompts, rates, duration, warmup, max_tokens, burstiness, seed, timeout, True,
                  ignore_eos, model, mode, cluster, split, live, label, routers=names, tau=tau,
                  admin_token=token, force=force, wide=wide)


@bench_app.command("simulate")
def simulate_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace artifact with per-step decode picks."),
    cost_model: Path = typer.Option(..., "--cost-model", help="Cost-model artifact (eldr bench moe-layer)."),
    routing: Optional[Path] = typer.Option(None, "--routing", help="Routing (or fit) artifact; needed by eldr/domain."),
    out: Path = typer.Option(Path("artifacts/bench-sim"), "--out"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts to send (default: the trace's --split)."),
    split: str = split_option("evaluation", help="Trace split to send when --prompts is not given."),
    routers: str = typer.Option("round-robin,random,jsq,p2c,domain,eldr", "--routers"),
    prefill: int = typer.Option(8, "--prefill", min=1), decode: int = typer.Option(16, "--decode", min=1),
    tau: Optional[float] = tau_option(),
    max_seqs: int = typer.Option(256, "--max-seqs", min=1),
    rates: str = RATES, duration: float = DURATION, warmup: float = WARMUP, max_tokens: int = MAX_TOKENS,
    burstiness: float = BURST, seed: int = SEED,
    label: str = typer.Option("", "--label"),
    force: bool = FORCE,
    wide: bool = WIDE,
) -> None:
    """Discrete-event SIMULATION of PxD with the same traces, cost model and routing objects; no HTTP."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.bench.results import print_bench
    from eldr_cli.bench.workload import parse_rates
    from eldr_cli.console import console
    from eldr_cli.errors import EldrError
    from eldr_cli.pipeline.simulate import run_simulate

    names = [r.strip() for r in routers.split(",") if r.strip()]
    if not names:
        raise EldrError("--routers is empty")
    check_output(out, "bench", [p for p in (trace, cost_model, routing, prompts) if p], force=force or None)
    with console.status("simulating ..."), replacing(out, force):
        run_simulate(out, trace=trace, cost_model=cost_model, prompts=prompts, split=split, routers=names,
                     rates=parse_rates(rates), n_prefill=prefill, n_decode=decode, duration_s=duration,
                     warmup_s=warmup, max_tokens=max_tokens, burstiness=burstiness, routing=routing, tau=tau,
                     seed=seed, max_seqs=max_seqs, title=label)
    print_bench(out, wide=wide)


def _ints(s: str, name: str) -> list[int]:
    """A comma-separated option of positive integers, or one clear error."""
    from eldr_cli.errors import EldrError

    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise EldrError(f"--{name} must be comma-separated integers, got {s!r}") from None
    if not v or min(v) < 1:
        raise EldrError(f"--{name} must be positive integers, got {s!r}")
    return v


@bench_app.command("moe-layer")
def moe_layer_cmd(
    out: Path = typer.Option(Path("artifacts/cost-model"), "--out"),
    experts: int = typer.Option(64, "--experts", min=1), hidden: int = typer.Option(1024, "--hidden", min=1),
    intermediate: int = typer.Option(512, "--intermediate", min=1), top_k: int = typer.Option(8, "--top-k", min=1),
    batches: str = typer.Option("1,4,16,64,128", "--batches", help="Batch sizes (tokens per step)."),
    actives: str = typer.Option("1,2,4,8,16,32,48,64", "--active", help="Distinct active experts per step."),
    repeats: int = typer.Option(7, "--repeats", min=1),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or fp8 (e4m3, grouped GEMM on a GPU "
                                                          "of compute capability >= 9.0)."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads (1 = steadier on a shared machine)."),
    device: str = typer.Option("auto", "--device", help="auto (the CUDA GPU when torch sees one, else this CPU), "
                                                        "cpu or cuda."),
    backend: str = typer.Option("auto", "--backend", help="auto (grouped on a GPU, loop on a CPU), grouped "
                                "(torch._grouped_mm over all experts, per-expert row offsets) or loop (one matmul "
                                "chain per active expert)."),
    launch: str = typer.Option("auto", "--launch", help="auto (graph on a GPU, eager on a CPU), graph (CUDA graph "
                               "replay, as engines run decode steps) or eager (Python launches; the loop is "
                               "launch-bound on a GPU)."),
    seed: int = SEED,
    force: bool = FORCE,
) -> None:
    """Time one MoE layer (real expert matmuls over only the active experts) on this machine's GPU or CPU;
    fit the cost model t = a + b*active + c*tokens per layer (+ non-MoE term); Fig. 2."""
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console
    from eldr_cli.costmodel.moe_layer import resolve_backend, resolve_device, run_moe_layer
    from eldr_cli.errors import EldrError

    if top_k > experts:
        raise EldrError(f"--top-k ({top_k}) must not exceed --experts ({experts})")
    sizes = _ints(batches, "batches"), _ints(actives, "active")
    from eldr_cli.artifacts.guard import check_output

    resolve_backend(backend, launch, resolve_device(device), dtype)  # fails before anything is written
    check_output(out, "cost-model", force=force or None)  # before minutes of timing
    with console.status("timing the MoE layer ...") as st, replacing(out, force):
        run_moe_layer(out, num_experts=experts, hidden=hidden, intermediate=intermediate, top_k=top_k,
                      batches=sizes[0], actives=sizes[1], repeats=repeats,
                      dtype=dtype, threads=threads, seed=seed, device=device, backend=backend, launch=launch,
                      progress=lambda i, n: st.update(f"timing the MoE layer: round {i}/{n}"))
    a = Artifact(out)
    c, m = a.params["coefficients_ms"], a.metrics
    console.print(f"cost model (measured on {a.params['device']}, {a.params['threads']} thread(s), "
                  f"{a.params['dtype']}; {a.params['timed']}): per MoE "
                  f"layer [bold]{c['a']:.3f} + {c['b']:.3f}*active + {c['c']:.4f}*tokens[/] ms, non-MoE "
                  f"{c['e']:.3f} + {c['d']:.4f}*tokens ms; fit R^2 {m['fit_r2']:.3f}, median |rel err| "
                  f"{100 * m['fit_median_abs_rel_error']:.1f}%")
    console.print(f"-> {out} (fig2_moe_layer.png, moe_timings.parquet)")


@bench_app.command("cost-model")
def cost_model_cmd(
    model: str = typer.Option(..., "--model", help="A Hugging Face config.json (or its directory) or a preset: "
                              "Qwen3-30B-A3B, Qwen3-235B-A22B, GPT-OSS-120B, Mixtral-8x7B, DeepSeek-V3, "
                              "Llama-4-Maverick."),
    device: Optional[str] = typer.Option(None, "--device", help="H100-SXM, H200, MI300X, A100-80GB, L40S, B200."),
    hbm_tbps: Optional[float] = typer.Option(None, "--hbm-tbps", help="HBM bandwidth (TB/s); overrides the device's."),
    tflops: Optional[float] = typer.Option(None, "--tflops", help="Peak dense BF16 TFLOP/s; overrides the device's."),
    hbm_gb: Optional[float] = typer.Option(None, "--hbm-gb", help="HBM per GPU (GB); overrides the device's."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight dtype: bf16, fp8, mxfp4 (KV cache: bf16)."),
    tp: Optional[int] = typer.Option(None, "--tp", min=1, help="Tensor parallel GPUs per instance (default: the "
                                     "smallest of 1, 2, 4, 8, 16 that holds weights + the minimum KV pool)."),
    ep: int = typer.Option(1, "--ep", min=1, help="Expert parallel ranks per instance (vLLM: EP = TP x DP)."),
    util: float = typer.Option(0.9, "--gpu-memory-utilization", min=0.01, max=1.0,
                               help="Share of HBM for weights + KV (vLLM's flag of the same name)."),
    min_kv_tokens: int = typer.Option(65536, "--min-kv-tokens", min=1,
                                      help="Smallest KV pool (tokens per instance) a deployment must hold."),
    context: int = typer.Option(2048, "--context", min=0, help="Context length (tokens) of the KV term."),
    out: Path = typer.Option(Path("artifacts/cost-model"), "--out"),
    force: bool = FORCE,
) -> None:
    """A GPU decode-step cost model from first principles (roofline), its bandwidth efficiencies and fixed
    per-layer costs fitted to measurements shipped with eldr for the H100-SXM and H200 presets (other devices:
    an assumed efficiency and the paper's MI300X Fig. 2 ratio, said in the artifact); refuses a deployment
    whose weights and minimum KV pool do not fit in HBM."""
    from eldr_cli.artifacts.guard import check_output
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.console import console
    from eldr_cli.costmodel.roofline import build, run_cost_model

    kw: dict = dict(device=device, hbm_tbps=hbm_tbps, tflops=tflops, hbm_gb=hbm_gb, dtype=dtype, tp=tp, ep=ep,
                    gpu_memory_utilization=util, min_kv_tokens=min_kv_tokens)
    build(model, **kw)  # validate (and check the fit) before anything is written
    check_output(out, "cost-model", force=force or None)
    with replacing(out, force):
        run_cost_model(out, model, context=context, **kw)
    a = Artifact(out)
    p, m, c, d = a.params, a.metrics, a.params["coefficients_ms"], a.params["deployment"]
    console.print(f"cost model (ROOFLINE, not measured): {p['model']} on {p['device']} {p['dtype']} TP{p['tp']} "
                  f"EP{p['ep']}; per MoE layer {c['a']:.4f} + {c['b']:.4f}*active + {c['c']:.5f}*requests ms "
                  f"(KV at {context} tokens); step at batch 1 {m['step_ms_batch1']:.2f} ms; "
                  f"Fig. 2 ratio {m['fig2_ratio_128_vs_16_batch64']:.2f}x")
    console.print(f"calibration: {p['calibration']['provenance']}")
    console.print(f"deployment: {d['gpus_per_instance']} GPU(s) per instance (TP{d['tp']}"
                  f"{' chosen: the smallest that fits' if d['tp_chosen'] == 'auto' else ''}), weights "
                  f"{d['weights_gb_per_gpu']:.1f} GB per GPU of {d['hbm_gb_per_gpu']:g} GB, KV capacity "
                  f"{d['kv_capacity_tokens']:,} tokens per instance" + (f"; {d['note']}" if d["note"] else ""))
    console.print(f"-> {out}")


@bench_app.command("show")
def show_cmd(path: Path = typer.Argument(..., help="A bench artifact directory."), wide: bool = WIDE) -> None:
    """Print a bench artifact's tables again."""
    from eldr_cli.bench.results import print_bench

    print_bench(path, wide=wide)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")  # decode-step and replay join it from commands.bench_step
