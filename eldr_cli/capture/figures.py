"""Capture figures (paper Fig. 1 and Fig. 3) from streamed aggregates, plus the correlation metric."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Aggregates:
    """Running sums over requests (bounded memory: O(D L E)). L MoE layers, E experts, k top-k."""

    def __init__(self, L: int, E: int, k: int):
        self.L, self.E, self.k = L, E, k
        self.domain_prefill: dict[str, np.ndarray] = {}
        self.domain_tokens: dict[str, int] = {}
        self.prefill = np.zeros((L, E), dtype=np.float64)
        self.decode = np.zeros((L, E), dtype=np.float64)
        self.prompt_tokens = 0
        self.decode_steps = 0

    def update(self, prefill_counts, decode_counts, prompt_tokens, decode_steps, domains) -> None:
        self.prefill += prefill_counts.sum(0)
        self.decode += decode_counts.sum(0)
        self.prompt_tokens += int(prompt_tokens.sum())
        self.decode_steps += int(decode_steps.sum())
        for d in sorted(set(domains)):
            m = np.asarray(domains) == d
            self.domain_prefill.setdefault(d, np.zeros((self.L, self.E)))
            self.domain_prefill[d] += prefill_counts[m].sum(0)
            self.domain_tokens[d] = self.domain_tokens.get(d, 0) + int(prompt_tokens[m].sum())

    def merge(self, other: "Aggregates") -> "Aggregates":
        """Add the sums of ``other`` (same layers and k; the narrower expert axis is padded with
        zeros). Counts are whole numbers, so the order of merging does not change a bit. -> self."""
        if (other.L, other.k) != (self.L, self.k):
            raise ValueError(f"cannot merge aggregates of L={other.L}, k={other.k} into L={self.L}, k={self.k}")
        self.widen(other.E)
        pad = self.E - other.E
        self.prefill += np.pad(other.prefill, ((0, 0), (0, pad)))
        self.decode += np.pad(other.decode, ((0, 0), (0, pad)))
        self.prompt_tokens += other.prompt_tokens
        self.decode_steps += other.decode_steps
        for d, v in other.domain_prefill.items():
            self.domain_prefill.setdefault(d, np.zeros((self.L, self.E)))
            self.domain_prefill[d] += np.pad(v, ((0, 0), (0, pad)))
            self.domain_tokens[d] = self.domain_tokens.get(d, 0) + other.domain_tokens[d]
        return self

    def widen(self, E: int) -> "Aggregates":
        """Pad the expert axis to ``E`` experts (the experts no request picked). -> self."""
        if E > self.E:
            pad = ((0, 0), (0, E - self.E))
            self.prefill, self.decode = np.pad(self.prefill, pad), np.pad(self.decode, pad)
            self.domain_prefill = {d: np.pad(v, pad) for d, v in self.domain_prefill.items()}
            self.E = E
        return self

    # -- Fig. 3 --------------------------------------------------------------------------------
    def prefill_share(self) -> np.ndarray:
        """[L, E] fraction of prompt tokens routed to e at l."""
        return self.prefill / max(self.prompt_tokens, 1)

    def decode_share(self) -> np.ndarray:
        """[L, E] fraction of decode steps in which l picked e."""
        return self.decode / max(self.decode_steps, 1)

    def prefill_decode_corr(self) -> np.ndarray:
        """[L] Pearson correlation over experts of prefill vs decode activation share (NaN if flat)."""
        p, d = self.prefill_share(), self.decode_share()
        out = np.full(self.L, np.nan)
        for l in range(self.L):
            if p[l].std() > 0 and d[l].std() > 0:
                out[l] = float(np.corrcoef(p[l], d[l])[0, 1])
        return out

    # -- Fig. 1 --------------------------------------------------------------------------------
    def domain_relative(self):
        """(domains, rel [D, L, E]) with rel = share_d / cross-domain mean share - 1."""
        doms = sorted(self.domain_prefill)
        share = np.stack([self.domain_prefill[d] / max(self.domain_tokens[d], 1) for d in doms])
        mean = share.mean(0, keepdims=True)
        rel = np.where(mean > 0, share / np.where(mean > 0, mean, 1) - 1.0, 0.0)
        return doms, rel, share

    def most_discriminative_layer(self) -> int:
        """Layer whose per-domain expert shares vary most across domains (relative to their mean)."""
        _, _, share = self.domain_relative()
        var = share.var(0).sum(-1) / np.maximum((share.mean(0) ** 2).sum(-1), 1e-12)
        return int(np.argmax(var))


def fig1_domain_heatmap(path: Path, agg: Aggregates, moe_layer_ids: list[int]) -> Path | None:
    from eldr_cli import plots

    doms, rel, _ = agg.domain_relative()
    if len(doms) < 2:
        return None
    l = agg.most_discriminative_layer()
    plt = plots.plt()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.12 * agg.E + 2), 0.45 * len(doms) + 1.6))
    v = float(np.abs(rel[:, l]).max()) or 1.0
    im = ax.imshow(rel[:, l] * 100, aspect="auto", cmap="RdBu_r", vmin=-v * 100, vmax=v * 100,
                   interpolation="nearest")
    ax.set_yticks(range(len(doms)), doms)
    ax.set_xlabel("expert")
    ax.set_title(f"Prefill expert activation per domain vs cross-domain mean, MoE layer {moe_layer_ids[l]} "
                 "(most discriminative)")
    fig.colorbar(im, ax=ax, label="% above / below cross-domain mean")
    return plots.save(fig, path)


def fig3_prefill_decode(path: Path, agg: Aggregates, moe_layer_ids: list[int]) -> Path:
    from eldr_cli import plots

    p, d, corr = agg.prefill_share(), agg.decode_share(), agg.prefill_decode_corr()
    plt = plots.plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    cmap = plt.get_cmap("viridis")
    if agg.L <= 12:  # one labelled series per layer
        for l in range(agg.L):
            ax.scatter(p[l], d[l], s=8, alpha=0.6, color=cmap(l / max(agg.L - 1, 1)),
                       label=f"L{moe_layer_ids[l]} r={corr[l]:.2f}")
    else:  # no legend: the same points and colours in one call, far cheaper to draw than L series
        colors = cmap(np.repeat(np.arange(agg.L) / max(agg.L - 1, 1), agg.E))
        ax.scatter(p.ravel(), d.ravel(), s=8, alpha=0.6, color=colors)
    hi = max(float(p.max()), float(d.max()), 1e-6) * 1.05
    ax.plot([0, hi], [0, hi], lw=0.8, color="grey", ls="--")
    ax.set_xlabel("prefill: share of prompt tokens routed to expert")
    ax.set_ylabel("decode: share of decode steps selecting expert")
    finite = corr[np.isfinite(corr)]
    mean = float(finite.mean()) if finite.size else float("nan")
    ax.set_title(f"Prefill vs decode per-expert activation (mean r over layers = {mean:.2f})")
    if agg.L <= 12:
        ax.legend(fontsize=6, markerscale=1.5)
    return plots.save(fig, path)
