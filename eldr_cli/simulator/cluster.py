"""One simulated xPyD cluster run in virtual time (`eldr bench simulate`, `eldr report`): arrivals, prefill
queues and batches, the handoff decision by the decode router, and continuous decode batching.

- prefill: PrefixHash with least-loaded fallback (``routing.prefill.PrefixHashPrefill``), FIFO batches up
  to a token budget, step time from the cost model over the batch's prompt experts;
- handoff: the in-flight decode counts are the loads; the decode router built by
  :func:`eldr_cli.routing.make_router` (the proxy's own object) chooses the decoder from the request's
  prefill counts, its domain and the loads, and follows its life (``on_dispatch`` / ``on_finish``);
- decode: :class:`eldr_cli.simulator.core.DecodePool`, continuous batching over replayed per-step picks.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import islice

import numpy as np

from eldr_cli.bench.workload import PromptItem, Schedule
from eldr_cli.routing import DecodeRouter, make_router
from eldr_cli.simulator.replay import TraceReplay, prefill_batch


def _prefill_chooser(n_prefill: int):
    """The proxy's PrefixHash prefill choice (its default block size, blocks and overload factor: the
    proxy's configuration defaults are these) over simulated prefill workers."""
    from eldr_cli.routing.prefill import PrefillSlots, PrefixHashPrefill

    return PrefillSlots(n_prefill), PrefixHashPrefill()


class _PrefillCost:
    """``replay.prefill_step_ms`` for the event loop: the same charged prompt experts (union, or the
    busiest EP rank's) and the same ``cost.step_ms``, compiled, with each row's own count computed once
    (most prefill steps at these loads hold one request)."""

    def __init__(self, replay: TraceReplay):
        from eldr_cli.simulator.core import union_active
        from eldr_cli.simulator.replay import charged_counts

        self.replay, self.union = replay, union_active
        self.geo = (replay.n_layers, replay.num_experts, replay.ep)
        self.single = charged_counts(replay.prefill_masks, *self.geo).tolist()
        self.acc = np.zeros(replay.prefill_masks.shape[1], dtype=np.uint64)

    def __call__(self, rows: list[int], tokens: int) -> float:
        rp = self.replay
        a = self.single[rows[0]] if len(rows) == 1 else \
            int(self.union(rp.prefill_masks, np.array(rows, dtype=np.int64), self.acc, *self.geo))
        return rp.cost.step_ms(a, rp.n_layers, tokens, rp.token_scale)


class _LiveSet:
    """The simulator's side of a stateful router's lifecycle: on_dispatch at admission, on_finish once the
    decode engine has finished the request (checked before every handoff, which is when it matters)."""

    def __init__(self, dec):
        self.dec = dec
        self.rids = np.zeros(0, dtype=np.int64)
        self.new: list[int] = []

    def dispatch(self, router: DecodeRouter, decision, rid: int) -> None:
        router.on_dispatch(decision, rid)
        self.new.append(rid)

    def finish(self, router: DecodeRouter) -> None:
        if self.new:
            self.rids = np.concatenate([self.rids, np.asarray(self.new, dtype=np.int64)])
            self.new = []
        done = np.isfinite(self.dec.req_finish[self.rids])
        if done.any():
            for rid in self.rids[done].tolist():
                router.on_finish(int(self.dec.req_worker[rid]), rid)
            self.rids = self.rids[~done]


