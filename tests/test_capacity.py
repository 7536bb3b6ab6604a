"""Capacity at SLO: the paired-seed statistics, the capacity search and the verdict's words."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from eldr_cli.bench.workload import ScaledArrivals
from eldr_cli.errors import EldrError
from eldr_cli.report.capacity import (
    SLO,
    Capacity,
    check_slo_values,
    find_capacity,
)
from eldr_cli.report.study import LoadRuns, Study
from eldr_cli.report.verdict import build_verdict, fmt_change, verdict_text
from eldr_cli.stats import mean_ci, paired_diff_ci, paired_pct_ci


def test_paired_difference_interval_by_hand():
    a, b = [10.0, 12.0, 11.0, 13.0], [9.0, 10.0, 10.0, 11.0]
    iv = paired_diff_ci(a, b)
    # differences 1, 2, 1, 2: mean 1.5, sd 0.57735, se 0.288675, t(0.975, 3 dof) = 3.182446
    assert iv.mean == pytest.approx(1.5)
    assert iv.lo == pytest.approx(1.5 - 3.182446 * 0.288675, abs=1e-5)
    assert iv.hi == pytest.approx(1.5 + 3.182446 * 0.288675, abs=1e-5)
    assert not iv.spans_zero
    # the unpaired interval of a alone is wider than the paired one: pairing removes the seed's own noise
    assert (mean_ci(a).hi - mean_ci(a).lo) > (iv.hi - iv.lo)
    pct = paired_pct_ci([11.0, 22.0], [10.0, 20.0])  # +10% on both seeds: no spread, a zero-width interval
    assert pct.mean == pytest.approx(10.0) and pct.lo == pytest.approx(10.0) and pct.hi == pytest.approx(10.0)
    one = mean_ci([3.0])
    assert one.lo is None and one.spans_zero and "one seed" in fmt_change(one)
    assert mean_ci([]) is None and mean_ci([float("nan")]) is None


@pytest.mark.parametrize("threshold", [0.37, 7.3, 55.0, 210.0])
def test_capacity_search_brackets_a_known_threshold_within_2_percent(threshold):
    seen = []

    def check(rate):
        seen.append(rate)
        return rate <= threshold, (None if rate <= threshold else "tpot")

    c = find_capacity(check, start=10.0)
    assert c.status == "found" and c.binding == "tpot"
    assert c.lo <= threshold < c.hi and c.hi <= 1.02 * c.lo
    assert c.rate == c.lo and (threshold - c.rate) / threshold < 0.02
    assert len(seen) <= 12


def test_capacity_search_says_when_no_rate_or_every_rate_meets_the_slo():
    none = find_capacity(lambda r: (False, "ttft"), start=1.0)
    assert none.status == "none" and none.rate == 0.0 and none.binding == "ttft"
    above = find_capacity(lambda r: (True, None), start=1.0)
    assert above.status == "above" and above.rate == 32.0 and above.hi is None


def test_slo_check_names_the_worse_target():
    slo = SLO(50.0, 1000.0)
    assert slo.check({"tpot_p90_ms": 40.0, "ttft_p90_ms": 900.0}) == (True, None)
    assert slo.check({"tpot_p90_ms": 60.0, "ttft_p90_ms": 3000.0}) == (False, "ttft")
    assert slo.check({"tpot_p90_ms": None, "ttft_p90_ms": 1.0})[0] is False


@pytest.mark.parametrize("args,flag", [((None, None, 0), "--seeds"), ((-1.0, None, 5), "--slo-tpot-ms"),
                                       ((None, 0.0, 5), "--slo-ttft-ms"), ((math.nan, None, 5), "--slo-tpot-ms")])
def test_bad_slo_and_seeds_are_refused(args, flag):
    with pytest.raises(EldrError, match=flag):
        check_slo_values(*args)


def test_scaled_arrivals_are_one_process_for_every_rate():
    arr = ScaledArrivals(7, seed=3)
    s1 = arr.schedule(10.0, duration_s=500.0, warmup_s=100.0)
    s2 = ScaledArrivals(7, seed=3).schedule(20.0, duration_s=250.0, warmup_s=50.0)
    assert len(s1) == len(s2) > 4096  # crosses a block: the sequence does not depend on how far it is read
    assert np.allclose(s1.offsets / 2.0, s2.offsets) and (s1.prompt_index == s2.prompt_index).all()
    assert s1.warmup.sum() == s2.warmup.sum()
    assert not np.allclose(ScaledArrivals(7, seed=4).schedule(10.0, duration_s=10.0).offsets[:5], s1.offsets[:5])


def _study(caps: dict[str, list[float]], tpot: dict[str, list[float]]) -> Study:
    """A hand-made study: capacities per seed and TPOT p50 per seed at every load point."""
    by_load = [LoadRuns(pct, 10.0 * pct / 100, r,
                        [{"tpot_p50_ms": x, "tpot_p99_ms": 2 * x, "ttft_p50_ms": 100.0, "active_experts": 5.0}
                         for x in tpot[r]]) for pct in (25, 50, 75, 100) for r in caps]
    return Study({r: [Capacity(x, "found", x, 1.01 * x, "tpot") for x in xs] for r, xs in caps.items()}, "jsq",
                 10.0, by_load, "ok")


def test_identical_routers_give_no_measurable_difference():
    caps = {"jsq": [10.0, 11.0, 9.5], "eldr": [10.0, 11.0, 9.5]}
    tpot = {"jsq": [20.0, 21.0, 19.0], "eldr": [20.0, 21.0, 19.0]}
    v = build_verdict(_study(caps, tpot), SLO(50.0, 900.0), [0, 1, 2], {})
    g = v["capacity_gain_vs_best_lb_pct"]["eldr"]
    assert g["ci95"][0] <= 0.0 <= g["ci95"][1]
    text = verdict_text(v, "a test cost model", 2, 4, (0.01, 100.0))
    assert "eldr: no measurable difference in capacity" in text
    assert "no measurable difference at 25%, 50%, 75%, 100%" in text
    assert "carries" not in text.split("The best")[1]


def test_verdict_says_where_the_router_helps_and_hurts():
    caps = {"jsq": [10.0, 11.0, 9.5], "eldr": [12.0, 13.1, 11.6], "oracle": [14.0, 15.0, 13.0]}
    tpot = {"jsq": [20.0, 21.0, 19.0], "eldr": [18.0, 18.8, 17.2], "oracle": [15.0, 16.0, 14.0]}
    study = _study(caps, tpot)
    for row in study.by_load:  # eldr hurts at 25% load
        if row.load_pct == 25 and row.router == "eldr":
            for m in row.seeds:
                m["tpot_p50_ms"] = 25.0
    v = build_verdict(study, SLO(50.0, 900.0), [0, 1, 2], {"tp": 8})
    assert v["capacity_gain_vs_best_lb_pct"]["eldr"]["mean"] == pytest.approx(100 * np.mean(
        [12 / 10 - 1, 13.1 / 11 - 1, 11.6 / 9.5 - 1]), abs=0.01)
    saved = v["decode_instances_saved_pct"]["eldr"]["mean"]
    assert saved == pytest.approx(100 * np.mean([1 - 10 / 12, 1 - 11 / 13.1, 1 - 9.5 / 11.6]), abs=0.01)
    text = verdict_text(v, "a test cost model", 2, 4, (0.01, 100.0))
    assert "eldr carries" in text and f"{saved:.0f}% fewer decode instances" in text
    assert "it hurts at 25%" in text and "it helps at 50%, " not in text and "it helps at 50% (" in text
    assert v["tpot_p50_change_vs_best_lb_pct"] < 0 and 0 < v["oracle_share_pct"] <= 100


def test_verdict_words_when_the_slo_is_out_of_reach_or_too_loose():
    study = replace(_study({"jsq": [0.0, 0.0], "eldr": [0.0, 0.0]}, {"jsq": [], "eldr": []}), status="none", by_load=[])
    v = build_verdict(study, SLO(1.0, 2.0), [0, 1], {})
    assert "No router meets this SLO at any rate tried" in verdict_text(v, "cm", 1, 2, (0.01, 100.0))
    v["status"] = "above"
    assert "Every router meets this SLO at the highest rate tried (100 req/s)" in verdict_text(v, "cm", 1, 2,
                                                                                                (0.01, 100.0))


def test_a_defaulted_prefill_pool_that_lets_ttft_bind_is_resized_and_the_search_redone(monkeypatch):
    import eldr_cli.report.study as cs

    calls = []

    def fake_study(setup, names, seeds, slo, start, tally):
        calls.append(setup.n_prefill)
        bind = "ttft" if setup.n_prefill < 20 else "tpot"
        return Study({r: [Capacity(50.0, "found", 50.0, 50.5, bind) for _ in seeds] for r in names}, "jsq")

    monkeypatch.setattr(cs, "run_study", fake_study)
    setup = cs.SimSetup(None, [], np.zeros(0), None, None, n_prefill=10, n_decode=8, max_tokens=16,  # type: ignore[arg-type]
                        duration_s=1.0, warmup_s=1.0)
    notes: list[str] = []
    study, resized = cs.run_sized_study(setup, ["jsq", "eldr"], [0, 1], SLO(80.0, 590.0), 10.0, 100.0, notes)
    # 100 ms prefills at 2 x 50 req/s, at most 35% busy: 29 workers; then TPOT binds and the search stops
    assert calls == [10, 29] and resized.n_prefill == 29 and "redone with 29" in notes[0]
    assert setup.n_prefill == 10  # the setup is a value: the resized one is a new setup
    assert study.capacity["jsq"][0].binding == "tpot"
    calls.clear()
    notes = []
    _, same = cs.run_sized_study(setup, ["jsq"], [0], SLO(80.0, 590.0), 10.0, None, notes)  # --prefill given
    assert calls == [10] and not notes and same is setup  # never resized


def test_each_load_point_compares_against_its_own_lowest_tpot_balancer():
    """Issue 29 item 8: jsq is best by capacity, but at 25% load p2c has the lowest TPOT; round-robin's TPOT
    cannot be told from p2c's there. eldr-live is compared with p2c at 25% (paired), with jsq elsewhere."""
    caps = {"jsq": [10.0, 11.0, 9.5], "p2c": [9.0, 9.9, 8.6], "round-robin": [9.9, 11.1, 9.4],
            "eldr": [12.0, 13.0, 11.0], "eldr-live": [11.0, 12.5, 10.0]}
    tpot = {"jsq": [20.0, 21.0, 19.0], "p2c": [30.0, 31.0, 29.0], "round-robin": [22.0, 23.0, 21.0],
            "eldr": [18.0, 18.8, 17.2], "eldr-live": [19.0, 20.0, 18.0]}
    study = _study(caps, tpot)
    at25 = {"p2c": [15.0, 16.0, 14.0], "round-robin": [15.1, 15.9, 14.2], "eldr-live": [16.0, 17.0, 15.0]}
    for row in study.by_load:
        if row.load_pct == 25 and row.router in at25:
            for m, x in zip(row.seeds, at25[row.router], strict=True):
                m["tpot_p50_ms"] = x
    v = build_verdict(study, SLO(50.0, 900.0), [0, 1, 2], {})
    assert [(b["load_pct"], b["router"]) for b in v["best_lb_by_load"]] == [(25, "p2c"), (50, "jsq"), (75, "jsq"),
                                                                           (100, "jsq")]
    assert v["best_lb_by_load"][0]["indistinguishable_from"] == ["round-robin"]
    assert v["best_lb_by_load"][1]["indistinguishable_from"] == []
    live25 = next(c for c in v["change_vs_best_lb_by_load"] if c["load_pct"] == 25 and c["router"] == "eldr-live")
    assert live25["vs"] == "p2c"  # paired against p2c: (16/15, 17/16, 15/14) - 1, not against jsq
    assert live25["tpot_p50_pct"]["mean"] == pytest.approx(100 * np.mean([16 / 15 - 1, 17 / 16 - 1, 15 / 14 - 1]),
                                                           abs=0.01)
    assert all(c["vs"] == "jsq" for c in v["change_vs_best_lb_by_load"] if c["load_pct"] != 25)
    assert not any(c["router"] == "p2c" for c in v["change_vs_best_lb_by_load"] if c["load_pct"] == 25)
    # eldr-live minus eldr, paired per seed in capacity points of jsq
    d = v["eldr_live_minus_eldr_capacity_pp"]
    assert d["mean"] == pytest.approx(100 * np.mean([-1 / 10, -0.5 / 11, -1 / 9.5]), abs=0.01)
    text = verdict_text(v, "a test cost model", 2, 4, (0.01, 100.0))
    assert "25% p2c (indistinguishable from round-robin), 50% jsq" in text
    assert "it hurts at 25% (vs p2c: " in text
    assert "round-robin cannot be told from it" in text  # the capacity-best jsq was chosen among overlapping ones
    assert v["best_load_balancer_indistinguishable_from"] == ["round-robin"]


