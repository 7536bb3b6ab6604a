"""The first-principles GPU cost model (`eldr bench cost-model`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eldr_cli.costmodel import CostModel
from eldr_cli.costmodel.presets import DEVICES, DTYPE_BYTES, MODELS
from eldr_cli.costmodel.roofline import CALIBRATION, build, model_facts
from eldr_cli.errors import EldrError


def test_reproduces_the_paper_fig2_ratio():
    _, _, r = build(CALIBRATION["model"], device=CALIBRATION["device"])
    ratio = r.moe_layer_ms(64, 128) / r.moe_layer_ms(64, 16)
    assert ratio == pytest.approx(4.7, rel=0.10)
    # batch size at fixed active experts barely moves it (memory-bound)
    assert r.moe_layer_ms(128, 64) / r.moe_layer_ms(8, 64) < 1.2


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_batch1_memory_time_is_weights_over_bandwidth(model, device):
    _, _, r = build(model, device=device)
    cfg = MODELS[model]
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    f = model_facts(cfg)
    # independent count of the weights one token reads: every non-routed weight + top-k experts per MoE layer
    weights = (f.dense_params + f.top_k * f.moe_layers * f.expert_params) * DTYPE_BYTES["bf16"]
    expected_ms = weights / (DEVICES[device][0] * 1e12 * r.efficiency) * 1e3
    assert r.memory_ms(f.top_k * f.moe_layers, 0) == pytest.approx(expected_ms, rel=0.01)
    # at batch 1 the step is memory bound: step = memory time + per-layer overhead
    assert r.step_ms(f.top_k * f.moe_layers, [0]) == pytest.approx(expected_ms + L * r.overhead_us / 1e3, rel=0.01)
    assert H > 0


def test_known_parameter_counts():
    def total(m):
        f = model_facts(MODELS[m])
        return (f.dense_params + f.num_experts * f.moe_layers * f.expert_params) / 1e9
    # public totals (billions), embedding table excluded, so a few % low
    for m, b in {"Qwen3-30B-A3B": 30.5, "Mixtral-8x7B": 46.7, "DeepSeek-V3": 671, "GPT-OSS-120B": 117,
                 "Qwen3-235B-A22B": 235, "Llama-4-Maverick": 400}.items():
        assert total(m) == pytest.approx(b, rel=0.04), m


def test_kv_term_grows_with_context_and_fp8_halves_weights():
    _, _, r = build("Qwen3-30B-A3B", device="H100-SXM")
    _, _, r8 = build("Qwen3-30B-A3B", device="H100-SXM", dtype="fp8")
    assert r.step_ms(400, [4096] * 32) > r.step_ms(400, [128] * 32)
    assert r8.weights_read_bytes(400) == pytest.approx(r.weights_read_bytes(400) / 2)


def test_bad_input():
    with pytest.raises(EldrError, match="known: Qwen3-30B-A3B"):
        build("nope", device="MI300X")
    with pytest.raises(EldrError, match="known: H100-SXM"):
        build("Qwen3-30B-A3B", device="TPU")
    with pytest.raises(EldrError, match="--ep 3"):
        build("Qwen3-30B-A3B", device="MI300X", ep=3)
    with pytest.raises(EldrError, match="not a mixture-of-experts"):
        model_facts({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2})


def test_cli_writes_a_cost_model_the_simulator_loads(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MODELS["Mixtral-8x7B"]))
    out = tmp_path / "cm"
    r = subprocess.run([sys.executable, "-m", "eldr_cli", "bench", "cost-model", "--model", str(cfg),
                        "--hbm-tbps", "3", "--tflops", "900", "--tp", "2", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cm = CostModel.load(out)
    assert cm.source == "roofline" and cm.b_ms > 0 and cm.a_ms > 0
    bad = subprocess.run([sys.executable, "-m", "eldr_cli", "bench", "cost-model", "--model", "Mixtral-8x7B",
                          "--device", "H100-SXM", "--tp", "5", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--tp 5" in bad.stderr + bad.stdout and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
