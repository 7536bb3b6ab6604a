"""make bench-fit: the offline fit's speed, exact balanced clustering at scale, the peer
(k-means-constrained) side by side, and one routing decision. Prints a table, writes JSON.

All inputs are GENERATED (eldr_cli.synth / clustered Gaussian signatures): these are timings,
not quality claims.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.base import ROOT, environment, order, paired_interval, parser, tree_at, write_result

# the console script of the checkout's .venv, else the one beside this interpreter (a shared venv)
# every subcommand's --help is timed (target <= 0.3 s each)
HELP_COMMANDS = [(), ("inspect",), ("synth-trace",), ("fit-idf",), ("select-layers",), ("cluster",), ("fit",),
                 ("serve-proxy",), ("emulate",), ("capture",), ("model",), ("model", "tiny"), ("place-experts",),
                 ("place-experts", "evaluate"), ("bench",), ("bench", "serve"), ("bench", "sweep"),
                 ("bench", "simulate"), ("bench", "moe-layer"), ("bench", "cost-model"), ("bench", "show"),
                 ("report",)]
# issue 35's budget: `eldr fit` at this size not slower than the tree before issue 35 (its parent commit)
BEFORE_ISSUE_35 = "a7786f8"
ELDR = ROOT / ".venv/bin/eldr" if (ROOT / ".venv/bin/eldr").exists() else Path(sys.executable).with_name("eldr")


def _clustered(n, d, k, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(k, d)).astype(dtype)
    sizes = rng.dirichlet(np.full(k, 2.0)) * n  # skewed cluster sizes
    lab = np.minimum(np.searchsorted(np.cumsum(sizes), np.arange(n) + 0.5), k - 1)
    X = np.empty((n, d), dtype=dtype)
    for a in range(0, n, 8192):  # in chunks, so generating the data does not dominate peak memory
        b = min(n, a + 8192)
        X[a:b] = centers[lab[a:b]] + 1.5 * rng.standard_normal(size=(b - a, d), dtype=np.float32)
        X[a:b] /= np.linalg.norm(X[a:b], axis=1, keepdims=True)
    return X


def _fit_once(trace: Path, out: Path, tree: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one whole `eldr fit` with ``PYTHONPATH=tree`` (that tree's eldr_cli, whichever
    checkout a shared venv's console script was installed from)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([str(ELDR), "fit", "--trace", str(trace), "--decoders", "16", "--out", str(out)],
                   check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime


def _command_runs(trace: Path, tmp: Path, rounds: int, before: Path | None) -> dict:
    """``rounds`` runs of this tree's `eldr fit` (with their phases) and, with a ``before`` tree, as many of
    its, alternating (before, after / after, before) so drift in the machine's load falls on both."""
    arms = ["before", "after"] if before is not None else ["after"]
    out: dict = {arm: {"wall_s": [], "cpu_s": []} for arm in arms}
    out["phases"] = []
    for r in range(rounds):
        for arm in order(arms, r):
            dst = tmp / f"cmd-{arm}{r}"
            wall, cpu = _fit_once(trace, dst, before if arm == "before" else ROOT)
            out[arm]["wall_s"].append(wall)
            out[arm]["cpu_s"].append(cpu)
            if arm == "after":
                out["phases"].append(_phases(dst, wall))
    return out


def _phases(fit: Path, wall: float) -> dict[str, float]:
    ph = json.loads((fit / "manifest.json").read_text())["metrics"]["phase_s"]
    for sub, key in (("layers", "select_layers"), ("routing", "cluster")):
        fig = json.loads((fit / sub / "manifest.json").read_text())["metrics"].get("figures_s", 0.0)
        ph[key] -= fig
        ph[f"{key}_figures"] = fig
    ph["start-up + exit"] = wall - sum(ph.values())
    return ph


def _paired(runs: dict, rev: str) -> dict:
    """after - before per round (wall and CPU) with its 95% t-interval; MEASURED."""
    res: dict = {"before_rev": rev, "rounds": len(runs["after"]["wall_s"]), "label": "MEASURED",
                 "runs": {arm: runs[arm] for arm in ("before", "after")}}
    for key in ("wall_s", "cpu_s"):
        a, b = runs["after"][key], runs["before"][key]
        res[key] = {"before_median": statistics.median(b), "after_median": statistics.median(a),
                    "after_minus_before": paired_interval(a, b)}
    return res


