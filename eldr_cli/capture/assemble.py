"""Stream the staged chunks of a capture or import into one trace artifact (bounded memory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eldr_cli import plots
from eldr_cli.artifacts.store import ArtifactWriter
from eldr_cli.artifacts.trace import REQUEST_COLUMNS
from eldr_cli.capture.figures import Aggregates, fig1_domain_heatmap, fig3_prefill_decode
from eldr_cli.capture.staging import Staging
from eldr_cli.errors import EldrError

COUNT_ARRAYS = ("prefill_counts", "decode_counts", "prefill_gate_prob", "prefill_gate_logit")


def _pad_experts(a: np.ndarray, E: int) -> np.ndarray:
    if a.shape[-1] == E:
        return a
    if a.shape[-1] > E:
        raise EldrError(f"expert id {a.shape[-1] - 1} out of range for {E} experts")
    return np.concatenate([a, np.zeros((*a.shape[:-1], E - a.shape[-1]), dtype=a.dtype)], axis=-1)


def assemble_trace(staging: Staging, out: Path, *, model: dict, params: dict, inputs: dict | None = None,
                   metrics: dict | None = None, figures: bool = True,
                   input_digests: dict[str, dict[str, str]] | None = None,
                   aggregates: Aggregates | None = None, draw_in_background: bool = False) -> dict:
    """Write the trace artifact from ``staging``; returns the metrics written to the manifest.
    ``input_digests``: file digests of an input folder already computed (see ``ArtifactWriter``).
    ``aggregates``: the figures' sums over every staged chunk, if the caller has them already (the
    import's parser processes sum their own chunks); then the figures are drawn first, in forked
    processes while the arrays are written if ``draw_in_background``."""
    import polars as pl

    L, E, k = model["num_layers"], model["num_experts"], model["top_k"]
    chunks = staging.chunk_ids()
    n_total = staging.n_done_requests()
    if n_total == 0:
        raise EldrError("no request was captured (every prompt was skipped)",
                        hint="check the skipped-prompt warnings: prompts too long for the model's context?")
    first = staging.chunk_arrays(chunks[0])
    has_gate = "prefill_gate_prob" in first.files
    has_picks = "decode_picks" in first.files
    agg = Aggregates(L, E, k) if aggregates is None else aggregates.widen(E)
    if agg.E != E:
        raise EldrError(f"expert id {agg.E - 1} out of range for {E} experts")
    with ArtifactWriter(out, kind="trace", params={**model, **params}, inputs=inputs,
                        input_digests=input_digests) as w, plots.Drawing(draw_in_background) as drawing:
        if figures and aggregates is not None:
            _figures(w, drawing, agg, model)
        rows = 1024
        n_steps = sum(int(staging.chunk_arrays(c)["decode_steps"].sum()) for c in chunks) if has_picks else 0
        out_rows = {n: w.create_rows(n, n_total, (L, E), np.float32 if "gate" in n else np.int32, chunk_rows=rows)
                    for n in COUNT_ARRAYS if has_gate or "gate" not in n}
        out_rows["decode_steps"] = w.create_rows("decode_steps", n_total, (), np.int32, chunk_rows=8192)
        out_rows["prompt_tokens"] = w.create_rows("prompt_tokens", n_total, (), np.int32, chunk_rows=8192)
        if has_picks:
            out_rows["decode_picks"] = w.create_rows("decode_picks", n_steps, (L, k), np.int16, chunk_rows=8192)
        steps_all = []
        for c in chunks:
            a = staging.chunk_arrays(c)
            arrs = {n: _pad_experts(a[n], E) for n in COUNT_ARRAYS if n in a.files}
            if (arrs["decode_counts"].max(axis=2, initial=0) > a["decode_steps"][:, None]).any():
                raise EldrError(f"chunk {c}: decode counts exceed decode steps (corrupt staging data)")
            for n, v in arrs.items():
                out_rows[n].add(v)
            for n in ("decode_steps", "prompt_tokens", "decode_picks"):
                if n in out_rows:
                    out_rows[n].add(a[n])
            steps_all.append(a["decode_steps"].astype(np.int64))
            if aggregates is None:
                doms = pl.read_parquet(staging.chunk_table(c), columns=["domain"])["domain"].to_list()
                agg.update(arrs["prefill_counts"], arrs["decode_counts"], a["prompt_tokens"], a["decode_steps"],
                           doms)
        for r in out_rows.values():
            r.close()
        steps = np.concatenate(steps_all)
        if has_picks:
            w.write_array("decode_offsets", np.concatenate([[0], np.cumsum(steps)]).astype(np.int64))
        tables = [staging.chunk_table(c) for c in chunks]
        pl.scan_parquet(tables).select(list(REQUEST_COLUMNS)).sink_parquet(w.path / "requests.parquet")
        ids = pl.scan_parquet(w.path / "requests.parquet").select(pl.col("request_id").n_unique()).collect().item()
        if ids != n_total:
            raise EldrError(f"request ids are not unique in the captured trace ({ids} unique of {n_total})")
        corr = agg.prefill_decode_corr()
        finite = corr[np.isfinite(corr)]
        w.metrics.update({
            "n_requests": n_total,
            "prompt_tokens_total": agg.prompt_tokens,
            "decode_steps_total": agg.decode_steps,
            "prefill_decode_corr_per_layer": [None if not np.isfinite(x) else round(float(x), 4) for x in corr],
            "prefill_decode_corr_mean": round(float(finite.mean()), 4) if finite.size else None,
            "n_domains": len(agg.domain_tokens),
            **(metrics or {}),
        })
        if figures and aggregates is None:
            _figures(w, drawing, agg, model)
        result = dict(w.metrics)
    staging.remove()
    return result


def _figures(w: ArtifactWriter, drawing: plots.Drawing, agg: Aggregates, model: dict) -> None:
    ids = model.get("moe_layer_ids", list(range(agg.L)))
    if len(agg.domain_tokens) >= 2:
        drawing.submit(fig1_domain_heatmap, w.figure_path("fig1_domain_experts.png"), agg, ids)
        w.metrics["fig1_layer"] = int(ids[agg.most_discriminative_layer()])
    if agg.decode_steps:
        drawing.submit(fig3_prefill_decode, w.figure_path("fig3_prefill_vs_decode.png"), agg, ids)
