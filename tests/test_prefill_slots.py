"""The simulator's prefill workers (routing.prefill.PrefillSlots, no connections, no fake URLs) meet the same
PrefixHash choices as the proxy's WorkerPool of as many workers, load fallback included."""

from __future__ import annotations

import random

from eldr_cli.proxy.workers import WorkerPool
from eldr_cli.routing.prefill import PrefillSlots, PrefixHashPrefill


def test_the_simulators_prefill_slots_choose_as_the_proxys_pool():
    chooser = PrefixHashPrefill(block_chars=16, blocks=2, overload=1.25)
    proxy = WorkerPool("prefill", [f"http://127.0.0.1:{9000 + i}" for i in range(5)])
    sim = PrefillSlots(5)
    rng = random.Random(0)
    picks = []
    for _ in range(2000):
        key = f"prompt {rng.randrange(40)} " * rng.randrange(1, 8)
        a, b = chooser.choose(proxy, key), chooser.choose(sim, key)
        i = proxy.workers.index(a)
        assert sim.workers.index(b) == i
        picks.append(i)
        a.inflight += 1
        b.inflight += 1
        j = rng.randrange(5)  # a random prefill ends: loads move, so the overload fallback is exercised too
        if proxy.workers[j].inflight:
            proxy.workers[j].inflight -= 1
            sim.workers[j].inflight -= 1
    assert len(set(picks)) == 5
    sim.workers[0].healthy = proxy.workers[0].healthy = False  # a worker down: neither picks it
    assert all(chooser.choose(sim, f"k{i}") is not sim.workers[0] for i in range(50))
