"""Drift on captured traces of the shipped prompt sets (slow: a tiny random-weight qwen3_moe captures 1,200
task and 600 language prompts on the CPU, about 75 s on 2 cores): fitted on task prompts, a window of held-back
task prompts is never flagged and a window of language prompts always is, over 5 seeds (each seed: its own
calibration/held-back split of the task rows, its own fit, its own sample of language rows)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from eldr_cli.artifacts.trace import read_trace, write_trace
from eldr_cli.data import prompts_file
from eldr_cli.main import run as eldr
from eldr_cli.pipeline.fit import run_fit
from eldr_cli.routing import RoutingModel
from eldr_cli.routing.drift import DriftMonitor
from eldr_cli.routing.model import load_routing_artifact

WINDOW = 200  # the held-back fifth of 1,200 task rows holds 240


def _rows(tr, idx: np.ndarray, split: np.ndarray):
    gates = {n: None if getattr(tr, n) is None else getattr(tr, n)[idx] for n in ("prefill_gate_prob",
                                                                              "prefill_gate_logit")}
    return replace(tr, prefill_counts=tr.prefill_counts[idx], decode_counts=tr.decode_counts[idx],
                   decode_steps=tr.decode_steps[idx], decode_picks=None, decode_offsets=None,
                   requests=tr.requests[idx.tolist()].with_columns(pl.Series("split", split)), **gates)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    assert eldr(["model", "tiny", "--out", str(d / "tiny")]) == 0
    for name, n in (("task", 1200), ("language", 600)):
        assert eldr(["capture", "--model", str(d / "tiny"), "--prompts", str(prompts_file(name)), "--sample", str(n),
                     "--max-new-tokens", "8", "--out", str(d / name), "--no-progress"]) == 0
    return d, read_trace(d / "task"), read_trace(d / "language")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_language_prompts_drift_from_a_task_fit_held_back_task_prompts_do_not(captured, seed):
    d, task, lang = captured
    rng = np.random.default_rng(seed)
    perm = rng.permutation(task.n_requests)
    n_cal = int(0.8 * len(perm))
    write_trace(d / f"t{seed}", _rows(task, perm, np.where(np.arange(len(perm)) < n_cal, "calibration",
                                                               "evaluation")))
    fit = run_fit(d / f"t{seed}", d / f"f{seed}", decoders=4, pairs=3000, figures=False, seed=seed)
    model, stats = RoutingModel.load(fit), load_routing_artifact(fit).params["drift"]
    verdict = {}
    for name, counts in (("held-back task", task.prefill_counts[perm[n_cal:]][:WINDOW]),
                         ("language", lang.prefill_counts[rng.permutation(lang.n_requests)[:WINDOW]])):
        mon = DriftMonitor.for_model(model, stats, window=WINDOW)
        mon.observe_many(np.stack([model.signature(c) for c in counts]))
        verdict[name] = mon.snapshot()["drifted"]
    assert verdict == {"held-back task": False, "language": True}
