"""make bench-model-quality: issue 11's quality bar on the trained tiny MoE against random weights.

For each model (the trained default of ``eldr model tiny --train``, cached; a random-weight model of
the same shape) and each prompt set (held-out task + language prompts; task prompts alone):

1. ``eldr capture`` of N held-out prompts (seeded sample; calibration/evaluation split), 32 decode steps;
2. prefill/decode per-expert correlation per layer (the capture manifest's metric);
3. ``eldr fit --decoders 8``: signature quality rho (``rho_peak`` of the layers stage);
4. replay of the evaluation requests through the routing policies (batch 16 per decoder, K=8,
   :func:`eldr_cli.pipeline.evaluate.replay_batches`): mean distinct active experts per decoder
   batch (sum over layers), and summed over the decoders per fully loaded step, vs round-robin.

Figures are MEASURED on captured traces of a CPU model; wall and CPU times are printed with the load
average. Writes ``bench-results/model_quality.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.base import ROOT, environment, parser, write_result
from eldr_cli.checkpoints.train import DEFAULT_STEPS, split_of
from eldr_cli.data import prompts_file

BAR = {"corr": 0.7, "rho": 0.5, "active_pct": -8.0}


def heldout_file(path: Path, sets: tuple[str, ...]) -> Path:
    with open(path, "w", encoding="utf-8") as out:
        for s in sets:
            for line in prompts_file(s).open(encoding="utf-8"):
                if line.strip() and split_of(str(json.loads(line)["id"])) == "heldout":
                    out.write(line if line.endswith("\n") else line + "\n")
    return path


def replay(trace_dir: Path, fit_dir: Path, K: int = 8, B: int = 16) -> dict:
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.pipeline.evaluate import replay_batches
    from eldr_cli.routing import RoutingModel, make_router

    tr = read_trace(trace_dir, with_picks=True)
    rm = RoutingModel.load(fit_dir / "routing")
    rows = np.flatnonzero(tr.split_mask("evaluation"))
    picks = np.asarray(tr.decode_picks, dtype=np.int64)
    offs = np.asarray(tr.decode_offsets)
    L, E = tr.num_layers, tr.num_experts
    S = picks.shape[0]
    flat = np.zeros((S, L * E), dtype=bool)
    for layer in range(L):
        for j in range(picks.shape[2]):
            ok = (picks[:, layer, j] >= 0) & (picks[:, layer, j] < E)
            flat[np.arange(S)[ok], layer * E + picks[ok, layer, j]] = True
    domains = tr.column("domain")
    res = {}
    for name in ("round-robin", "random", "eldr"):
        rec = replay_batches(tr, rows, make_router(name, K, model=rm, seed=0), K, B, domains=domains)
        key = rec["step"] * K + rec["decoder"]
        order = np.argsort(key, kind="stable")
        ks, starts = np.unique(key[order], return_index=True)
        act = np.logical_or.reduceat(flat[(offs[rec["request"]] + rec["request_step"])[order]], starts, axis=0).sum(1)
        sizes = np.diff(np.append(starts, len(order)))
        cluster = np.bincount(ks // K, weights=act)
        inflight = np.bincount(ks // K, weights=sizes)
        res[name] = {"per_batch": float(act.mean()), "cluster": float(cluster[inflight >= inflight.max()].mean())}
    for m in ("per_batch", "cluster"):
        rr = res["round-robin"][m]
        for v in res.values():
            v[m + "_pct_vs_rr"] = 100 * (v[m] - rr) / rr
    return res


def measure(model: Path, prompts: Path, out: Path, sample: int, eval_fraction: float) -> dict:
    from eldr_cli.pipeline.capture import run_capture
    from eldr_cli.pipeline.fit import run_fit

    t, c = time.perf_counter(), time.process_time()
    cap = run_capture(model, prompts, out / "trace", max_new_tokens=32, batch_size=16, sample=sample, seed=0,
                      eval_fraction=eval_fraction, progress=False, exclude_training=False)
    cap_s = (time.perf_counter() - t, time.process_time() - c)
    run_fit(cap.out, out / "fit", decoders=8, pairs=5000, figures=False)
    fm = json.loads((out / "fit" / "manifest.json").read_text())["metrics"]
    return {"corr_per_layer": cap.metrics.get("prefill_decode_corr_per_layer"),
            "n_calibration": cap.metrics.get("n_calibration"), "n_evaluation": cap.metrics.get("n_evaluation"),
            "rho": fm["rho_peak"], "replay": replay(out / "trace", out / "fit"),
            "capture_wall_s": round(cap_s[0], 1), "capture_cpu_s": round(cap_s[1], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "bench-results/model_quality.json")
    ap.add_argument("--work", default=str(ROOT / "artifacts" / "bench-model-quality"))
    ap.add_argument("--model", default=None, help="a trained checkpoint (default: train the default, cached)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--sample", type=int, default=500)
    ap.add_argument("--eval-fraction", type=float, default=0.38)
    ap.add_argument("--sets", default="task+language,task")
    a = ap.parse_args(argv)
    env = environment()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    from eldr_cli.checkpoints.tiny import build_tiny_moe
    from eldr_cli.checkpoints.train import train_tiny_moe

    t, c = time.perf_counter(), time.process_time()
    trained = Path(a.model) if a.model else train_tiny_moe(work / f"trained-{a.steps}", steps=a.steps)
    train_s = (round(time.perf_counter() - t, 1), round(time.process_time() - c, 1))
    cfg = json.loads((trained / "eldr_train.json").read_text())  # the training config
    random_dir = work / "random"
    if not (random_dir / "config.json").exists():
        build_tiny_moe(random_dir, num_layers=cfg["num_layers"], num_experts=cfg["num_experts"],
                       top_k=cfg["top_k"], hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], seed=0)
    log = json.loads((trained / "train_log.json").read_text()) if (trained / "train_log.json").is_file() else {}
    results = {"load_avg_start": os.getloadavg(), "train_call_s": train_s,
               "train_log": {k: log.get(k) for k in ("tokens_seen", "wall_s", "cpu_s", "tokens_per_s",
                                                     "load_avg_1m", "threads")},
               "final_loss": float(np.mean(log["loss"][-10:])) if log.get("loss") else None, "rows": []}
    for sets in a.sets.split(","):
        pf = heldout_file(work / f"heldout-{sets}.jsonl", tuple(sets.split("+")))
        for name, model in (("trained", trained), ("random", random_dir)):
            d = work / f"{name}-{sets}"
            if d.exists():
                import shutil

                shutil.rmtree(d)
            r = measure(model, pf, d, a.sample, a.eval_fraction)
            r.update(model=name, prompts=sets, load_avg=os.getloadavg())
            results["rows"].append(r)
    print(f"trained: {results['train_log']}, final loss {results['final_loss']}")
    print("MEASURED (captured traces; replay batch 16, K=8, evaluation split)")
    print(f"{'model':8} {'prompts':14} {'min corr':>8} {'rho':>6} {'ELDR/RR':>8} {'cluster':>8} {'load':>5}")
    for r in results["rows"]:
        corr = min(x for x in r["corr_per_layer"] if x is not None)
        e = r["replay"]["eldr"]
        print(f"{r['model']:8} {r['prompts']:14} {corr:8.3f} {r['rho']:6.3f} {e['per_batch_pct_vs_rr']:+7.1f}% "
              f"{e['cluster_pct_vs_rr']:+7.1f}% {r['load_avg'][0]:5.1f}")
    print(f"bar: corr >= {BAR['corr']} every layer, rho >= {BAR['rho']}, ELDR/RR <= {BAR['active_pct']}%")
    print(f"-> {write_result(a.out, results, env)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