@pytest.mark.parametrize("diff, says", [((-2.9, [-5.0, -0.8]), "eldr carries measurably more here"),
                                        ((-2.9, [-6.0, 0.4]), "no measurable difference, so eldr-live"),
                                        ((3.0, [1.0, 5.0]), "eldr-live carries measurably more than eldr")])
def test_decision_gives_the_paired_live_minus_eldr_interval_and_its_reason(diff, says):
    from eldr_cli.report.render import decision

    iv = {"mean": 19.2, "ci95": [15.1, 23.4]}
    v = {"status": "ok", "best_load_balancer": "jsq", "capacity_rps": {"jsq": iv, "eldr": iv, "eldr-live": iv},
         "capacity_gain_vs_best_lb_pct": {"eldr-live": iv, "eldr": iv},
         "eldr_live_minus_eldr_capacity_pp": {"mean": diff[0], "ci95": diff[1]}}
    text = decision({"verdict": v})
    assert text.startswith("Deploy eldr-live") and says in text
    lo, hi = diff[1]
    assert f"eldr-live minus eldr: {diff[0]:+.1f} capacity points (95% CI {lo:+.1f} to {hi:+.1f}" in text


def test_the_sensitivity_searches_on_the_study_s_arrivals(monkeypatch):
    """The moved-cost searches draw the study's arrival process: the same seeds and the same burstiness (a
    decision log's fitted gamma shape), so only the cost differs from the study."""
    from types import SimpleNamespace

    import eldr_cli.report.study as st
    from eldr_cli.costmodel import CostModel
    from eldr_cli.report.sensitivity import sensitivity

    seen = []

    def fake_measure(setup, arrivals, router, rate, seed, tally=None):
        seen.append((arrivals.seed, arrivals.burstiness, seed))
        return {"tpot_p90_ms": rate, "ttft_p90_ms": 1.0}

    monkeypatch.setattr(st, "measure", fake_measure)
    replay = SimpleNamespace(cost=CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05))
    replay.with_true_cost = lambda cost: replay
    setup = st.SimSetup(replay, [None] * 5, np.zeros(5), None, None, n_prefill=1, n_decode=2,  # type: ignore[arg-type]
                        max_tokens=16, duration_s=1.0, warmup_s=1.0, burstiness=0.3)
    study = _study({"jsq": [10.0, 11.0], "eldr": [12.0, 13.0]}, {"jsq": [20.0, 21.0], "eldr": [18.0, 19.0]})
    rows = sensitivity(setup, study, SLO(10.0, 100.0), [0, 1], 5.0, "eldr")
    assert [(r["per_expert_scale"], r["fixed_scale"]) for r in rows][0] == (1.0, 1.0) and len(rows) == 5
    assert {b for _, b, _ in seen} == {0.3}
    assert all(a == s for a, _, s in seen) and {s for _, _, s in seen} == {0, 1}


