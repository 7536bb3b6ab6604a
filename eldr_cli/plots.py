"""The paper's figures, written next to the artifacts that produce them (matplotlib, Agg)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

_LOCK = threading.Lock()  # the fit imports matplotlib in a background thread while it computes


def plt():
    """matplotlib.pyplot with the Agg backend and the figures' shared style (imported on first use)."""
    with _LOCK:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot

        pyplot.rcParams.update({"figure.dpi": 110, "savefig.bbox": "tight", "font.size": 9,
                                "svg.hashsalt": "eldr", "path.simplify": True})
    return pyplot


def save(fig, path: Path) -> Path:
    """Write the figure (no timestamp metadata, so reruns give the same bytes) and close it."""
    fig.savefig(path, metadata={"Software": None})
    import matplotlib.pyplot as pyplot

    pyplot.close(fig)
    return path


class Drawing:
    """Draws figures in forked processes while the caller goes on (``background=True``, on Linux), or
    each at once when it is submitted. The figures come out the same bytes either way. Use it as a
    context manager: leaving it waits for every figure and raises EldrError naming the first that
    failed; leaving it on an error stops them. The caller makes sure no other thread is importing
    at the time of a submit (a forked child would wait forever on that import's lock)."""

    def __init__(self, background: bool = True):
        import sys

        self.background = background and sys.platform.startswith("linux")
        self.jobs: list = []

    def submit(self, draw, path: Path, *args) -> None:
        """``draw(path, *args)``, the figure functions' signature."""
        if not self.background:
            draw(path, *args)
            return
        import multiprocessing as mp

        plt()  # import matplotlib here once, not in every child
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_draw_child, args=(send, draw, path, args), name=f"eldr-draw-{Path(path).name}",
                           daemon=True)
        proc.start()
        send.close()
        self.jobs.append((proc, recv, Path(path)))

    def wait(self) -> None:
        from eldr_cli.errors import EldrError

        failed = []
        for proc, recv, path in self.jobs:
            proc.join()
            if proc.exitcode != 0:
                why = recv.recv() if recv.poll() else f"the drawing process ended with code {proc.exitcode}"
                failed.append(f"{path.name}: {why}")
            recv.close()
        self.jobs = []
        if failed:
            raise EldrError(f"could not draw figure {failed[0]}")

    def stop(self) -> None:
        for proc, recv, _ in self.jobs:
            proc.terminate()
            proc.join()
            recv.close()
        self.jobs = []

    def __enter__(self) -> "Drawing":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        else:
            self.stop()