def bench_fit_small(repeats: int, paired_rounds: int = 0, before_rev: str = BEFORE_ISSUE_35):
    """eldr fit on N=1000, L=48, E=128, K=16, 20k pairs, all transforms; with ``paired_rounds``, the whole
    command paired with the tree at ``before_rev``."""
    from eldr_cli.artifacts.trace import write_trace
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.synth import synthetic_trace

    tmp = Path(tempfile.mkdtemp(prefix="bench-fit-"))
    before, skipped = None, "--paired-rounds 0"
    if paired_rounds:
        try:
            before = tree_at(before_rev, tmp / "before")
        except subprocess.CalledProcessError as e:  # not a git checkout, or the commit is not in it
            skipped = f"no tree at {before_rev}: {(e.stderr or b'').decode(errors='replace').strip()[:200]}"
    trace = tmp / "trace"
    write_trace(trace, synthetic_trace(1250, 48, 128, 8, seed=0))  # 80% calibration split = 1000
    fit_s, stage_s = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        run_fit(trace, tmp / f"fit{i}", decoders=16, pairs=20000, figures=False)
        stage_s.append(time.perf_counter() - t0)
        fit_s.append(json.loads((tmp / f"fit{i}" / "manifest.json").read_text())["metrics"]["fit_s"])
    # the whole command, start-up and figures included, split by phase (the fit manifest's phase_s;
    # "start-up + exit" = wall - the phases: interpreter, imports, argument parsing, exit); with a
    # "before" tree, each round also runs its `eldr fit` (order alternating) for the paired difference
    cmd_runs = _command_runs(trace, tmp, max(3, repeats, paired_rounds), before)
    cmd_s, cmd_cpu_s = cmd_runs["after"]["wall_s"], cmd_runs["after"]["cpu_s"]
    phases = cmd_runs["phases"]
    help_s, help_cpu_s, help_failed = {}, {}, {}
    for sub in HELP_COMMANDS:
        runs, cpus = [], []
        for _ in range(3):
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            r = subprocess.run([str(ELDR), *sub, "--help"], capture_output=True, text=True)
            runs.append(time.perf_counter() - t0)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
        if r.returncode != 0:  # reported, not timed
            help_failed[" ".join(sub)] = f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1][:120]}"
            continue
        help_s[" ".join(sub) or "(top level)"] = statistics.median(runs)
        help_cpu_s[" ".join(sub) or "(top level)"] = statistics.median(cpus)
    lay = json.loads((tmp / "fit0" / "layers" / "manifest.json").read_text())["metrics"]
    rt = json.loads((tmp / "fit0" / "routing" / "manifest.json").read_text())["metrics"]
    return {
        "paired": _paired(cmd_runs, before_rev) if before is not None else {"skipped": skipped},
        "n_signatures": 1000, "L": 48, "E": 128, "K": 16, "pairs": 20000,
        "fit_median_s": statistics.median(stage_s), "fit_runs_s": stage_s,
        "fit_compute_median_s": statistics.median(fit_s),
        "command_median_s": statistics.median(cmd_s), "command_runs_s": cmd_s, "command_cpu_s": cmd_cpu_s,
        "command_phase_median_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "help_median_s": help_s, "help_cpu_median_s": help_cpu_s, "help_failed": help_failed,
        "startup_help_median_s": help_s["(top level)"],
        "rho_by_transform": lay["rho_by_transform"], "n_layers_kept": lay["n_layers_kept"],
        "cluster_sizes": rt["cluster_sizes"],
        "note": "generated trace; fit_median_s = run_fit in-process without figures (reading the trace, "
                "three stages, atomic artifact writes); command = `eldr fit` with figures, start-up included",
    }


def phase_table(f):
    from rich.table import Table

    t = Table(title=f"whole `eldr fit` command by phase (median of {len(f['command_runs_s'])}, generated trace)")
    t.add_column("phase")
    t.add_column("s", justify="right")
    for k, v in f["command_phase_median_s"].items():
        t.add_row(k, f"{v:.2f}")
    t.add_row("[bold]whole command (wall, median)[/]", f"{f['command_median_s']:.2f}")
    t.add_row("  min / CPU of the median run", f"{min(f['command_runs_s']):.2f} / "
              f"{sorted(f['command_cpu_s'])[len(f['command_cpu_s']) // 2]:.2f}")
    slow = {k: v for k, v in f["help_median_s"].items() if v > 0.3}
    t.add_row(f"--help, {len(f['help_median_s'])} commands: max wall / max CPU",
              f"{max(f['help_median_s'].values()):.2f} / {max(f['help_cpu_median_s'].values()):.2f}")
    t.add_row("  over 0.3 s", ", ".join(slow) or "none")
    if f.get("help_failed"):
        t.add_row("  --help failed", ", ".join(f["help_failed"]))
    return t


