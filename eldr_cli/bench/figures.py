"""Bench figures: Fig. 11 (TPOT/TTFT vs rate per router), Fig. 13 (active experts per decode step vs batch
size per router). Emulated and simulated results say so in the title. Fig. 2 (one MoE layer's cost, drawn
by ``bench moe-layer`` in the cost model below this package) is in :mod:`eldr_cli.plots`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli import plots

MODE_LABEL = {"real": "measured (real engine)", "emulated": "EMULATED cluster (cost model)",
              "simulated": "SIMULATED (discrete-event, cost model)"}


def sweep_figure(path: Path, runs: list[dict], mode: str, title: str = "") -> Path:
    """Fig. 11: median TPOT, p99 TPOT and median TTFT against request rate, one line per router."""
    plt = plots.plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    routers = list(dict.fromkeys(r["router"] for r in runs))
    for key, ax, lab in (("median_tpot_ms", axes[0], "TPOT median (ms)"), ("p99_tpot_ms", axes[1], "TPOT p99 (ms)"),
                         ("median_ttft_ms", axes[2], "TTFT median (ms)")):
        for name in routers:
            pts = sorted((r["request_rate"], r.get(key)) for r in runs
                         if r["router"] == name and r.get(key) is not None)
            if not pts:
                continue
            x, y = np.array(pts, dtype=float).T
            ax.plot(x, y, marker="o", ms=3, lw=1.4 if name == "eldr" else 0.9, label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(lab)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title + ' -- ' if title else ''}{MODE_LABEL.get(mode, mode)}", fontsize=9)
    return plots.save(fig, path)


def active_experts_figure(path: Path, steps: dict[str, tuple[np.ndarray, np.ndarray]], mode: str,
                          n_layers: int, num_experts: int, title: str = "") -> Path:
    """Fig. 13: mean distinct active experts per layer per decode step against batch size, per router.

    ``steps[router] = (batch [S], active_total [S])``; active per layer = active_total / n_layers.
    """
    plt = plots.plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, (batch, active) in steps.items():
        if len(batch) == 0:
            continue
        batch = np.asarray(batch)
        per_layer = np.asarray(active, dtype=float) / n_layers
        edges = np.unique(np.round(np.geomspace(1, max(2, batch.max() + 1), 14)).astype(int))
        xs, ys = [], []
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            m = (batch >= lo) & (batch < hi)
            if m.sum() >= 3:
                xs.append(batch[m].mean())
                ys.append(per_layer[m].mean())
        ax.plot(xs, ys, marker="o", ms=3, lw=1.4 if name == "eldr" else 0.9, label=name)
    ax.axhline(num_experts, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("decode batch size (running requests)")
    ax.set_ylabel("distinct active experts per layer per step")
    ax.set_title(f"{title + ' -- ' if title else ''}{MODE_LABEL.get(mode, mode)}", fontsize=9)
    ax.legend(fontsize=7)
    return plots.save(fig, path)