def _draw_child(conn, draw, path, args) -> None:
    import signal
    import sys

    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    try:
        draw(path, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(f"{type(e).__name__}: {e}")
        sys.exit(1)


def rho_per_transform(path: Path, rho: dict[str, float], chosen: str | None = None) -> Path:
    """Fig. 7: signature quality rho (Eq. 1) for each candidate transform, full layer mask."""
    pl = plt()
    fig, ax = pl.subplots(figsize=(5.5, 3))
    names = list(rho)
    vals = [rho[n] for n in names]
    colors = ["tab:orange" if n == chosen else "tab:blue" for n in names]
    ax.bar(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("rho (Spearman, Eq. 1)")
    ax.set_title("Signature quality per transform (all layers)" + (f"; kept: {chosen}" if chosen else ""))
    lo = min(vals + [0.0])
    ax.set_ylim(lo, max(vals) * 1.12 if max(vals) > 0 else 1)
    return save(fig, path)


def cumulative_rho(path: Path, cum_rho: np.ndarray, n_star: int) -> Path:
    """Fig. 8: cumulative rho against layers kept by greedy selection, N* starred."""
    pl = plt()
    fig, ax = pl.subplots(figsize=(5.5, 3))
    x = np.arange(1, len(cum_rho) + 1)
    ax.plot(x, cum_rho, marker=".", lw=1)
    ax.plot([n_star], [cum_rho[n_star - 1]], marker="*", ms=14, color="tab:red", label=f"N* = {n_star}")
    ax.set_xlabel("layers kept (greedy order)")
    ax.set_ylabel("cumulative rho")
    ax.legend()
    ax.set_title("Greedy layer selection")
    return save(fig, path)


def pca_clusters(path: Path, signatures: np.ndarray, centroids: np.ndarray, domains) -> Path:
    """Fig. 9: first two principal components of the signatures by domain, with the centroids."""
    pl = plt()
    X = np.asarray(signatures, dtype=np.float64)
    mu = X.mean(axis=0)
    # PCA on a sample (deterministic) so large N stays cheap
    sample = X if len(X) <= 5000 else X[np.linspace(0, len(X) - 1, 5000).astype(int)]
    axes = _top2_axes(sample - mu)
    P = (X - mu) @ axes
    C = (centroids - mu) @ axes
    fig, ax = pl.subplots(figsize=(5.5, 4.5))
    domains = np.asarray(domains)
    for d in sorted(set(domains.tolist())):
        m = domains == d
        ax.scatter(P[m, 0], P[m, 1], s=6, alpha=0.5, label=str(d))
    ax.scatter(C[:, 0], C[:, 1], marker="X", s=90, c="black", label="centroids")
    ax.set_xlabel("PC1")
    ax.set_ylabel("PC2")
    ax.legend(fontsize=7, markerscale=2)
    ax.set_title(f"Signatures (PCA) and {len(C)} balanced centroids")
    return save(fig, path)


def _top2_axes(Xc: np.ndarray) -> np.ndarray:
    """The first two principal axes [d, 2] of centered rows by seeded subspace iteration (8 passes over
    a 10-column block, then Rayleigh-Ritz): a full SVD or eigendecomposition of a 1,000 x 2,560
    signature matrix took seconds, longer than the rest of the figure. Signs are fixed (largest
    |loading| positive), as an SVD's are arbitrary."""
    n, d = Xc.shape
    k = min(2, n, d)
    Q = np.random.default_rng(0).standard_normal((d, min(k + 8, d)))
    for _ in range(8):
        Q = np.linalg.qr(Xc.T @ (Xc @ Q))[0]
    V = Q @ np.linalg.svd(Xc @ Q, full_matrices=False)[2][:k].T
    V *= np.where(V[np.abs(V).argmax(axis=0), np.arange(k)] < 0, -1.0, 1.0)
    if k < 2:
        V = np.concatenate([V, np.zeros((d, 2 - k))], axis=1)
    return V


def moe_layer_cost(path: Path, rows: list[dict], model, facts: dict) -> Path:
    """Fig. 2: one MoE layer's time against distinct active experts, one line per batch size."""
    pl = plt()
    fig, ax = pl.subplots(figsize=(6, 3.6))
    batches = sorted({r["batch"] for r in rows})
    cmap = pl.get_cmap("viridis")
    for i, b in enumerate(batches):
        pts = sorted((r["active_experts"], r["ms"]) for r in rows if r["batch"] == b)
        x, y = np.array(pts).T
        col = cmap(i / max(1, len(batches) - 1))
        ax.plot(x, y, "o", color=col, ms=4, label=f"batch {b}")
        ax.plot(x, model.a_ms + model.b_ms * x + model.c_ms * b, "-", color=col, lw=0.8)
    ax.set_xlabel("distinct active experts in the step")
    ax.set_ylabel("MoE layer time (ms)")
    ax.set_title(f"One MoE layer on this CPU (torch {facts['dtype']}, {facts['threads']} threads): "
                 f"E={facts['num_experts']}, H={facts['hidden']}, I={facts['intermediate']}, k={facts['top_k']}\n"
                 f"fit: {model.a_ms:.2f} + {model.b_ms:.3f}*active + {model.c_ms:.4f}*tokens ms", fontsize=8)
    ax.legend(fontsize=7)
    return save(fig, path)