def paired_table(f):
    """The whole command against the tree before issue 35 (its budget: not slower), or why it was skipped."""
    from rich.table import Table

    p = f["paired"]
    if "skipped" in p:
        return f"paired run skipped: {p['skipped']}"
    t = Table(title=f"`eldr fit` paired with {p['before_rev']} (the tree before issue 35), {p['rounds']} rounds, "
                    "order alternating; MEASURED")
    for c in ("", "before median", "this tree median", "this - before, mean [95% CI]", "verdict"):
        t.add_column(c)
    for key, name in (("wall_s", "wall s"), ("cpu_s", "CPU s")):
        x = p[key]
        d = x["after_minus_before"]
        t.add_row(name, f"{x['before_median']:.2f}", f"{x['after_median']:.2f}",
                  f"{d['mean']:+.2f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]", d["verdict"])
    return t


def _child_large(n, d, k, max_iter, seed, out):
    from eldr_cli.method.cluster import BalancedKMeans

    X = _clustered(n, d, k, seed, dtype=np.float32)
    rss_data = _vm_hwm_mib()
    t0 = time.perf_counter()
    km = BalancedKMeans(k, max_iter=max_iter, seed=seed).fit(X)
    wall = time.perf_counter() - t0
    peak = _vm_hwm_mib()
    Path(out).write_text(json.dumps({
        "N": n, "d": d, "K": k, "wall_s": wall, "n_iter": km.n_iter_, "max_iter": max_iter,
        "objective": km.objective_, "max_size": int(km.sizes_.max()), "capacity": km.capacity_,
        "peak_rss_mib": peak, "rss_after_data_mib": rss_data, "input_mib": X.nbytes / 2**20}))


