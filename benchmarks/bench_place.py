"""make bench-place: per-decoder expert placement (ELDR §5) -- speed and replayed quality.

1. Placement time at K=16, L=48, E=128, R=4 (median of repeats), against the named peer in the same
   run: vLLM's DeepSeek-EPLB policy (``DefaultEplbPolicy.rebalance_experts``) solving the same
   K*L balanced packings (num_replicas = E, i.e. no replication).
2. Mean max-activated-experts per EP rank per decode step (METRO's metric) for contiguous, global
   EPLB and per-decoder placement, and per-decoder's gap to ceil(active / R), from
   ``eldr place-experts evaluate`` on GENERATED traces (eldr_cli.synth, labelled as such) and, when
   `eldr capture` is available, on a trace captured from the tiny random-weight MoE model.

Prints a table, writes JSON (default bench-results/place.json).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.base import ROOT, environment, parser, write_result
from eldr_cli.data import prompts_file


def _timeit(fn, repeats):
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs


def bench_speed(repeats: int) -> dict:
    from eldr_cli.method.placement import GlobalEPLB, PerDecoderPlacement, greedy_placement

    K, L, E, R, N = 16, 48, 128, 4, 2000
    rng = np.random.default_rng(0)
    labels = rng.integers(0, K, N)
    # clustered decode counts: each cluster prefers its own experts (structure does not change the cost)
    pref = rng.dirichlet(np.full(E, 0.3), size=(K, L))
    steps = np.full(N, 128)
    dc = rng.binomial(128, np.minimum(1.0, 8 * pref[labels])).astype(np.int32)
    est = PerDecoderPlacement(ep_size=R, batch_size=8)
    fit_med, fit_runs = _timeit(lambda: est.fit(dc, steps, labels, K), repeats)
    act = est.activation_
    core_med, core_runs = _timeit(lambda: greedy_placement(act, R), repeats)
    eplb_med, _ = _timeit(lambda: GlobalEPLB(ep_size=R, n_redundant=R).fit(dc.sum(0).astype(float)), repeats)
    res = {"K": K, "L": L, "E": E, "R": R, "n_calibration_requests": N,
           "per_decoder_fit_median_s": fit_med, "per_decoder_fit_runs_s": fit_runs,
           "greedy_core_median_s": core_med, "greedy_core_runs_s": core_runs,
           "global_eplb_fit_median_s": eplb_med}
    try:
        import torch
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        w = torch.tensor(act.reshape(K * L, E))
        peer_med, peer_runs = _timeit(lambda: DefaultEplbPolicy.rebalance_experts(w, E, 1, 1, R), repeats)
        res.update({"peer": "vllm DefaultEplbPolicy.rebalance_experts(weight[K*L, E], num_replicas=E, 1, 1, R)",
                    "peer_median_s": peer_med, "peer_runs_s": peer_runs,
                    "ratio_peer_over_ours_core": peer_med / core_med})
        # same problem, same answer quality: compare the heaviest rank's expected activation
        theirs = DefaultEplbPolicy.rebalance_experts(w, E, 1, 1, R)
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).numpy()
        ours = greedy_placement(act, R).reshape(K * L, E)
        a = act.reshape(K * L, E)

        def mx(p2l):
            return np.take_along_axis(a, p2l.astype(np.int64), 1).reshape(K * L, R, -1).sum(2).max(1)

        res["heaviest_rank_ours_over_peer"] = float(np.mean(mx(ours) / mx(theirs)))
    except Exception as e:  # pragma: no cover - vLLM missing
        res["peer_error"] = repr(e)
    return res


def _evaluate(trace_dir: Path, work: Path, *, decoders: int, ep_size: int, batch: int, pairs: int,
              redundant: int = 0, policy: str = "eldr") -> dict:
    from eldr_cli.artifacts.store import Artifact
    from eldr_cli.pipeline.evaluate import run_evaluate_placement
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.place import run_place_experts

    fit = work / "fit"
    if not (fit / "manifest.json").exists():
        run_fit(trace_dir, fit, decoders=decoders, pairs=pairs, figures=False)
    tag = f"R{ep_size}-B{batch}-red{redundant}-{policy}"
    run_place_experts(trace_dir, fit / "routing", work / f"placement-{tag}", ep_size=ep_size, batch_size=batch,
                      redundant_experts=redundant, figures=False)
    run_evaluate_placement(trace_dir, fit / "routing", work / f"placement-{tag}", work / f"eval-{tag}",
                           batch_size=batch, policy=policy, figures=True)
    m = Artifact(work / f"eval-{tag}").metrics
    p = Artifact(work / f"placement-{tag}")
    return {"policy": policy, "decoders": decoders, "ep_size": ep_size, "batch_size": batch,
            "redundant_experts": redundant,
            "mean_max_active_per_rank": m["mean_max_active_per_rank"], "mean_lower_bound": m["mean_lower_bound"],
            "gap_to_lower_bound": m["gap_to_lower_bound"], "per_decoder_vs_contiguous": m["per_decoder_vs_contiguous"],
            "per_decoder_vs_global_eplb": m["per_decoder_vs_global_eplb"], "n_batch_steps": m["n_batch_steps"],
            "mean_batch_size": m["mean_batch_size"], "mean_active_experts": m["mean_active_experts"],
            "trace_source": m["trace_source"], "place_s": p.metrics["place_s"],
            "figure": str(work / f"eval-{tag}" / "placement_eval.png")}


def bench_generated(work: Path, quick: bool) -> list[dict]:
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.synth import synthetic_trace

    out = []
    configs = [
        # name, synth kwargs
        ("synth-default",  # half the layers domain-specific
         dict(n_requests=800, num_layers=16, num_experts=128, top_k=8, n_domains=8, decode_steps=48)),
        ("synth-strong",  # every layer domain-specific, sparse preferences
         dict(n_requests=800, num_layers=16, num_experts=128, top_k=8, n_domains=8, decode_steps=48,
              informative_layers=list(range(16)), concentration=0.1, request_noise=0.3)),
    ]
    if quick:
        configs = configs[:1]
    for i, (name, kw) in enumerate(configs):
        d = work / f"gen{i}"
        d.mkdir(parents=True, exist_ok=True)
        write_trace(d / "trace", synthetic_trace(**kw, with_picks=True, with_gates=False, seed=i))
        for R, B, red, pol in ((4, 8, 0, "eldr"), (4, 8, 4, "eldr"), (8, 8, 0, "eldr"), (4, 32, 0, "eldr"),
                               (4, 8, 0, "round-robin")):
            if quick and (R, B, red, pol) != (4, 8, 0, "eldr"):
                continue
            r = _evaluate(d / "trace", d, decoders=8, ep_size=R, batch=B, pairs=5000, redundant=red, policy=pol)
            r.update({"trace": f"GENERATED {name}", "L": kw["num_layers"], "E": kw["num_experts"],
                      "top_k": kw["top_k"], "n_requests": kw["n_requests"]})
            out.append(r)
    return out


def bench_tiny(work: Path, trace: Path | None = None) -> dict:
    """Capture a trace from the tiny MoE with `eldr capture` (if that command exists) and evaluate it;
    ``trace`` reuses an earlier capture instead."""
    if trace is not None:
        return _evaluate_tiny(trace, work)
    help_txt = subprocess.run([str(ROOT / ".venv/bin/eldr"), "--help"], capture_output=True, text=True).stdout
    if "capture" not in help_txt.replace("│", " ").split():
        return {"skipped": "`eldr capture` is not available in this checkout"}
    from eldr_cli.checkpoints.tiny import build_tiny_moe

    model = build_tiny_moe(work / "tiny-model", "qwen3_moe")
    prompts = prompts_file("task")
    cmd = [str(ROOT / ".venv/bin/eldr"), "capture", "--model", str(model), "--prompts", str(prompts),
           "--out", str(work / "tiny-trace")]
    extra = os.environ.get("BENCH_PLACE_CAPTURE_ARGS", "--sample 120 --max-new-tokens 32 --no-progress").split()
    p = subprocess.run(cmd + extra, capture_output=True, text=True)
    if p.returncode != 0:
        return {"skipped": f"`eldr capture` failed: {p.stderr.strip()[-400:]}"}
    r = _evaluate_tiny(work / "tiny-trace", work)
    r["capture_command"] = " ".join(["eldr", *cmd[1:], *extra])
    return r


def _evaluate_tiny(trace: Path, work: Path) -> dict:
    from eldr_cli.artifacts.trace import read_trace

    t = read_trace(trace, with_picks=True)
    if t.decode_picks is None:
        return {"skipped": "captured trace has no per-step decode picks"}
    E = t.num_experts
    R = 4 if E % 4 == 0 else 2
    (work / "tiny").mkdir(parents=True, exist_ok=True)
    r = _evaluate(trace, work / "tiny", decoders=4, ep_size=R, batch=8, pairs=5000)
    r.update({"trace": f"captured tiny random-weight {t.model.get('family', 'qwen3_moe')}",
              "trace_path": str(trace),
              "L": t.num_layers, "E": E, "top_k": t.top_k, "n_requests": t.n_requests})
    return r


def main(argv=None):
    ap = parser(__doc__, "bench-results/place.json")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="one generated configuration only")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny-model capture")
    ap.add_argument("--tiny-trace", type=Path, help="reuse a trace captured from the tiny model")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args(argv)
    env = environment()
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=max(180, shutil.get_terminal_size().columns))
    work = Path(tempfile.mkdtemp(prefix="bench-place-"))
    res = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                       "cpus": os.cpu_count()}}
    con.print("[bold]bench-place[/]: placement speed (generated calibration counts)")
    sp = res["speed"] = bench_speed(a.repeats)
    t = Table(title=f"placement time, K={sp['K']} L={sp['L']} E={sp['E']} R={sp['R']} (median of {a.repeats})")
    t.add_column("what")
    t.add_column("median s", justify="right")
    t.add_row("per-decoder placement (estimate + greedy), PerDecoderPlacement.fit",
              f"{sp['per_decoder_fit_median_s']:.4f}")
    t.add_row("  greedy core only (K*L balanced packings)", f"{sp['greedy_core_median_s']:.4f}")
    t.add_row("global EPLB (+R replicas)", f"{sp['global_eplb_fit_median_s']:.4f}")
    if "peer_median_s" in sp:
        t.add_row("peer: vLLM DefaultEplbPolicy, same K*L packings", f"{sp['peer_median_s']:.4f}")
        t.add_row("ratio peer / ours (greedy core)", f"{sp['ratio_peer_over_ours_core']:.1f}x")
        t.add_row("heaviest rank, ours / peer (expected activation)", f"{sp['heaviest_rank_ours_over_peer']:.4f}")
    con.print(t)

    rows = bench_generated(work / "generated", a.quick)
    if not a.no_tiny:
        tiny = bench_tiny(work / "tiny", a.tiny_trace)
        if "skipped" in tiny:
            con.print(f"[yellow]tiny-model trace skipped:[/] {tiny['skipped']}")
            res["tiny_model"] = tiny
        else:
            rows.append(tiny)
    res["replay"] = rows
    t = Table(title="max activated experts per EP rank per decode step (mean over steps x layers), replay of the "
                    "evaluation split through the routing policy")
    for c in ("trace", "routing", "R", "B", "repl.", "contiguous", "global EPLB", "per-decoder", "ceil(act/R)",
              "per-dec gap to bound", "per-dec vs contig", "per-dec vs EPLB"):
        t.add_column(c, justify="left" if c == "trace" else "right", no_wrap=c == "trace")
    for r in rows:
        mm = r["mean_max_active_per_rank"]
        t.add_row(r["trace"], r["policy"], str(r["ep_size"]), str(r["batch_size"]), str(r["redundant_experts"]),
                  f"{mm['contiguous']:.3f}", f"{mm['global_eplb']:.3f}", f"{mm['per_decoder']:.3f}",
                  f"{r['mean_lower_bound']:.3f}", f"{100 * r['gap_to_lower_bound']['per_decoder']:+.1f}%",
                  f"{100 * r['per_decoder_vs_contiguous']:+.1f}%", f"{100 * r['per_decoder_vs_global_eplb']:+.1f}%")
    con.print(t)
    con.print("GENERATED = eldr_cli.synth traces (synth-default: half the layers domain-specific; synth-strong: "
              "every layer, sparse preferences); L=16, E=128, top-8, 800 requests, K=8 decoders; repl. = EPLB "
              "redundant slots (scored with METRO's greedy replica choice)")
    res["note"] = ("speed: generated calibration counts; replay rows marked GENERATED come from eldr_cli.synth, "
                   "not from a model. Replicated EPLB (repl. > 0) is scored with METRO's greedy replica choice.")
    out = write_result(a.out, res, env)
    con.print(f"results written to {out}")
    if not a.keep:
        figs = out.parent / "place-figures"
        figs.mkdir(exist_ok=True)
        for r in rows:
            src = Path(r["figure"])
            if src.exists():
                dst = figs / f"{src.parent.parent.name}-{src.parent.name}.png"
                shutil.copy(src, dst)
                r["figure"] = str(dst)
        write_result(out, res, env)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
