"""One decode-step formula (issue 29 item 4): the plain function every consumer calls and its numba-compiled
form in the simulator's loop give identical times; the cost models, the trace replay and eldr-live use it."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_cli.costmodel import CostModel, step_ms_from_terms
from eldr_cli.costmodel.roofline import RooflineCostModel, build
from eldr_cli.simulator.core import step_time


def _cases():
    rng = np.random.default_rng(7)
    _, _, r, _ = build("Qwen3-30B-A3B", device="H100-SXM")
    _, _, mav, _ = build("Llama-4-Maverick", device="H200", dtype="fp8")
    forms = [r.step_terms(), mav.step_terms(), CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, e_ms=0.01, d_ms=0.003)
             .step_terms(8, 0.5), tuple(rng.uniform(0, 2, 7)) + (1.0,), tuple(rng.uniform(0, 2, 7)) + (0.0,),
             (0.1, 0.001, 0.0, 0.5, 1e-7, 0.05, 1e-6, 1.0)]  # compute-bound from ~10 requests
    for t in forms:
        for _ in range(50):
            yield tuple(float(x) for x in t), float(rng.integers(0, 6000)), float(rng.integers(0, 512)), \
                float(rng.integers(0, 2_000_000))


def test_compiled_and_plain_forms_agree_exactly():
    n = roofed = 0
    for terms, a, b, c in _cases():
        plain = float(step_ms_from_terms(terms, a, b, c))
        assert step_time(np.asarray(terms), a, b, c) == plain
        # the roof binds in some cases, not all: both branches are compared
        roofed += terms[7] != 0 and terms[5] * b + terms[6] * c > terms[3] + terms[1] * a + terms[4] * c
        n += 1
    assert n == 300 and 0 < roofed < n


def test_numpy_arrays_over_decoders_give_each_decoders_scalar_step():
    for terms, a, b, c in list(_cases())[::25]:
        A, B, C = np.array([a, 0.0, a / 2]), np.array([b, 1.0, b + 3]), np.array([c, 0.0, c / 3])
        got = step_ms_from_terms(terms, A, B, C)
        assert got.tolist() == [float(step_ms_from_terms(terms, x, y, z)) for x, y, z in zip(A, B, C, strict=True)]


def test_cost_models_step_ms_is_the_formula():
    lin = CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05, e_ms=0.01, d_ms=0.003)
    # the linear model's documented form, by hand: L*(a + c*ts*tokens + e + d*tokens) + b*A
    assert lin.step_ms(40, 8, 16, 0.5) == pytest.approx(8 * (0.2 + 0.05 * 0.5 * 16 + 0.01 + 0.003 * 16) + 0.5 * 40,
                                                        rel=1e-12)
    _, _, r, _ = build("Qwen3-30B-A3B", device="H100-SXM")
    cm = RooflineCostModel(a_ms=0, b_ms=0, c_ms=0, roofline=r)
    ctx = [300, 5000, 17]
    assert cm.step_ms(333, 48, 3, context=ctx) == r.step_ms(333, ctx) == float(
        step_ms_from_terms(r.step_terms(), 333, 3, sum(ctx)))


def test_scaled_cost_moves_only_the_per_expert_and_fixed_terms():
    from eldr_cli.costmodel import ScaledCostModel

    _, _, r, _ = build("Qwen3-30B-A3B", device="H100-SXM")
    base = RooflineCostModel(a_ms=0, b_ms=0, c_ms=0, roofline=r, deployment={"kv_capacity_tokens": 5})
    s = ScaledCostModel(base, 1.25, 0.75)
    t, u = base.step_terms(48), s.step_terms(48)
    assert u[0] == t[0] * 0.75 and u[1] == t[1] * 1.25 and u[2:] == t[2:]
    assert s.deployment == {"kv_capacity_tokens": 5} and s.ep_ranks == 1
    assert s.step_ms(300, 48, 4, context=[100] * 4) == float(step_ms_from_terms(u, 300, 4, 400.0))


def test_a_replay_with_a_true_cost_keeps_the_routers_prediction(tmp_path):
    from eldr_cli.artifacts.trace import read_trace
    from eldr_cli.costmodel import ScaledCostModel
    from eldr_cli.main import run as eldr
    from eldr_cli.simulator.replay import TraceReplay

    assert eldr(["synth-trace", "--out", str(tmp_path / "t"), "--requests", "20", "--layers", "4", "--experts", "16",
                 "--top-k", "2", "--decode-steps", "4", "--picks"]) == 0
    cm = CostModel(a_ms=0.5, b_ms=0.1, c_ms=0.005)
    rp = TraceReplay(read_trace(tmp_path / "t"), cm)
    moved = rp.with_true_cost(ScaledCostModel(cm, 1.25, 1.0))
    rows, done = np.array([0, 1, 2]), np.array([0, 1, 2])
    ms, a = rp.decode_step_ms(rows, done)
    ms2, a2 = moved.decode_step_ms(rows, done)
    assert a == a2 and ms2 == pytest.approx(ms + 0.25 * 0.1 * a, rel=1e-12)
    assert moved.predicted_cost is cm and rp.cost is cm and rp.terms != moved.terms