def test_the_derived_ttft_target_covers_the_p90_prompt_not_the_median_one():
    """A trace whose prompts have a long tail: TTFT's p90 at no load is the p90 prompt's prefill, so a target
    derived from the median prompt would be missed before any queueing; the derived one is above it."""
    from types import SimpleNamespace

    from eldr_cli.costmodel import CostModel
    from eldr_cli.report.capacity import TTFT_SLO_FACTOR, default_slo

    prefill = np.array([10.0] * 80 + [400.0] * 20)  # ms per row: 80% short prompts, 20% long ones
    replay = SimpleNamespace(cost=CostModel(a_ms=0.2, b_ms=0.5, c_ms=0.05), n_layers=4, token_scale=1.0,
                             trace=SimpleNamespace(model={"top_k": 2}), prompt_tokens=np.full(100, 8),
                             prefill_step_ms=lambda rows: (float(prefill[rows[0]]), 1))
    slo = default_slo(replay, np.arange(100), max_tokens=16)
    p90 = float(np.quantile(prefill, 0.9))
    assert slo.ttft_p90_ms >= 0.95 * TTFT_SLO_FACTOR * p90 > p90  # rounded to 2 significant digits
    assert "p90 prompt's prefill step (400.0 ms)" in slo.how
    given = default_slo(replay, np.arange(100), max_tokens=16, ttft_ms=123.0)
    assert given.ttft_p90_ms == 123.0 and "TTFT target" not in given.how
