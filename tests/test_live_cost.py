"""eldr-live's predicted cost against numbers worked out by hand (tests of issue 31, item 4).

Two decoders, one layer of four experts, two prototypes: prototype 0 decodes on experts {0, 1}, prototype 1
on {2, 3}, each picked with probability 0.5 per step. Decoder 0 runs two requests of prototype 0, decoder 1
one of prototype 1. A new request of prototype 0 arrives. Per decoder (routing/live.py's docstring)::

    q_0 = (0.25, 0.25, 1, 1)  A_0 = 1.5   dA_0 = 0.25 * 0.5 * 2 = 0.25
    q_1 = (1, 1, 0.5, 0.5)    A_1 = 1.0   dA_1 = 1 * 0.5 * 2    = 1.0
    T_d = const + kt B_d + kb A_d     T'_d = const + kt (B_d + 1) + kb (A_d + dA_d)
    cost_d = T'_d + B_d (T'_d - T_d)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from eldr_cli.costmodel import CostModel
from eldr_cli.routing import RoutingModel, make_router
from eldr_cli.routing.live import EldrLivePolicy, LiveDetail, step_form

PROTO0 = np.array([1.0, 0.0, 0.0, 0.0])  # nearest prototype: 0


def _policy(cost, tokens: tuple[int, int, int] = (0, 0, 0)) -> EldrLivePolicy:
    protos = np.array([[1.0, 0, 0, 0], [0, 0, 1.0, 0]])
    act = np.array([[[0.5, 0.5, 0, 0]], [[0, 0, 0.5, 0.5]], [[0.25, 0.25, 0.25, 0.25]]], dtype=np.float32)
    model = RoutingModel("count", np.ones((1, 4)), np.arange(1), np.eye(2, 4), live=(protos, act))
    pol = make_router("eldr-live", 2, model=model, cost=cost).policy
    assert isinstance(pol, EldrLivePolicy)
    for key, (w, m, tok) in enumerate([(0, 0, tokens[0]), (0, 0, tokens[1]), (1, 1, tokens[2])]):
        pol.on_dispatch(w, key, LiveDetail(pol.live.source.entries[m], tok))
    return pol


def test_linear_cost_model_two_decoders_by_hand():
    # const = a = 1, kb = b = 0.5, kt = c = 0.1 (one layer)
    pol = _policy(CostModel(a_ms=1.0, b_ms=0.5, c_ms=0.1, source="given"))
    np.testing.assert_allclose(pol.idle_probabilities(), [[0.25, 0.25, 1, 1], [1, 1, 0.5, 0.5]])
    np.testing.assert_allclose(pol.live.view()[1], [1.5, 1.0])
    # T_0 = 1 + 0.2 + 0.75 = 1.95, T'_0 = 1 + 0.3 + 0.875 = 2.175, cost_0 = 2.175 + 2 * 0.225 = 2.625
    # T_1 = 1 + 0.1 + 0.5  = 1.6,  T'_1 = 1 + 0.2 + 1.0   = 2.2,   cost_1 = 2.2   + 1 * 0.6   = 2.8
    r = pol.rank([2, 1], PROTO0)
    assert r.first == 0  # 2.8 is 6.7% above 2.625: no tie even at low load
    np.testing.assert_allclose(r.predicted_ms, [2.625, 2.8], rtol=1e-6)
    assert r.detail.prototype == 0


def test_near_idle_costs_within_3_percent_are_ties_under_load_the_least_cost_wins():
    pol = _policy(CostModel(a_ms=100.0, b_ms=0.5, c_ms=0.1, source="given"))
    # loads 2 + 1 < 4 per decoder: near idle. cost_0 = 101.175 + 2 * 0.225 = 101.625, cost_1 = 101.2 + 0.6 = 101.8
    # (0.17% apart): a tie, which goes to fewer in flight, decoder 1
    r = pol.rank([2, 1], PROTO0)
    assert r.first == 1
    np.testing.assert_allclose(r.predicted_ms, [101.625, 101.8], rtol=1e-6)
    # loads 5 + 4 >= 4 per decoder (the caller's B_d): T_0 = 101.25, T'_0 = 101.475, cost_0 = 101.475 + 5 * 0.225
    # = 102.6; T_1 = 100.9, T'_1 = 101.5, cost_1 = 101.5 + 4 * 0.6 = 103.9: 1.3% apart, the cheaper one wins
    r = pol.rank([5, 4], PROTO0)
    assert r.first == 0
    np.testing.assert_allclose(r.predicted_ms, [102.6, 103.9], rtol=1e-6)
    # equal costs and loads: the decoder sent a request longest ago (decoder 0 got the first two, 1 the last)
    fresh = _policy(CostModel(a_ms=1.0, b_ms=0.0, c_ms=0.0, source="given"))
    assert fresh.rank([1, 1], PROTO0).first == 0


@dataclass(frozen=True)
class _EP2(CostModel):
    @property
    def ep_ranks(self) -> int:
        return 2


def test_expert_parallelism_spreads_the_union_over_the_ranks():
    # EP 2: a step charges A / 2 experts per rank, so kb = 0.5 / 2 = 0.25. Loads 5 and 4:
    # T_0 = 1 + 0.5 + 0.375 = 1.875, T'_0 = 1 + 0.6 + 0.4375 = 2.0375, cost_0 = 2.0375 + 5 * 0.1625 = 2.85
    # T_1 = 1 + 0.4 + 0.25  = 1.65,  T'_1 = 1 + 0.5 + 0.5    = 2.0,    cost_1 = 2.0    + 4 * 0.35   = 3.4
    pol = _policy(_EP2(a_ms=1.0, b_ms=0.5, c_ms=0.1, source="given"))
    r = pol.rank([5, 4], PROTO0)
    assert r.first == 0
    np.testing.assert_allclose(r.predicted_ms, [2.85, 3.4], rtol=1e-6)
    # without EP the same case costs 3.6 and 4.9
    pol = _policy(CostModel(a_ms=1.0, b_ms=0.5, c_ms=0.1, source="given"))
    r = pol.rank([5, 4], PROTO0)
    np.testing.assert_allclose(r.predicted_ms, [3.6, 4.9], rtol=1e-6)


class _StepForm:
    """A given roofline-shaped cost model: step = const + max(m0 + kb A + kv C, kc B + ka C) + kt B."""

    def __init__(self, terms, ep: int = 1):
        self.terms, self.ep = terms, ep

    def step_terms(self, n_layers, token_scale=1.0):
        return self.terms

    def spread_active(self, active_total):
        return active_total / self.ep


@pytest.mark.parametrize("kc,want,choice", [
    # memory-bound (kc = 1: the roof 1 B stays below memory). Contexts: decoder 0 holds 50 + 50 tokens, decoder 1
    # 300, the new request brings 100. mem_0 = 2 + 0.75 + 1 = 3.75, mem'_0 = 3.75 + 0.125 + 1 = 4.875:
    # T_0 = 4.75, T'_0 = 5.875, cost_0 = 5.875 + 2 * 1.125 = 8.125; mem_1 = 2 + 0.5 + 3 = 5.5, mem'_1 = 5.5 + 0.5
    # + 1 = 7: T_1 = 6.5, T'_1 = 8, cost_1 = 8 + 1.5 = 9.5
    (1.0, [8.125, 9.5], 0),
    # compute-bound on decoder 0 (kc = 3: 3 B = 6 > 3.75, then 9 > 4.875): T_0 = 7, T'_0 = 10, cost_0 = 10 + 2 * 3
    # = 16; decoder 1 stays memory-bound (3 < 5.5, 6 < 7): cost_1 = 9.5, the choice moves to decoder 1
    (3.0, [16.0, 9.5], 1)])
def test_roofline_step_form_with_kv_and_the_compute_roof_by_hand(kc, want, choice):
    # (const, kb, kt, m0, kv, kc, ka, roof) = (1, 0.5, 0, 2, 0.01, kc, 0, 1)
    pol = _policy(_StepForm((1.0, 0.5, 0.0, 2.0, 0.01, kc, 0.0, 1.0)), tokens=(50, 50, 300))
    r = pol.rank([2, 1], PROTO0, tokens=100)
    assert r.first == choice
    np.testing.assert_allclose(r.predicted_ms, want, rtol=1e-6)
    assert r.detail.tokens == 100


def test_step_form_of_a_real_roofline_with_ep_divides_the_expert_term(tmp_path):
    from eldr_cli.costmodel.roofline import run_cost_model

    run_cost_model(tmp_path / "cm", "Qwen3-30B-A3B", device="H100-SXM", tp=1, ep=2)
    cost = CostModel.load(tmp_path / "cm")
    assert cost.ep_ranks == 2
    terms = cost.step_terms(48, 1.0)
    got = step_form(cost, 48)
    assert got[1] == pytest.approx(terms[1] / 2) and got[0] == terms[0] and got[2:] == tuple(terms[2:])
