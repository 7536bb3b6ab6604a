"""The trace artifact: which experts each calibration request used in prefill and decode.

Schema: ``manifests/trace.v1.schema.json``. Shapes (R requests, L MoE layers, E experts, k top-k):

- ``prefill_counts`` int32 [R, L, E]: prompt tokens of r routed to e at MoE layer l (top-k picks);
- ``decode_counts``  int32 [R, L, E]: decode steps of r in which layer l picked e;
- ``decode_steps``   int32 [R];  ``prompt_tokens`` int32 [R];
- optional ``prefill_gate_prob`` / ``prefill_gate_logit`` float32 [R, L, E] (summed over prompt tokens);
- optional ``decode_picks`` int16 [S, L, k] with ``decode_offsets`` int64 [R+1] for replay;
- table ``requests``: request_id, domain, language, prompt_tokens, decode_tokens, source, split, prompt.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eldr_cli.artifacts.store import Artifact, ArtifactWriter
from eldr_cli.errors import EldrError

if TYPE_CHECKING:
    import polars as pl

SPLITS = ("calibration", "evaluation", "all")
REQUEST_COLUMNS = ("request_id", "domain", "language", "prompt_tokens", "decode_tokens", "source", "split", "prompt")


@dataclass
class Trace:
    """In-memory trace. ``requests`` is a polars DataFrame with REQUEST_COLUMNS."""

    prefill_counts: np.ndarray
    decode_counts: np.ndarray
    decode_steps: np.ndarray
    requests: pl.DataFrame
    model: dict[str, Any]
    prefill_gate_prob: np.ndarray | None = None
    prefill_gate_logit: np.ndarray | None = None
    decode_picks: np.ndarray | None = None
    decode_offsets: np.ndarray | None = None
    path: Path | None = None
    content_hash: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def n_requests(self) -> int:
        return int(self.prefill_counts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.prefill_counts.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.prefill_counts.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.model["top_k"])

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.requests["prompt_tokens"].to_numpy().astype(np.int32)

    def column(self, name: str) -> np.ndarray:
        return self.requests[name].to_numpy()

    def split_mask(self, split: str | None) -> np.ndarray:
        """Boolean [R] of requests in ``split`` (calibration/evaluation); all when None."""
        if split is None or split == "all":
            return np.ones(self.n_requests, dtype=bool)
        if split not in SPLITS:
            raise EldrError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        m: np.ndarray = np.asarray(self.column("split") == split)
        if not m.any():
            raise EldrError(f"trace {self.path} has no requests in split {split!r}",
                            hint="choose --split all, calibration or evaluation")
        return m

    def gate(self, name: str) -> np.ndarray | None:
        return {"gate-prob": self.prefill_gate_prob, "gate-logit": self.prefill_gate_logit}[name]

    def steps_of(self, r: int) -> np.ndarray:
        """int16 [steps, L, k] decode picks of request r (requires decode_picks)."""
        if self.decode_picks is None or self.decode_offsets is None:
            raise EldrError(f"trace {self.path} has no per-step decode picks",
                            hint="capture with per-step picks (the default) to replay decode")
        return np.asarray(self.decode_picks[self.decode_offsets[r]:self.decode_offsets[r + 1]])


def validate_trace_arrays(prefill_counts: Any, decode_counts: Any, decode_steps: Any, *,
                          where: str = "trace") -> None:
    """Shapes, dtypes and value ranges a trace must satisfy; raises EldrError naming the problem."""
    pc, dc, ds = (np.asarray(a) for a in (prefill_counts, decode_counts, decode_steps))
    if pc.ndim != 3:
        raise EldrError(f"{where}: prefill_counts must be [R, L, E], got shape {pc.shape}")
    if pc.shape[0] == 0:
        raise EldrError(f"{where}: the trace is empty (0 requests)", hint="capture some requests first")
    if dc.shape != pc.shape:
        raise EldrError(f"{where}: decode_counts has shape {dc.shape}, expected {pc.shape} like prefill_counts")
    if ds.shape != (pc.shape[0],):
        raise EldrError(f"{where}: decode_steps has shape {ds.shape}, expected ({pc.shape[0]},)")
    for name, a in (("prefill_counts", pc), ("decode_counts", dc), ("decode_steps", ds)):
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise EldrError(f"{where}: {name} contains NaN or infinite values; counts must be finite integers")
        if a.size and a.min() < 0:
            raise EldrError(f"{where}: {name} contains negative values; counts must be >= 0")
    if (dc.max(axis=2, initial=0) > ds[:, None]).any():
        raise EldrError(f"{where}: decode_counts exceed decode_steps for some request "
                        "(an expert cannot fire in more steps than were decoded)")


def write_trace(out: str | os.PathLike[str], trace: Trace, *, params: dict[str, Any] | None = None,
                inputs: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                figures: Callable[[Path, Trace], None] | None = None) -> Path:
    """Write ``trace`` as a trace artifact (atomically). ``figures(dir, trace)`` may draw PNGs."""
    import polars as pl

    validate_trace_arrays(trace.prefill_counts, trace.decode_counts, trace.decode_steps, where=str(out))
    req = trace.requests
    missing = [c for c in REQUEST_COLUMNS if c not in req.columns]
    if missing:
        raise EldrError(f"trace requests table lacks columns {missing}")
    if len(req) != trace.n_requests:
        raise EldrError(f"requests table has {len(req)} rows for {trace.n_requests} requests")
    model = dict(trace.model)
    model.setdefault("num_layers", trace.num_layers)
    model.setdefault("num_experts", trace.num_experts)
    model.setdefault("moe_layer_ids", list(range(trace.num_layers)))
    if model["num_layers"] != trace.num_layers or model["num_experts"] != trace.num_experts:
        raise EldrError("model facts disagree with the array shapes "
                        f"(L={model['num_layers']}, E={model['num_experts']} vs {trace.prefill_counts.shape})")
    with ArtifactWriter(out, kind="trace", params={**model, **(params or {})}, inputs=inputs) as w:
        R, L, E = trace.prefill_counts.shape
        rows = max(1, min(R, 1024))
        w.write_array("prefill_counts", trace.prefill_counts.astype(np.int32), chunks=(rows, L, E))
        w.write_array("decode_counts", trace.decode_counts.astype(np.int32), chunks=(rows, L, E))
        w.write_array("decode_steps", trace.decode_steps.astype(np.int32))
        w.write_array("prompt_tokens", req["prompt_tokens"].to_numpy().astype(np.int32))
        for name in ("prefill_gate_prob", "prefill_gate_logit"):
            a = getattr(trace, name)
            if a is not None:
                if a.shape != trace.prefill_counts.shape:
                    raise EldrError(f"{name} has shape {a.shape}, expected {trace.prefill_counts.shape}")
                w.write_array(name, a.astype(np.float32), chunks=(rows, L, E))
        if trace.decode_picks is not None:
            S = trace.decode_picks.shape[0]
            w.write_array("decode_picks", trace.decode_picks.astype(np.int16),
                          chunks=(max(1, min(S, 8192)), *trace.decode_picks.shape[1:]))
            w.write_array("decode_offsets", np.asarray(trace.decode_offsets, dtype=np.int64))
        w.write_table("requests", req.select(list(REQUEST_COLUMNS)).with_columns(
            pl.col("prompt_tokens").cast(pl.Int32), pl.col("decode_tokens").cast(pl.Int32)))
        w.metrics.update({"n_requests": R, **(metrics or {})})
        if figures is not None:
            figures(w.path, trace)
    return Path(out)


def read_trace(path: str | os.PathLike[str], *, with_picks: bool = True) -> Trace:
    """Load a trace artifact fully into memory (validated)."""
    art = Artifact(path, kind="trace")
    p = art.params
    names = ["prefill_counts", "decode_counts", "decode_steps",
             *(n for n in ("prefill_gate_prob", "prefill_gate_logit") if art.has_array(n))]
    if with_picks and art.has_array("decode_picks"):
        names += ["decode_picks", "decode_offsets"]
    a = art.arrays(names)
    pc = a["prefill_counts"]
    t = Trace(
        prefill_counts=pc,
        decode_counts=a["decode_counts"],
        decode_steps=a["decode_steps"],
        requests=art.table("requests"),
        model={k: p[k] for k in ("model", "num_layers", "num_experts", "top_k", "moe_layer_ids") if k in p}
        | {k: p[k] for k in ("family",) if k in p},
        prefill_gate_prob=a.get("prefill_gate_prob"),
        prefill_gate_logit=a.get("prefill_gate_logit"),
        path=Path(path),
        content_hash=art.content_hash,
        manifest=art.manifest,
        decode_picks=a.get("decode_picks"),
        decode_offsets=a.get("decode_offsets"),
    )
    validate_trace_arrays(t.prefill_counts, t.decode_counts, t.decode_steps, where=str(path))
    if (t.model.get("num_layers"), t.model.get("num_experts")) != pc.shape[1:]:
        raise EldrError(f"{path}: manifest says L={t.model.get('num_layers')}, E={t.model.get('num_experts')} "
                        f"but prefill_counts is {pc.shape}")
    return t
