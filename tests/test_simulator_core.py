"""The simulator's compiled decode loop: unchanged figures for a measured (linear) cost model, and each
request's KV context (prompt + generated tokens) in a roofline cost model's step time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_cli.artifacts.trace import write_trace
from eldr_cli.costmodel import CostModel, write_cost_model
from eldr_cli.costmodel.roofline import RooflineCostModel, run_cost_model
from eldr_cli.simulator.replay import TraceReplay
from eldr_cli.synth import synthetic_trace

# figures written by the simulator as of commit a076c36 (before the loop was rewritten for speed) for
# the run in test_linear_cost_model_figures_are_unchanged: (router, rate, p50 TPOT, p99 TPOT, mean
# active experts per layer per step, completed)
PINNED = [["round-robin", 20.0, 4.081276595743847, 5.317485106383345, 4.729811018096146, 395],
          ["jsq", 20.0, 4.264468085105719, 5.664348936170502, 4.946091383076165, 395],
          ["eldr", 20.0, 4.880000000000525, 8.376970212765958, 6.000876354365839, 395],
          ["oracle", 20.0, 4.81553191489354, 7.653382978723449, 5.851864064011255, 395],
          ["round-robin", 60.0, 11.90978723404253, 12.625744680851112, 18.076215195847098, 1224],
          ["jsq", 60.0, 11.90978723404253, 12.625744680851112, 18.312793848115387, 1224],
          ["eldr", 60.0, 11.084893617021073, 13.601182978723328, 14.62862552211422, 1224],
          ["oracle", 60.0, 10.458085106382923, 12.386595744680937, 15.0537628122686, 1224]]


def test_linear_cost_model_figures_are_unchanged(tmp_path):
    from eldr_cli.pipeline.fit import run_fit
    from eldr_cli.pipeline.simulate import run_simulate

    d = tmp_path
    write_trace(d / "t", synthetic_trace(200, 6, 32, 4, decode_steps=24, with_picks=True, seed=3))
    run_fit(d / "t", d / "fit", decoders=4, figures=False, pairs=2000)
    write_cost_model(d / "c", CostModel(a_ms=0.3, b_ms=0.05, c_ms=0.02, e_ms=0.1, d_ms=0.01, source="given"))
    run_simulate(d / "s", trace=d / "t", cost_model=d / "c", routing=d / "fit",
                 routers=["round-robin", "jsq", "eldr", "oracle"], rates=[20.0, 60.0], n_prefill=2, n_decode=4,
                 duration_s=20.0, warmup_s=5.0, max_tokens=48)
    runs = json.loads((d / "s" / "summary.json").read_text())["runs"]
    got = [[r["router"], r["request_rate"], r["p50_tpot_ms"], r["p99_tpot_ms"], r["mean_active_experts_per_step"],
            r["completed"]] for r in runs]
    assert [g[:2] for g in got] == [p[:2] for p in PINNED]
    for g, p in zip(got, PINNED, strict=True):
        assert g[2:] == pytest.approx(p[2:], rel=1e-12, abs=0), g[:2]


# an MoE config of the synthetic trace's shape: 8 layers, every other one MoE (4), 16 experts, top-2
CONFIG = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=2,
              vocab_size=1000)


@pytest.fixture(scope="module")
def roofline(tmp_path_factory):
    d = tmp_path_factory.mktemp("roof")
    (d / "config.json").write_text(json.dumps(CONFIG))
    run_cost_model(d / "cm", d / "config.json", device="H100-SXM")
    cost = CostModel.load(d / "cm")
    assert isinstance(cost, RooflineCostModel)
    return cost


def _one_request_steps(cost, prompt_tokens: int, steps: int = 12):
    """Step log of one decode worker serving one request of row 0 with the given prompt length."""
    from eldr_cli.simulator.core import DecodePool

    t = synthetic_trace(8, 4, 16, 2, decode_steps=8, with_picks=True, seed=5)
    rp = TraceReplay(t, cost)
    rp.prompt_tokens[:] = prompt_tokens
    pool = DecodePool(rp, 1, np.array([0]), np.array([steps]), np.array([True]))
    pool.admit(0, 0, 0.0)
    pool.advance(np.inf)
    return rp, pool.step_log()


def test_roofline_step_reads_the_kv_of_the_request_at_its_context(roofline):
    rp, log = _one_request_steps(roofline, 300)
    assert len(log["step_ms"]) == 12
    for j, (ms, act) in enumerate(zip(log["step_ms"], log["active_experts"], strict=True)):
        assert act == rp.decode_active([0], [j])  # step j replays captured step j mod 8
        # its context is the prompt plus the j tokens generated before the step
        assert ms == pytest.approx(roofline.step_ms(int(act), rp.n_layers, 1, context=[300 + j]), rel=1e-12)
    assert roofline.step_ms(10, 4, 1, context=[301]) > roofline.step_ms(10, 4, 1, context=[300])


def test_roofline_longer_context_makes_decode_steps_slower(roofline):
    _, short = _one_request_steps(roofline, 100)
    _, long = _one_request_steps(roofline, 20000)
    assert (short["active_experts"] == long["active_experts"]).all()
    assert (long["step_ms"] > short["step_ms"]).all()
    # the difference is the KV of 19,900 more tokens, read at the roofline's bandwidth
    kv_ms_per_token = roofline.step_terms(4)[4]
    np.testing.assert_allclose(long["step_ms"] - short["step_ms"], 19900 * kv_ms_per_token, rtol=1e-9)


def test_measured_cost_model_ignores_context():
    cost = CostModel(a_ms=0.5, b_ms=1.0, c_ms=0.1, e_ms=0.2, d_ms=0.05, source="given")
    _, a = _one_request_steps(cost, 100)
    _, b = _one_request_steps(cost, 20000)
    assert (a["step_ms"] == b["step_ms"]).all()
    assert cost.step_ms(10, 4, 3, context=[5000] * 3) == cost.step_ms(10, 4, 3)


def test_expert_parallel_roofline_charges_the_busiest_rank_in_simulator_and_emulator(tmp_path):
    """EP4 over 16 experts: the simulator's compiled step and the emulator's replay (TraceReplay) charge
    the same busiest-rank count and give the same step time."""
    from eldr_cli.simulator.replay import charged_counts

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    run_cost_model(tmp_path / "cm", tmp_path / "config.json", device="H100-SXM", ep=4)
    cost = CostModel.load(tmp_path / "cm")
    assert cost.ep_ranks == 4 and cost.deployment is not None and cost.deployment["gpus_per_instance"] == 4
    rp, log = _one_request_steps(cost, 300)
    for j, (ms, act, ch) in enumerate(zip(log["step_ms"], log["active_experts"], log["charged_experts"],
                                          strict=True)):
        mask = rp.decode_masks[rp.step_index([0], [j])]
        assert ch == charged_counts(mask, rp.n_layers, rp.num_experts, 4)[0] <= act
        emu_ms, emu_act = rp.decode_step_ms([0], [j])
        assert emu_act == act and emu_ms == pytest.approx(ms, rel=1e-12)
    assert (log["charged_experts"] < log["active_experts"]).any()  # top-2 over 4 ranks: often one per rank
