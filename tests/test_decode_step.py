"""`eldr bench decode-step`: one whole decoder layer timed, fitted to the simulator's step form (with a KV
term), written as a cost model every consumer reads; the shipped GPU measurement; the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_cli.costmodel import CostModel, step_ms_from_terms
from eldr_cli.costmodel import decode_step as ds
from eldr_cli.costmodel import measured_step as ms
from eldr_cli.errors import EldrError
from eldr_cli.main import run

TINY = {"model": "tiny", "tp": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "num_experts": 16,
        "intermediate": 32, "top_k": 2, "n_layers": 4}


def test_fit_recovers_known_coefficients_and_states_residuals():
    k0, kb, kt, kv = 0.07, 0.0034, 0.00024, 6.6e-7
    rows = [{"batch": b, "active_experts": a, "context": c, "ms": k0 + kb * a + kt * b + kv * b * c}
            for b in (8, 64, 256) for a in (8, 32, 128) for c in (512, 2048)]
    coef, fit, out = ds.fit_decode_step(rows)
    assert coef == pytest.approx({"k0": k0, "kb": kb, "kt": kt, "kv": kv}, rel=1e-6)
    assert fit["max_abs_rel_error"] < 1e-6 and fit["points"] == len(rows)
    rows[0]["ms"] *= 1.5  # one slow point shows as a residual of that row
    _, fit, out = ds.fit_decode_step(rows)
    assert fit["max_abs_rel_error"] > 0.1
    assert max(out, key=lambda r: abs(r["rel_residual"])) is out[0]


def test_the_measured_step_is_the_one_formula_with_a_kv_term():
    cm = ms.cost_model_of({"k0": 0.07, "kb": 0.0034, "kt": 0.00024, "kv": 6.6e-7}, {**TINY, "top_k": 8}, "cuda (x)")
    terms = cm.step_terms(48)
    assert terms[4] == pytest.approx(48 * 6.6e-7)  # the KV term per context token, all layers
    ctx = [512, 2048, 4096]
    want = 48 * 0.07 + 0.0034 * 300 + 48 * 0.00024 * 3 + 48 * 6.6e-7 * sum(ctx)
    assert cm.step_ms(300, 48, 3, context=ctx) == pytest.approx(want)
    assert float(step_ms_from_terms(terms, 300, 3, sum(ctx))) == pytest.approx(want)
    # a longer context costs more only through the KV term
    assert cm.step_ms(300, 48, 3, context=[x * 2 for x in ctx]) - cm.step_ms(300, 48, 3, context=ctx) == \
        pytest.approx(48 * 6.6e-7 * sum(ctx))


def test_timing_a_small_layer_on_the_cpu_gives_rows_for_every_point():
    rows, facts = ds.time_decode_step(TINY, batches=(2, 8), actives=(2, 4, 8), contexts=(16, 64), device="cpu",
                                      repeats=2)
    assert {(r["batch"], r["active_experts"], r["context"]) for r in rows} == \
        {(b, a, c) for b in (2, 8) for a in (2, 4, 8) for c in (16, 64) if a <= b * 2}
    assert all(r["ms"] > 0 for r in rows)
    assert facts["launch"] == "eager" and "no CUDA GPU" in facts["timed"] and facts["compiled"] is False
    assert facts["heads"] == 4 and facts["kv_heads"] == 2


def test_a_cpu_run_writes_the_layer_and_the_lm_head_charged_once_per_step(tmp_path):
    out = tmp_path / "cm"
    ms.run_decode_step(out, shape={**TINY, "vocab": 512}, batches=(2, 8), actives=(2, 4, 8), contexts=(16, 64),
                       device="cpu", repeats=2)
    from eldr_cli.artifacts.store import Artifact

    a = Artifact(out)
    cm = CostModel.load(out)
    layer, head = a.params["layer_ms"], a.params["lm_head_ms"]
    assert set(head) == {"h0", "h1", "max_abs_rel_error"}
    assert cm.a_ms == pytest.approx(layer["k0"] + head["h0"] / TINY["n_layers"])
    assert cm.c_ms == pytest.approx(layer["kt"] + head["h1"] / TINY["n_layers"])
    assert (out / "lm_head_timings.parquet").is_file() and (out / "decode_step_timings.parquet").is_file()
    assert a.params["label"] == "MEASURED" and "kv_capacity_tokens" not in a.params  # a CPU: no GPU deployment


def test_layer_shapes_of_presets_and_a_tp_rank():
    q = ds.layer_shape("Qwen3-30B-A3B")
    assert (q["heads"], q["kv_heads"], q["num_experts"], q["intermediate"], q["top_k"], q["n_layers"]) == \
        (32, 4, 128, 768, 8, 48)
    m = ds.layer_shape("Llama-4-Maverick", tp=8)  # 1/8 of the heads and expert width; 1 KV head (replicated)
    assert (m["heads"], m["kv_heads"], m["intermediate"], m["top_k"], m["n_layers"]) == (5, 1, 1024, 1, 24)
    with pytest.raises(EldrError, match="MLA"):
        ds.layer_shape("DeepSeek-V3")
    with pytest.raises(EldrError, match="does not divide"):
        ds.layer_shape("Qwen3-30B-A3B", tp=3)


def test_shipped_h100_measurement_fits_within_6pct_and_its_roofline_ratio_is_stated(tmp_path):
    """The decode layer measured on an H100 (make gpu-check, shipped): the fit's residuals are small and the
    artifact carries the H100 deployment (KV capacity), so the simulator caps decoders as on that GPU."""
    out = tmp_path / "cm"
    assert run(["bench", "decode-step", "--from-measured", "H100-SXM", "--out", str(out)]) == 0
    cm = CostModel.load(out)
    assert cm.source == "measured-decode-step" and cm.model == "Qwen3-30B-A3B" and "H100" in cm.device
    assert cm.kv_ms > 0 and cm.b_ms > 0 and cm.deployment["kv_capacity_tokens"] > 0
    from eldr_cli.artifacts.store import Artifact

    a = Artifact(out)
    assert a.metrics["fit_max_abs_rel_error"] < 0.06 and a.params["compiled"] is True
    rows, _ = ms.shipped_rows("H100-SXM")
    # what a distinct expert costs, measured: 3.4 us per layer on the H100 (bf16, 9.4 MB per expert)
    assert 2.5e-3 < cm.b_ms < 4.5e-3
    assert len(rows) >= 20
    from eldr_cli.report.run import cost_provenance

    assert cost_provenance(out).startswith("MEASURED decode step: one Qwen3-30B-A3B TP1 decoder layer "
                                           "(torch.compile + CUDA graph) on cuda (NVIDIA H100")


def test_bad_input_exits_2_with_one_message_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [(["--device", "cuda"], "torch sees no CUDA GPU"),
             (["--from-measured", "H100-SXM", "--model", "Llama-4-Maverick", "--tp", "8"],
              "missing the dense layers and the shared expert on an H100"),
             (["--from-measured", "H200", "--model", "Llama-4-Maverick"], "no shipped decode-step measurement of "
                                                                           "Llama-4-Maverick TP1"),
             (["--from-measured", "H200", "--model", "Llama-4-Maverick", "--tp", "8", "--compile"],
              "was not timed compiled"),
             (["--from-measured", "H100-SXM", "--model", "Llama-4-Maverick", "--tp", "8", "--dtype", "fp8"],
              "no shipped fp8 decode-step measurement"),
             (["--from-measured", "B300"], "unknown device"),
             (["--model", "DeepSeek-V3", "--device", "cpu"], "MLA"),
             (["--device", "cpu", "--batches", "1", "--active", "1", "--contexts", "1"], "fewer than 4"),
             (["--device", "cpu", "--batches", "x"], "comma-separated integers")]
    for i, (args, msg) in enumerate(cases):
        out = tmp_path / f"o{i}"
        assert run(["bench", "decode-step", "--out", str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (args, err)
        assert not out.exists()


def test_fp8_on_a_cpu_is_refused_clearly(tmp_path, capsys):
    out = tmp_path / "cm"
    rc = run(["bench", "moe-layer", "--out", str(out), "--device", "cpu", "--dtype", "fp8", "--experts", "8",
              "--hidden", "16", "--intermediate", "16", "--top-k", "2", "--batches", "1,2", "--active", "1,2",
              "--repeats", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "fp8 needs a CUDA GPU" in err and "Traceback" not in err
    assert not out.exists()


@pytest.fixture(scope="module")
def qwen_shaped(tmp_path_factory):
    """A GENERATED trace of Qwen3-30B-A3B's shape (L=48, E=128, top-8) and a tiny-shaped one."""
    d = tmp_path_factory.mktemp("ds")
    assert run(["synth-trace", "--out", str(d / "q"), "--requests", "60", "--decode-steps", "8", "--picks"]) == 0
    assert run(["synth-trace", "--out", str(d / "t"), "--requests", "20", "--layers", "4", "--experts", "16",
                "--top-k", "2", "--decode-steps", "8", "--picks"]) == 0
    assert run(["bench", "decode-step", "--from-measured", "H100-SXM", "--out", str(d / "cm")]) == 0
    return d


