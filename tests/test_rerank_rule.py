"""One re-ranking rule (issue 36): eldr-live's choice and the replicas' reservation follow
:func:`eldr_cli.routing.policies.rerank`. The reservation's Lua script runs in a real redis-server on a few
thousand random rankings and counts (peers, caps, forged values, cost ties, slack) and must name the same worker
as the Python rule every time; eldr-live's choice is the rule on its own costs and loads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import redis as redis_py

from eldr_cli.proxy.replicas.redis_server import RedisServer
from eldr_cli.proxy.replicas.reserve import MAX_IN_FLIGHT, SELECT, Costs, select_args
from eldr_cli.routing.policies import Ranking, rerank

CASES = 3000
KEY = "t:reserved"


@pytest.fixture(scope="module")
def select():
    with RedisServer() as srv:
        r = redis_py.Redis(host=srv.host, port=srv.port)
        yield r, r.register_script(SELECT)
        r.close()


def _field(rng: random.Random) -> int | str:
    """A reservation count as Redis may hold it: mostly small integers, sometimes a value the script ignores."""
    return rng.choice([0, 0, 1, 2, 3, 4, 5, 7, "x", "nan", -1, MAX_IN_FLIGHT + 1])


def _counted(v: int | str, cap: int) -> int:
    """What the script counts of one field: an integer in 0..MAX_IN_FLIGHT, up to its cap; anything else: 0."""
    return min(v, cap) if isinstance(v, int) and 0 <= v <= MAX_IN_FLIGHT else 0


def _case(rng: random.Random) -> tuple[Ranking, list[int], list[int], dict[str, int | str], list]:
    """A random ranking over n workers, the loads its decision saw, the fields in Redis and the script's ARGV;
    returns the exact counts the script will read (per worker) too."""
    n = rng.randint(1, 8)
    order = list(range(n))
    rng.shuffle(order)  # the rule's tie order: any permutation of the workers
    seen = [rng.randint(0, 6) for _ in range(n)]
    slack = rng.choice([0, 0, 1, 2, 3])
    if rng.random() < 0.3:  # a rule without costs (the band, JSQ)
        ranking = Ranking(order[0], slack=slack, candidates=tuple(order))
    else:  # costs drawn from a few values so that ties within `tie` are common; growth may move them
        cost = np.array([rng.choice([0.0, 1.0, 1.02, 1.05, 1.5, 2.0, 3.25]) * rng.choice([1, 1, 7.3])
                         for _ in range(n)])
        growth = np.array([rng.choice([0.0, 0.01, 0.3, 1.0]) for _ in range(n)])
        tie = rng.choice([0.0, 1e-9, 0.03, 0.1, 0.5])
        if n > 1 and rng.random() < 0.3:  # one cost exactly at the edge of another's ties (the same float product)
            a, b = rng.sample(range(n), 2)
            cost[b] = cost[a] * (1 + tie)
        ranking = Ranking(order[0], slack=slack, candidates=tuple(order), predicted_ms=cost, growth_ms=growth,
                          tie=tie)
    keys = [f"decode|http://w{k}" for k in order]
    peers = [f"p{i}" for i in range(rng.randint(0, 3))]
    caps = [rng.randint(0, 8) for _ in peers for _ in order]
    own = [rng.randint(0, 8) for _ in order]
    fields: dict[str, int | str] = {}
    exact = [0] * n
    for j, k in enumerate(order):
        v = _field(rng)
        fields[f"me|{keys[j]}"] = v
        exact[k] += _counted(v, own[j])
        for i, p in enumerate(peers):
            v = _field(rng)
            fields[f"{p}|{keys[j]}"] = v
            exact[k] += _counted(v, caps[i * n + j])
    costs = None
    if ranking.predicted_ms is not None and ranking.growth_ms is not None:
        costs = Costs([float(ranking.predicted_ms[k]) for k in order], [float(ranking.growth_ms[k]) for k in order],
                      [seen[k] for k in order], ranking.tie)
    args = select_args("me", slack, peers, keys, caps, own, costs)
    return ranking, seen, exact, fields, args


def test_the_reservation_script_follows_the_rule_on_random_rankings_and_counts(select):
    r, script = select
    rng = random.Random(36)
    mismatches = []
    for case in range(CASES):
        ranking, seen, exact, fields, args = _case(rng)
        order = list(ranking.candidates or ())
        want = ranking.rerank(exact, seen)
        pipe = r.pipeline()
        pipe.delete(KEY)
        pipe.hset(KEY, mapping=fields)
        script(keys=[KEY], args=args, client=pipe)
        got = order[int(pipe.execute()[-1][0])]
        if got != want:
            mismatches.append((case, ranking, seen, exact, got, want))
    r.delete(KEY)
    assert not mismatches, f"{len(mismatches)} of {CASES} differ; first: {mismatches[0]}"


def test_the_rule_without_costs_is_the_first_in_order_within_the_slack():
    assert rerank([0.0, 1.0, 2.0], [2, 0, 1], 2, 0.0, [0, 1, 2]) == 0  # 2 <= 0 + 2: the first stays
    assert rerank([1.0, 0.0, 2.0], [3, 0, 1], 2, 0.0, [1, 0, 2]) == 1  # worker 0 over the cap
    assert Ranking(2, slack=0, candidates=(2, 0, 1)).rerank([1, 1, 1]) == 2  # all even: the first in order


def test_the_rule_breaks_cost_ties_by_fewest_in_flight_then_order():
    cost = [1.0, 1.02, 1.5, 1.0]
    assert rerank(cost, [1, 0, 0, 1], 2, 0.03, [0, 1, 2, 3]) == 1  # 1.02 ties 1.0 at 3%: fewer in flight wins
    assert rerank(cost, [1, 0, 0, 1], 2, 0.0, [0, 1, 2, 3]) == 0  # no tie: the least cost, first in order
    assert rerank(cost, [1, 0, 0, 1], 2, 0.0, [3, 0, 1, 2]) == 3  # ... the order decides between equal costs
    assert rerank(cost, [3, 0, 0, 1], 2, 0.0, [0, 1, 2, 3]) == 3  # worker 0 is over the cap (0 + 2)


def test_eldr_lives_choice_is_the_rule_on_its_costs_and_its_tie_order():
    """eldr-live's first choice is, on its own predicted costs and the loads it saw, the least cost within the load
    cap, costs within ``tie`` ties, then fewest in flight, then the decoder sent a request longest ago (then the
    lower index: eldr-live's rule as it was written before the rule was shared); its candidates are that tie order;
    and the reservation on those same loads keeps its choice."""
    from eldr_cli.routing import RoutingModel, make_router

    L, E, K, M = 4, 16, 5, 6
    rng = np.random.default_rng(7)
    act = rng.uniform(0, 0.6, size=(M + 1, L, E)).astype(np.float32)
    model = RoutingModel("count", np.ones((L, E)), np.arange(L), np.eye(K, L * E), live=(rng.random((M, L * E)), act))
    router = make_router("eldr-live", K, model=model)
    pol = router.policy
    live: list[tuple[int, int]] = []
    for i in range(600):
        loads = [0] * K
        for w, _ in live:
            loads[w] += 1
        sig = rng.random(L * E)
        r = pol.rank(loads, sig, tokens=int(rng.integers(0, 500)))
        cost, seq = r.predicted_ms.tolist(), list(pol.live.last_add)
        cap = min(loads) + r.slack
        lim = min(cost[k] for k in range(K) if loads[k] <= cap) * (1 + r.tie)
        assert r.first == min((k for k in range(K) if loads[k] <= cap and cost[k] <= lim),
                              key=lambda k: (loads[k], seq[k], k))
        assert list(r.candidates) == sorted(range(K), key=lambda k: (seq[k], k))
        assert r.rerank(loads) == r.first
        pol.on_dispatch(r.first, i, r.detail)
        live.append((r.first, i))
        while live and rng.random() < 0.45:
            w, key = live.pop(int(rng.integers(len(live))))
            pol.on_finish(w, key)
