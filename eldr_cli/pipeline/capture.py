"""`eldr capture` as a library call: prompts -> backend -> chunked staging -> trace artifact."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from eldr_cli.capture.backend import RequestCapture, check_checkpoint, model_fingerprint
from eldr_cli.capture.progress import progress_bar
from eldr_cli.capture.prompts import load_prompts, selection_hash
from eldr_cli.capture.staging import Staging, staging_dir
from eldr_cli.errors import EldrError


@dataclass
class CaptureResult:
    out: Path
    metrics: dict
    skipped: list[dict] = field(default_factory=list)
    resumed_requests: int = 0
    already_complete: bool = False


def _chunk_arrays(caps: list[RequestCapture], E: int, with_gate: bool) -> dict[str, np.ndarray]:
    L, k = caps[0].decode_picks.shape[1:]
    arrays = {
        "prefill_counts": np.stack([c.prefill_counts for c in caps]).astype(np.int32),
        "decode_counts": np.stack([c.decode_counts(E) for c in caps]).astype(np.int32),
        "decode_steps": np.array([c.decode_picks.shape[0] for c in caps], dtype=np.int32),
        "prompt_tokens": np.array([c.prompt_tokens for c in caps], dtype=np.int32),
        "decode_picks": (np.concatenate([c.decode_picks for c in caps]) if caps
                         else np.zeros((0, L, k), np.int16)).astype(np.int16),
    }
    if with_gate and caps[0].prefill_gate_prob is not None:
        arrays["prefill_gate_prob"] = np.stack([np.asarray(c.prefill_gate_prob) for c in caps]).astype(np.float32)
        arrays["prefill_gate_logit"] = np.stack([np.asarray(c.prefill_gate_logit) for c in caps]).astype(np.float32)
    return arrays


def run_capture(model, prompts, out, *, backend: str = "transformers", max_new_tokens: int = 128,
                batch_size: int = 8, chunk_size: int = 64, limit: int | None = None, sample: int | None = None,
                seed: int = 0, eval_fraction: float = 0.2, resume: bool = False, device: str = "cpu",
                dtype: str = "auto", gate_sums: bool = True, progress: bool = True, log=None,
                exclude_training: bool | None = None) -> CaptureResult:
    """Capture expert picks of ``prompts`` on ``model`` into the trace artifact ``out``.

    ``exclude_training`` (default: on when the model directory has a ``split.json``, as
    ``eldr model tiny --train`` writes) drops the model's training prompts before sampling.
    Bad input raises EldrError before anything is written. An interrupted run leaves its flushed
    chunks in the staging directory for ``resume=True``.
    """
    from eldr_cli.capture.hf import load_backend

    log = log or (lambda msg: None)
    out = Path(out)
    if max_new_tokens < 0:
        raise EldrError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if batch_size < 1 or chunk_size < 1:
        raise EldrError("--batch-size and --chunk-size must be >= 1")
    model_dir = check_checkpoint(model)
    _check_out(out)
    excluded = training_ids(model_dir) if exclude_training is not False else None
    if exclude_training and excluded is None:
        raise EldrError(f"{model_dir} has no split.json, so there are no training prompts to exclude")
    rows = load_prompts(prompts, tokenizer=_load_tokenizer(model_dir), limit=limit, sample=sample, seed=seed,
                        eval_fraction=eval_fraction, exclude_ids=excluded)
    fp_model = model_fingerprint(model_dir)
    fingerprint = {"model_fingerprint": fp_model, "prompts_selection": selection_hash(rows),
                   "max_new_tokens": max_new_tokens, "chunk_size": chunk_size, "backend": backend, "dtype": dtype,
                   "gate_sums": gate_sums}
    if resume:
        done = _already_complete(out, fingerprint)
        if done is not None:
            return done

    be = load_backend(backend, model_dir, device=device, dtype=dtype)
    staging, resumed = _open_staging(out, fingerprint, resume, log)
    t_start = time.perf_counter()
    counters = _Counters()
    with progress_bar(progress) as bar:
        task = bar.add_task("capture", total=len(rows), reqs=0, toks=0, busy_s=0.0)
        for c in range((len(rows) + chunk_size - 1) // chunk_size):
            chunk_rows = rows[c * chunk_size:(c + 1) * chunk_size]
            if staging.done(c):
                bar.advance(task, len(chunk_rows))
                continue
            _capture_chunk(be, staging, c, chunk_rows, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           gate_sums=gate_sums, counters=counters, on_batch=lambda n, busy_s: bar.update(
                               task, advance=n, reqs=counters.requests, toks=counters.tokens, busy_s=busy_s),
                           on_skipped=lambda n: bar.advance(task, n), log=log)
    skipped_all = staging.state["skipped"]
    params = {"model": str(model_dir), "family": be.family, "backend": backend,
              "model_fingerprint": fp_model, "prompts_file": str(prompts),
              "prompts_selection": fingerprint["prompts_selection"], "max_new_tokens": max_new_tokens,
              "limit": limit, "sample": sample,
              "excluded_training_prompts": bool(excluded), "seed": seed, "eval_fraction": eval_fraction,
              "batch_size": batch_size, "chunk_size": chunk_size, "dtype": dtype, "device": device,
              "decode_steps_convention": "decode step s feeds generated token s; EOS ignored"}
    model_facts = {"model": str(model_dir), "num_layers": be.num_layers, "num_experts": be.num_experts,
                   "top_k": be.top_k, "moe_layer_ids": be.moe_layer_ids, "family": be.family}
    metrics = _capture_metrics(rows, skipped_all, counters, wall_s=time.perf_counter() - t_start, resumed=resumed)
    written = _assemble(staging, out, model_facts, params, prompts, metrics)
    return CaptureResult(out, written, skipped=skipped_all, resumed_requests=resumed)


@dataclass
class _Counters:
    """Throughput of this run (resumed chunks excluded): requests, tokens, seconds spent capturing."""

    requests: int = 0
    tokens: int = 0
    busy_s: float = 0.0


def _check_out(out: Path) -> None:
    from eldr_cli.artifacts.store import MANIFEST

    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise EldrError(f"{out} exists and is not an eldr artifact; refusing to replace it",
                        hint="choose an empty or new --out directory")


def training_ids(model_dir: Path) -> set[str] | None:
    """The training prompt ids of a model trained by eldr (its ``split.json``), else None."""
    f = Path(model_dir) / "split.json"
    if not f.is_file():
        return None
    try:
        return set(json.loads(f.read_text())["training"])
    except (OSError, ValueError, KeyError, TypeError):
        raise EldrError(f"{f}: not a valid split file (expected a 'training' list of prompt ids)") from None


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError) as e:
        raise EldrError(f"{model_dir}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None


def _already_complete(out: Path, fingerprint: dict) -> CaptureResult | None:
    """``--resume`` on a finished capture of the same model and prompts: its result, nothing redone.
    A finished artifact of another model or selection is an error; None when there is nothing finished."""
    from eldr_cli.artifacts.store import MANIFEST, read_manifest

    if not (out / MANIFEST).is_file() or staging_dir(out).exists():
        return None
    m = read_manifest(out)
    p = m.get("params", {})
    if m.get("kind") != "trace" or p.get("model_fingerprint") != fingerprint["model_fingerprint"]:
        raise EldrError(f"cannot resume: {out} is a {m.get('kind')} artifact of another model "
                        f"({p.get('model', '?')})", hint="choose another --out or drop --resume")
    if p.get("prompts_selection") != fingerprint["prompts_selection"]:
        raise EldrError(f"cannot resume: {out} was captured from a different prompt selection",
                        hint="rerun without --resume to replace it")
    return CaptureResult(out, m.get("metrics", {}), already_complete=True)


def _open_staging(out: Path, fingerprint: dict, resume: bool, log) -> tuple[Staging, int]:
    """The staging directory, continued (``resume``) or started afresh; and the requests already in it."""
    staging = Staging(out, fingerprint)
    if resume and staging.exists():
        staging.load()
        resumed = staging.n_done_requests()
        log(f"resuming: {len(staging.chunk_ids())} chunks ({resumed} requests) already captured")
        return staging, resumed
    if staging.exists():
        log(f"discarding an earlier interrupted capture in {staging.dir} (pass --resume to continue it)")
    staging.start_fresh()
    return staging, 0


def _tokenize_chunk(be, chunk_rows, max_new_tokens: int, log) -> tuple[list[list[int]], list, list[dict]]:
    """Token ids of the prompts that fit the model context; the others are skipped with a reason."""
    toks, keep, skipped = [], [], []
    for r in chunk_rows:
        ids = be.tokenize(r.text)
        if not ids:
            skipped.append({"request_id": r.request_id, "reason": "empty prompt", "prompt_tokens": 0})
        elif len(ids) + max_new_tokens + 1 > be.max_len:
            skipped.append({"request_id": r.request_id, "reason": "too long", "prompt_tokens": len(ids)})
            log(f"[yellow]warning:[/] skipping {r.request_id}: {len(ids)} prompt tokens + "
                f"{max_new_tokens} new tokens exceed the model context ({be.max_len})")
        else:
            toks.append(ids)
            keep.append(r)
    return toks, keep, skipped


def _capture_chunk(be, staging: Staging, c: int, chunk_rows, *, max_new_tokens: int, batch_size: int,
                   gate_sums: bool, counters: _Counters, on_batch, on_skipped, log) -> None:
    """Run one chunk of prompts through the backend in batches and flush it to the staging directory."""
    t0 = time.perf_counter()
    toks, keep, skipped = _tokenize_chunk(be, chunk_rows, max_new_tokens, log)
    caps: list[RequestCapture | None] = [None] * len(keep)
    order = sorted(range(len(keep)), key=lambda i: -len(toks[i]))   # similar lengths -> less padding
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        res = be.run_batch([toks[i] for i in idx], max_new_tokens, gate_sums=gate_sums)
        for i, cap in zip(idx, res, strict=True):
            caps[i] = cap
        counters.tokens += sum(len(toks[i]) + max_new_tokens for i in idx)
        counters.requests += len(idx)
        on_batch(len(idx), counters.busy_s + time.perf_counter() - t0)
    on_skipped(len(skipped))
    if not keep:
        counters.busy_s += time.perf_counter() - t0
        staging.write_empty_chunk(c, skipped)
        return
    arrays = _chunk_arrays(cast(list[RequestCapture], caps), be.num_experts, gate_sums)  # every slot filled above
    table = [{"request_id": r.request_id, "domain": r.domain, "language": r.language,
              "prompt_tokens": len(t), "decode_tokens": max_new_tokens, "source": r.source,
              "split": r.split, "prompt": r.text} for r, t in zip(keep, toks, strict=True)]
    counters.busy_s += time.perf_counter() - t0
    staging.write_chunk(c, arrays, table, skipped, {"busy_s": round(time.perf_counter() - t0, 3)})


def _capture_metrics(rows, skipped_all: list[dict], counters: _Counters, *, wall_s: float, resumed: int) -> dict:
    busy = counters.busy_s
    metrics = {"n_skipped_too_long": sum(1 for s in skipped_all if s["reason"] == "too long"),
               "n_skipped_empty": sum(1 for s in skipped_all if s["reason"] == "empty prompt"),
               "n_selected": len(rows), "capture_wall_s": round(wall_s, 3),
               "requests_per_s": round(counters.requests / busy, 3) if busy else None,
               "tokens_per_s": round(counters.tokens / busy, 1) if busy else None,
               "n_resumed_requests": resumed,
               "n_calibration": None, "n_evaluation": None}
    if rows:
        skipped_ids = {s["request_id"] for s in skipped_all}
        kept = [r for r in rows if r.request_id not in skipped_ids]
        metrics["n_calibration"] = sum(r.split == "calibration" for r in kept)
        metrics["n_evaluation"] = sum(r.split == "evaluation" for r in kept)
    return metrics


def _assemble(staging, out, model_facts, params, prompts, metrics) -> dict:
    from eldr_cli.capture.assemble import assemble_trace

    return assemble_trace(staging, out, model=model_facts, params=params, inputs={"prompts": prompts},
                          metrics=metrics)