def _vm_hwm_mib() -> float:
    """Peak resident set of this process (VmHWM; unlike ru_maxrss it does not carry the parent's
    pre-exec peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def bench_cluster_large(n, d, k, max_iter):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, __file__, "--child-large", str(n), str(d), str(k), str(max_iter), out],
                   check=True)
    return json.loads(Path(out).read_text())


def bench_peer(n, k, d, iters, seed=0):
    """Ours vs k-means-constrained (size_max = ceil(N/K)) on the same data and iteration count."""
    from k_means_constrained import KMeansConstrained

    from eldr_cli.method.cluster import BalancedKMeans

    X = _clustered(n, d, k, seed)
    cap = math.ceil(n / k)
    rng = np.random.default_rng(seed)
    init = X[rng.choice(n, size=k, replace=False)]

    def cos_obj(labels):
        C = np.zeros((k, d))
        np.add.at(C, labels, X)
        C /= np.maximum(np.linalg.norm(C, axis=1, keepdims=True), 1e-12)
        return float((1 - (X * C[labels]).sum(axis=1)).sum())

    t0 = time.perf_counter()
    ours = BalancedKMeans(k, max_iter=iters, tol=0.0, seed=seed).fit(X, init=init.copy())
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    peer = KMeansConstrained(n_clusters=k, size_max=cap, init=init.copy(), n_init=1, max_iter=iters, tol=0.0,
                             random_state=seed, n_jobs=1).fit(X)
    peer_s = time.perf_counter() - t0
    return {
        "N": n, "K": k, "d": d, "iterations": iters, "ours_s": ours_s, "peer_s": peer_s,
        "speedup": peer_s / ours_s, "ours_iterations_run": ours.n_iter_,
        "ours_objective": cos_obj(ours.labels_), "peer_objective": cos_obj(peer.labels_),
        "ours_max_size": int(ours.sizes_.max()), "peer_max_size": int(np.bincount(peer.labels_).max()),
        "capacity": cap,
        "note": "same data, same initial centroids, same max_iter, tol=0; objective = total cosine distance of "
                "each point to its cluster's normalized mean (peer minimizes Euclidean distance to the raw "
                "mean on the same unit vectors)",
    }


def bench_decision(k=16, d=20 * 128, n=20000):
    from eldr_cli.routing import RoutingModel, make_router
    from eldr_cli.routing.policies import locality_band

    rng = np.random.default_rng(0)
    C = rng.random((k, d))
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    S = rng.random((512, d))
    S /= np.linalg.norm(S, axis=1, keepdims=True)
    loads = rng.integers(0, 8, size=k)
    times = []
    for i in range(n):
        s = S[i % 512]
        t0 = time.perf_counter_ns()
        locality_band(s, C, loads, 0.1)
        times.append(time.perf_counter_ns() - t0)
    # from handed-off counts [L, E] (transform, IDF, mask, normalize) to the decision
    L, E = 48, 128
    mask = np.sort(rng.choice(L, size=20, replace=False))
    m = make_router("eldr", k, model=RoutingModel("count-idf", rng.random((L, E)), mask, C, tau=0.1))
    counts = rng.integers(0, 20, size=(64, L, E))
    full = []
    for i in range(n // 4):
        t0 = time.perf_counter_ns()
        m.decide(counts[i % 64], loads)
        full.append(time.perf_counter_ns() - t0)
    return {"K": k, "d": d, "decision_median_us": statistics.median(times) / 1e3,
            "decision_p99_us": float(np.percentile(times, 99)) / 1e3,
            "counts_to_decision_median_us": statistics.median(full) / 1e3,
            "counts_to_decision_p99_us": float(np.percentile(full, 99)) / 1e3}


def main(argv=None):
    ap = parser(__doc__, "bench-results/fit.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--large-n", type=int, default=100_000)
    ap.add_argument("--large-iter", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--paired-rounds", type=int, default=8,
                    help="rounds of `eldr fit` alternated with the --before tree (0: none)")
    ap.add_argument("--before", default=BEFORE_ISSUE_35,
                    help="commit of the paired run's before arm (default: the tree before issue 35)")
    ap.add_argument("--only-fit", action="store_true", help="only the fit command and --help timings")
    ap.add_argument("--child-large", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_large:
        n, d, k, it, out = a.child_large
        _child_large(int(n), int(d), int(k), int(it), 0, out)
        return 0
    env = environment()
    from rich.console import Console
    from rich.table import Table

    con = Console()
    res = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    con.print("[bold]bench-fit[/] (generated data)")
    res["machine"]["loadavg_start"] = os.getloadavg()
    res["fit"] = bench_fit_small(2 if a.quick else a.repeats, min(a.paired_rounds, 2) if a.quick else a.paired_rounds,
                                 a.before)
    res["machine"]["loadavg_after_fit"] = os.getloadavg()
    con.print(phase_table(res["fit"]))
    con.print(paired_table(res["fit"]))
    if a.only_fit:
        con.print(f"figures written to {write_result(a.out, res, env)}")
        return 0
    res["decision"] = bench_decision()
    res["peer"] = bench_peer(2000 if a.quick else 10_000, 16, 256 if a.quick else 20 * 128, 10)
    res["cluster_large"] = bench_cluster_large(5000 if a.quick else a.large_n, 48 * 128, 64, a.large_iter)

    t = Table(title="bench-fit (generated data)")
    for c in ("measure", "value", "target", "ok"):
        t.add_column(c)
    f, p, L, dcs = res["fit"], res["peer"], res["cluster_large"], res["decision"]
    rows = [
        ("eldr fit, N=1000 L=48 E=128 K=16, median (in-process)", f"{f['fit_median_s']:.2f} s", "<= 2 s",
         f["fit_median_s"] <= 2),
        ("  whole `eldr fit` command incl. start-up + figures", f"{f['command_median_s']:.2f} s", "<= 3 s",
         f["command_median_s"] <= 3),
        ("  `eldr --help` start-up", f"{f['startup_help_median_s']:.2f} s", "<= 0.3 s",
         f["startup_help_median_s"] <= 0.3),
        (f"exact balanced K-means N={L['N']:,} d={L['d']} K={L['K']}", f"{L['wall_s']:.1f} s ({L['n_iter']} it)",
         "<= 120 s", L["wall_s"] <= 120),
        ("  peak RSS (signatures alone: %.0f MiB)" % L["input_mib"], f"{L['peak_rss_mib']:.0f} MiB", "", None),
        (f"ours vs k-means-constrained N={p['N']:,} K=16, {p['iterations']} it", f"{p['ours_s']:.2f} s vs "
         f"{p['peer_s']:.2f} s = {p['speedup']:.1f}x", "faster", p["speedup"] > 1),
        ("  cosine objective ours / peer", f"{p['ours_objective']:.2f} / {p['peer_objective']:.2f}", "<=",
         p["ours_objective"] <= p["peer_objective"] + 1e-6),
        ("routing decision K=16 d=2560, median", f"{dcs['decision_median_us']:.1f} us", "<= 20 us",
         dcs["decision_median_us"] <= 20),
        ("  counts [48,128] -> signature -> decision, median", f"{dcs['counts_to_decision_median_us']:.1f} us",
         "", None),
    ]
    for name, val, tgt, ok in rows:
        t.add_row(name, val, tgt, "" if ok is None else ("[green]yes[/]" if ok else "[red]no[/]"))
    con.print(t)
    con.print(f"figures written to {write_result(a.out, res, env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
