"""How much `eldr report`'s verdict rests on the cost model (issue 29 item 5). SIMULATED.

The headline router's capacity gain over the best load balancer is recomputed (same SLO, seeds, arrivals and
starting rate) with the cost of one charged expert and, separately, the fixed per-step cost moved by -25% and
+25%. The steps are timed with the moved cost while a cost-aware router (eldr-live) keeps predicting with the
cost model it was given: a GPU that differs from the model by that much. The load balancer is the one that
was best at the unmoved cost (only it and the headline router are searched again, to keep the report's time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from eldr_cli.report.capacity import SLO, find_capacity
from eldr_cli.report.study import SimSetup, Study
from eldr_cli.report.verdict import capacity_gain, fmt_change
from eldr_cli.stats import Interval, interval_json

SCALES = ((0.75, 1.0), (1.25, 1.0), (1.0, 0.75), (1.0, 1.25))  # (per-expert, fixed)


def sensitivity(setup: SimSetup, study: Study, slo: SLO, seeds: list[int], start: float,
                router: str | None) -> list[dict]:
    """[{per_expert_scale, fixed_scale, router, vs, capacity_gain_pct {mean, ci95}}], the unmoved cost first."""
    from eldr_cli.costmodel import ScaledCostModel

    if router is None or study.status != "ok":
        return []
    best = study.best_lb
    out = [{"per_expert_scale": 1.0, "fixed_scale": 1.0, "router": router, "vs": best,
            "capacity_gain_pct": interval_json(capacity_gain(study, router)[0], 2)}]
    arrivals = {s: setup.arrivals(s) for s in seeds}  # the study's: same seeds, same burstiness
    for pe, fx in SCALES:
        moved = replace(setup, replay=setup.replay.with_true_cost(ScaledCostModel(setup.replay.cost, pe, fx)))
        caps = {r: [find_capacity(_check(moved, arrivals[s], slo, r, s), start) for s in seeds]
                for r in (router, best)}
        gain, _ = capacity_gain(Study(caps, best), router)
        out.append({"per_expert_scale": pe, "fixed_scale": fx, "router": router, "vs": best,
                    "capacity_gain_pct": interval_json(gain, 2)})
    return out


def _check(setup: SimSetup, arrivals, slo: SLO, router: str, seed: int) -> Callable[[float], tuple[bool, str | None]]:
    from eldr_cli.report.study import measure

    return lambda rate: slo.check(measure(setup, arrivals, router, rate, seed))


def sensitivity_text(rows: list[dict]) -> str:
    """One sentence: the headline gain at each moved cost."""
    if len(rows) < 2:
        return ""

    def say(r: dict) -> str:
        what = (f"per-expert cost x{r['per_expert_scale']:g}" if r["per_expert_scale"] != 1.0
                else f"fixed cost x{r['fixed_scale']:g}")
        return f"{what}: {fmt_change(Interval.from_json(r['capacity_gain_pct']))}"

    return (f" How much this rests on the cost model: {rows[0]['router']}'s capacity gain over {rows[0]['vs']} with "
            "the GPU's costs moved while the router keeps the model's, " + "; ".join(say(r) for r in rows[1:]) + ".")
