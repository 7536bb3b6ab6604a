"""Decoders that exist: a decoder's running batch is capped by its KV capacity in tokens (the simulator's
DecodePool and the emulator's DecodeWorker, same rule), and with expert parallelism a step is charged
the busiest rank's experts (METRO's metric), counted from the step's expert bit sets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from eldr_cli.costmodel import CostModel
from eldr_cli.simulator.core import DecodePool, busiest_rank_active
from eldr_cli.simulator.replay import _pack_picks, charged_counts


@dataclass(frozen=True)
class EPCost(CostModel):
    """A linear cost model of an instance with 4 expert-parallel ranks."""

    @property
    def ep_ranks(self) -> int:
        return 4


def fake_replay(picks: list, prompt_tokens: int, cost: CostModel, L: int, E: int):
    """A replay of one decode step per request; ``picks`` int [n, L, k] expert ids (request i = row i)."""
    masks = _pack_picks(np.asarray(picks), L, E)
    n = len(picks)
    return SimpleNamespace(steps=np.ones(n, dtype=np.int64), offsets=np.arange(n + 1, dtype=np.int64),
                           decode_masks=masks, prompt_tokens=np.full(n, prompt_tokens, dtype=np.int64),
                           cost=cost, n_layers=L, num_experts=E, token_scale=1.0)


def run_pool(replay, n: int, max_tokens: int, cap: int | None):
    pool = DecodePool(replay, 1, np.arange(n), np.full(n, max_tokens), np.ones(n, dtype=bool), kv_capacity_tokens=cap)
    for rid in range(n):
        pool.admit(0, rid, 0.0)
    pool.advance(np.inf)
    return pool, pool.step_log()


CONST = CostModel(a_ms=1.0, b_ms=0.0, c_ms=0.0, source="given")  # 2 ms per step at L=2, whatever the batch


def test_kv_capped_decoder_queues_instead_of_over_running():
    # 5 requests of 10 prompt tokens + 6 output tokens: context + the token a step writes stays within one
    # 16-token block, so a 48-token pool (3 blocks) runs 3. All arrive at t=0; the idle worker starts a
    # step with the first at once (2 ms per step), the others join at its end as the pool allows
    rp = fake_replay([[[0], [0]]] * 5, 10, CONST, L=2, E=8)
    pool, log = run_pool(rp, 5, 6, cap=48)
    assert max(log["batch"]) == 3 and pool.preemptions == 0
    assert log["batch"].tolist() == [1] + [3] * 6 + [2] * 5 + [1]
    # r3 waits in the queue until r0 finishes (12 ms): its TTFT includes the wait, its TPOT does not
    np.testing.assert_allclose(pool.req_first * 1e3, [2, 4, 4, 14, 16])
    np.testing.assert_allclose(pool.req_finish * 1e3, [12, 14, 14, 24, 26])
    # one token less is 2 blocks: only 2 at a time
    _, log47 = run_pool(rp, 5, 6, cap=47)
    assert max(log47["batch"]) == 2 and len(log47["batch"]) == 18
    # no cap: all 5 run at once, the same as a cap that holds them all
    _, free = run_pool(rp, 5, 6, cap=None)
    _, roomy = run_pool(rp, 5, 6, cap=80)
    assert free["batch"].tolist() == [1] + [5] * 5 + [4] == roomy["batch"].tolist()
    # a request larger than the whole pool runs alone rather than never
    _, tiny = run_pool(rp, 2, 6, cap=5)
    assert tiny["batch"].tolist() == [1] * 12


# 2 ms per step at L=2 plus 0.2 ms per token (a recomputed context costs its tokens)
PER_TOKEN = CostModel(a_ms=1.0, b_ms=0.0, c_ms=0.1, source="given")


def test_a_request_that_outgrows_the_pool_is_preempted_and_recomputes():
    # prompts of 14 tokens, 8 output tokens, a 2-block pool. r0 runs alone (1 block), then r1 joins
    # (1 + 1); at r0's 3rd step its 14 + 2 + 1 tokens need a 2nd block: r1 (the latest) is preempted,
    # waits for r0 to finish, then recomputes its 14 + 1 tokens in its first step back
    rp = fake_replay([[[0], [0]]] * 2, 14, PER_TOKEN, L=2, E=8)
    pool, log = run_pool(rp, 2, 8, cap=32)
    assert pool.preemptions == 1
    assert log["batch"].tolist() == [1, 2] + [1] * 13
    one, two, back = 2 * (1 + 0.1), 2 * (1 + 0.2), 2 * (1 + 0.1 * 16)
    np.testing.assert_allclose(log["step_ms"], [one, two] + [one] * 6 + [back] + [one] * 6)
    np.testing.assert_allclose(pool.req_first * 1e3, [one, one + two])
    np.testing.assert_allclose(pool.req_finish * 1e3, [one + two + 6 * one, one + two + 6 * one + back + 6 * one])
    assert pool.req_ntok.tolist() == [8, 8]


def _emulate(replay, n: int, prompt: int, max_tokens: int, cap, first_alone: bool = False):
    """(batch sizes, step ms, preemptions) of an emulated decode worker given n requests at once. The worker's
    task first runs at the first await: plain submits all land before its first step; with ``first_alone`` the
    first request is submitted, the worker starts its step with it alone, and the others land during that step
    (the simulator's order: an idle decoder starts a step with its first admission at once)."""
    from eldr_cli.emulator.workers import DecodeRequest, DecodeWorker

    async def main():
        w = DecodeWorker(0, replay, "m", "127.0.0.1", 0, kv_capacity_tokens=cap)
        w.start()
        reqs = [DecodeRequest(0, max_tokens, True, prompt) for _ in range(n)]
        for i, r in enumerate(reqs):
            w.submit(r)
            if first_alone and i == 0:
                await asyncio.sleep(0)  # the worker's task runs up to its first step's sleep, with r0 alone
        for r in reqs:
            while not await r.queue.get():
                pass
        await w.stop()
        return [s[1] for s in w.steps], [s[3] for s in w.steps], w.preemptions

    return asyncio.run(main())


def test_emulated_decode_worker_applies_the_same_rule():
    def step_ms(rows, done, recompute):  # PER_TOKEN's step at L=2
        return 2 * (1 + 0.1 * (len(rows) + recompute)), 0

    replay = SimpleNamespace(cost=CONST, wraps=lambda row, m: False, decode_step_ms=step_ms)
    # in the simulator's order the emulator's batch sequence is the simulator's, step for step
    for n, prompt, max_tokens, cap in ((5, 10, 6, 48), (5, 10, 6, 47), (5, 10, 6, None), (2, 14, 8, 32)):
        cost = PER_TOKEN if cap == 32 else CONST
        pool, log = run_pool(fake_replay([[[0], [0]]] * n, prompt, cost, L=2, E=8), n, max_tokens, cap=cap)
        batches, ms, pre = _emulate(replay, n, prompt, max_tokens, cap, first_alone=True)
        assert batches == log["batch"].tolist() and pre == pool.preemptions, (n, cap)
        if cap == 32:  # r1's first step back recomputes its 14 + 1 tokens, as in the simulator
            assert pre == 1 and np.allclose(ms, log["step_ms"])
    # all submitted before the first step: the pool's 3 slots fill at once, the other 2 follow
    batches, _, pre = _emulate(replay, 5, 10, 6, 48)
    assert batches == [3] * 6 + [2] * 6 and pre == 0
    assert _emulate(replay, 5, 10, 6, None)[0] == [5] * 6


def _count_by_hand(masks: np.ndarray, L: int, E: int, ep: int) -> int:
    per = E // ep
    bits = [(int(masks[(l * E + e) // 64]) >> ((l * E + e) % 64)) & 1 for l in range(L) for e in range(E)]
    return sum(max(sum(bits[l * E + r * per + j] for j in range(per)) for r in range(ep)) for l in range(L))


def test_busiest_rank_count_on_a_hand_made_batch():
    # L=2, E=8, EP=4 (rank r holds experts 2r, 2r+1), top-2; three requests in one step (row 0 activates
    # nothing: the idle worker's first step takes it alone, the three join at that step's end)
    picks = [[[-1, -1], [-1, -1]],
             [[0, 1], [0, 7]],
             [[1, 4], [1, 6]],
             [[0, 5], [0, 1]]]
    # union: layer 0 {0,1,4,5} (rank 0: 2, rank 2: 2) -> 2; layer 1 {0,1,6,7} (rank 0: 2, rank 3: 2) -> 2
    rp = fake_replay(picks, 1, EPCost(a_ms=0.5, b_ms=1.0, c_ms=0.1, source="given"), L=2, E=8)
    u = np.bitwise_or.reduce(rp.decode_masks, axis=0)
    assert busiest_rank_active(u.copy(), 2, 8, 4) == 4 == charged_counts(u, 2, 8, 4)[0]
    assert charged_counts(u, 2, 8, 1)[0] == 8  # the union (EP 1)
    _, log = run_pool(rp, 4, 1, cap=None)
    assert log["batch"].tolist() == [1, 3]
    assert log["active_experts"].tolist() == [0, 8] and log["charged_experts"].tolist() == [0, 4]
    # the step charges the busiest rank: 2 layers x 0.5 + 1.0 x 4 experts + 2 layers x 0.1 x 3 tokens
    assert log["step_ms"][1] == pytest.approx(2 * 0.5 + 4 * 1.0 + 2 * 0.1 * 3)


@pytest.mark.parametrize("L,E,ep", [(3, 48, 4), (2, 128, 8), (4, 20, 5), (2, 96, 2)])
def test_busiest_rank_count_across_word_boundaries(L, E, ep):
    rng = np.random.default_rng(L * E + ep)
    picks = rng.integers(0, E, size=(6, L, 3))
    masks = _pack_picks(picks, L, E)
    want = [_count_by_hand(m, L, E, ep) for m in masks]
    assert charged_counts(masks, L, E, ep).tolist() == want
    assert [busiest_rank_active(m.copy(), L, E, ep) for m in masks] == want


def test_one_kv_rule_for_the_emulator_by_hand():
    """simulator.core.schedule_kv (the emulator's entry to the simulator's compiled rule), blocks of 16 tokens
    holding context + the token the step writes."""
    from eldr_cli.simulator.core import schedule_kv

    # 3 running of 20 tokens need 2 blocks each: 6 > 4, the latest is preempted, nothing admitted
    assert schedule_kv([20, 20, 20], [1], 4, 256) == (2, 0)
    # 1 running (1 block); FIFO: 10 tokens fits (1 block), the next needs 3 and does not: the head waits
    assert schedule_kv([10], [10, 40, 10], 4, 256) == (1, 1)
    # max_seqs bounds the batch; an empty worker admits its head even when it alone overflows the pool
    assert schedule_kv([], [10, 10, 10], 100, 2) == (0, 2)
    assert schedule_kv([], [500, 10], 4, 256) == (0, 1)
    # a lone running request is never preempted
    assert schedule_kv([500], [10], 4, 256) == (1, 0)