def test_the_simulator_uses_a_measured_decode_step_and_refuses_it_for_another_model(qwen_shaped, capsys):
    d = qwen_shaped
    common = ["--routers", "round-robin", "--rates", "2", "--duration", "4", "--warmup", "1", "--prefill", "1",
              "--decode", "2", "--max-tokens", "8"]
    assert run(["bench", "simulate", "--trace", str(d / "q"), "--cost-model", str(d / "cm"),
                "--out", str(d / "sim"), *common]) == 0
    from eldr_cli.artifacts.store import Artifact

    tpot = Artifact(d / "sim").metrics["median_tpot_ms"]["round-robin"]
    cm = CostModel.load(d / "cm")
    one = 48 * cm.a_ms + 48 * 8 * cm.b_ms  # a step of one request: 8 distinct experts on each of 48 layers
    assert one < tpot < one + 48 * 8 * cm.b_ms + 1.0  # at most 2 requests per decoder at 2 req/s
    out = d / "sim-bad"
    assert run(["bench", "simulate", "--trace", str(d / "t"), "--cost-model", str(d / "cm"),
                "--out", str(out), *common]) == 2
    err = capsys.readouterr().err
    assert "measured decode step of Qwen3-30B-A3B (L=48, E=128)" in err and "L=4, E=16" in err
    assert not out.exists()


def test_compiled_graph_fixed_cost_is_below_the_plain_graphs_on_both_gpus():
    """What the shipped measurements say (and the docs quote): inductor's fusion takes 40-50 us of the
    layer's fixed cost away; the per-expert cost (weight reads) is the same either way, within 5%."""
    for dev in ("H100-SXM", "H200"):
        plain = ds.fit_decode_step(ms.shipped_rows(dev, compiled=False)[0])[0]
        comp = ds.fit_decode_step(ms.shipped_rows(dev, compiled=True)[0])[0]
        assert comp["k0"] < plain["k0"] - 0.03
        assert abs(comp["kb"] / plain["kb"] - 1) < 0.05
    assert np.isfinite(comp["kv"])