class SimulatedCluster:
    """The state of one (router, rate) run: requests, prefill queues, the decode pool and the router."""

    def __init__(self, replay: TraceReplay, prompts: list[PromptItem], schedule: Schedule, *, router: str,
                 n_prefill: int, n_decode: int, max_tokens: int, model=None, tau: float | None = None,
                 seed: int = 0, max_seqs: int = 256, prefill_max_tokens: int = 8192,
                 item_rows: np.ndarray | None = None, oracle=None):
        from eldr_cli.simulator.core import DecodePool

        self.replay, self.prompts, self.schedule, self.name = replay, prompts, schedule, router
        self.max_tokens, self.prefill_max_tokens = max_tokens, prefill_max_tokens
        self.router: DecodeRouter = make_router(router, n_decode, model=model, tau=tau, seed=seed, oracle=oracle,
                                                cost=replay.predicted_cost)
        n = len(schedule)
        if item_rows is not None:
            self.req_row = np.asarray(item_rows, dtype=np.int64)[np.asarray(schedule.prompt_index, dtype=np.int64)]
            self.matched = np.ones(n, dtype=bool)
        else:
            rows_match = [replay.match(prompts[i].prompt) for i in schedule.prompt_index]
            self.req_row = np.array([r for r, _ in rows_match], dtype=np.int64)
            self.matched = np.array([m for _, m in rows_match], dtype=bool)
        self.dec = DecodePool(replay, n_decode, self.req_row, np.full(n, max_tokens), ~schedule.warmup,
                              max_seqs=max_seqs, log_capacity=max(1 << 14, int(n * 8)),
                              kv_capacity_tokens=(replay.cost.deployment or {}).get("kv_capacity_tokens"))
        self.ppool, self.chooser = _prefill_chooser(n_prefill)
        self.pq: list[deque] = [deque() for _ in range(n_prefill)]
        self.busy = [False] * n_prefill
        self.events: list = []
        self.seq = 0
        self.req_tok = replay.prompt_tokens[self.req_row].tolist()
        self.prefill_ms = _PrefillCost(replay)
        self.live = _LiveSet(self.dec) if self.router.stateful else None

    def run(self) -> tuple[dict, dict, dict]:
        """Arrivals and prefill completions in time order, then the decode pool drained."""
        offsets, n, i = self.schedule.offsets, len(self.schedule), 0
        while i < n or self.events:
            if i < n and (not self.events or offsets[i] <= self.events[0][0]):
                self._arrive(i, float(offsets[i]))
                i += 1
                continue
            t, _, p, batch = heapq.heappop(self.events)
            self._handoff(t, p, batch)
        self.dec.advance(np.inf)
        if self.live is not None:
            self.live.finish(self.router)
        return self._columns(), self.dec.step_log(), self._facts()

    def _arrive(self, i: int, t: float) -> None:
        w = self.chooser.choose(self.ppool, self.prompts[self.schedule.prompt_index[i]].prompt)
        p = self.ppool.workers.index(w)
        w.inflight += 1
        self.pq[p].append(i)
        if not self.busy[p]:
            self._start_prefill(p, t)

    def _start_prefill(self, p: int, t: float) -> None:
        q, tok = self.pq[p], self.req_tok
        k = prefill_batch([tok[r] for r in islice(q, 64)], self.prefill_max_tokens)
        batch = [q.popleft() for _ in range(k)]
        ms = self.prefill_ms([int(self.req_row[r]) for r in batch], sum(tok[r] for r in batch))
        self.busy[p] = True
        self.seq += 1
        heapq.heappush(self.events, (t + max(ms, 0.01) / 1e3, self.seq, p, batch))

    def _handoff(self, t: float, p: int, batch: list[int]) -> None:
        """A prefill batch ends at ``t``: each request's decoder is chosen by the router and admitted."""
        router, dec, live = self.router, self.dec, self.live
        self.busy[p] = False
        self.ppool.workers[p].inflight -= len(batch)
        dec.advance(t)
        if live is not None:
            live.finish(router)
        for rid in batch:
            row = int(self.req_row[rid])
            counts = self.replay.prefill_counts(row) if router.needs_signature else None
            d = router.decide(counts, dec.inflight, domain=self.prompts[self.schedule.prompt_index[rid]].domain,
                              key=row, tokens=self.req_tok[rid] + self.max_tokens // 2)
            dec.admit(d.worker, rid, t)
            if live is not None:
                live.dispatch(router, d, rid)
        if self.pq[p]:
            self._start_prefill(p, t)

    def _columns(self) -> dict:
        """Per-request result columns, vectorized (a heavy run has ~15k requests)."""
        sch, dec, n = self.schedule, self.dec, len(self.schedule)
        sent = np.asarray(sch.offsets, dtype=np.float64)
        first, fin, ntok = dec.req_first, dec.req_finish, dec.req_ntok
        ok = np.isfinite(fin)
        pidx = np.asarray(sch.prompt_index, dtype=np.int64)
        doms = np.array([it.domain for it in self.prompts], dtype=object)[pidx]
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(ok & (ntok > 1), (fin - first) * 1e3 / np.maximum(ntok - 1, 1), np.nan)
        return {
            "request_id": [f"sim-{self.name}-{sch.rate:g}-{i}" for i in range(n)], "router": [self.name] * n,
            "request_rate": np.full(n, sch.rate), "prompt_index": pidx, "domain": doms.tolist(),
            "scheduled_s": sent, "sent_s": sent, "lag_ms": np.zeros(n),
            "ttft_ms": np.where(ok, (first - sent) * 1e3, np.nan), "tpot_ms": tpot,
            "e2el_ms": np.where(ok, (fin - sent) * 1e3, np.nan), "itl_ms": None,
            "prompt_tokens": self.replay.prompt_tokens[self.req_row].astype(np.int64),
            "output_tokens": ntok.astype(np.int64), "outcome": np.where(ok, "ok", "incomplete").tolist(),
            "error": None, "warmup": np.asarray(sch.warmup, dtype=bool),
            "decode_worker": dec.req_worker.astype(np.int64)}

    def _facts(self) -> dict:
        # decode steps past a row's captured ones replay its steps again from the first (wrap)
        wrapped = int((self.replay.steps[self.req_row] < self.max_tokens).sum())
        facts = {"unmatched": int((~self.matched).sum()), "matched": int(self.matched.sum()),
                 "wrapped_requests": wrapped, "kv_preemptions": self.dec.preemptions}
        facts.update(self.router.facts())
        return facts


def simulate_run(replay: TraceReplay, prompts: list[PromptItem], schedule: Schedule, *, router: str,
                 **kw) -> tuple[dict, dict, dict]:
    """One (router, rate) run: (request columns, step log, facts). With ``item_rows`` (trace row of each
    prompt item) requests are those rows directly; otherwise prompts are matched to rows by text. Keywords:
    see :class:`SimulatedCluster`."""
    return SimulatedCluster(replay, prompts, schedule, router=router, **kw).run()
