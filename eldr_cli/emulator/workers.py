"""The emulated workers: a prefill worker (batches prompts under a token budget, one step per batch) and
a decode worker (a continuous batch, one step per token), both timed by the measured cost model over
the replayed trace rows. The HTTP side is :mod:`eldr_cli.emulator.app`."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque

import numpy as np

from eldr_cli.costmodel.deployment import KV_BLOCK_TOKENS
from eldr_cli.simulator.core import schedule_kv
from eldr_cli.simulator.replay import TraceReplay, prefill_batch, prompt_of

STEP_FIELDS = ("t_s", "batch", "active_experts", "step_ms", "late_ms")
CATCH_UP_S = 0.05  # a step that ended up to 50 ms late is made up by the following steps


class DecodeRequest:
    """One request in a decode worker's batch; the worker puts ``last`` (bool) on ``queue`` per token."""

    __slots__ = ("row", "max_tokens", "ntok", "queue", "matched", "prompt_tokens", "arrived", "recompute")

    def __init__(self, row, max_tokens, matched, prompt_tokens):
        self.row = row
        self.max_tokens = max_tokens
        self.ntok = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.matched = matched
        self.prompt_tokens = prompt_tokens
        self.arrived = time.perf_counter()
        self.recompute = False  # preempted for KV: its next step recomputes prompt + generated tokens


async def sleep_until(deadline: float) -> None:
    """Sleep to an absolute deadline: asyncio.sleep for all but the last ~1 ms (its timer granularity),
    then yield to the loop until the deadline passes, so step ends land within a fraction of a ms."""
    d = deadline - time.perf_counter()
    if d > 0.0015:
        await asyncio.sleep(d - 0.0008)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)


class Worker:
    """State shared by both roles."""

    def __init__(self, role: str, index: int, replay: TraceReplay, model_name: str, host: str, port: int):
        self.role, self.index, self.replay = role, index, replay
        self.model_name, self.host, self.port = model_name, host, port
        self.engine_id = f"eldr-emu-{role[0]}{index}-{uuid.uuid4().hex[:6]}"
        self.unmatched = 0
        self.requests_total = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def match(self, body: dict, chat: bool) -> tuple[int, bool]:
        row, ok = self.replay.match(prompt_of(body, chat))
        if not ok:
            self.unmatched += 1
        return row, ok

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests, as vLLM's /metrics reports them."""
        raise NotImplementedError

    async def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


class PrefillWorker(Worker):
    def __init__(self, *a, max_batched_tokens: int = 8192, **kw):
        super().__init__("prefill", *a, **kw)
        self.pending: deque = deque()
        self.max_batched_tokens = max_batched_tokens
        self.running = 0

    def load(self) -> tuple[int, int]:
        return self.running, len(self.pending)

    async def prefill(self, row: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((row, fut))
        self._wake.set()
        await fut

    async def _loop(self) -> None:
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            toks = [int(self.replay.prompt_tokens[r]) for r, _ in itertools.islice(self.pending, 64)]
            k = prefill_batch(toks, self.max_batched_tokens)
            batch = [self.pending.popleft() for _ in range(k)]
            self.running = k
            ms, _ = self.replay.prefill_step_ms(np.array([r for r, _ in batch]))
            await sleep_until(time.perf_counter() + max(ms, 0.01) / 1e3)
            self.running = 0
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)


class DecodeWorker(Worker):
    """A continuous batch under the simulator's scheduling rule (eldr_cli/simulator/core.py): at most
    ``max_seqs`` running and, with a KV capacity (default: the cost model's deployment), vLLM's rule in
    blocks of 16 tokens: preempt the latest admitted while the running requests' context + 1 does not
    fit (it recomputes when admitted again), else admit from the FIFO queue's head while it fits."""

    def __init__(self, *a, max_seqs: int = 256, kv_capacity_tokens: int | None = None, **kw):
        super().__init__("decode", *a, **kw)
        self.max_seqs = max_seqs
        dep = getattr(self.replay.cost, "deployment", None) or {}
        self.kv_capacity_tokens = kv_capacity_tokens if kv_capacity_tokens is not None else \
            dep.get("kv_capacity_tokens")
        self.kv_blocks = None if self.kv_capacity_tokens is None else int(self.kv_capacity_tokens) // KV_BLOCK_TOKENS
        self.kv_used = 0  # blocks the running requests held in the last step
        self.preemptions = 0
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[DecodeRequest] = []
        self.steps: list[tuple] = []
        self.t0 = time.perf_counter()
        self.wrapped = 0  # requests decoding past their row's captured steps (which then replay again)
        self.tpot_s_sum = 0.0  # vLLM's vllm:time_per_output_token_seconds: one observation per token and step
        self.tpot_count = 0

    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def _schedule(self) -> None:
        cap = self.kv_blocks
        if cap is None:
            while self.waiting and len(self.running) < self.max_seqs:
                self.running.append(self.waiting.popleft())
            return
        # the simulator's compiled rule itself, on this worker's requests' contexts (prompt + generated)
        kept, admit = schedule_kv([int(r.prompt_tokens) + r.ntok for r in self.running],
                                  [int(r.prompt_tokens) + r.ntok for r in self.waiting], cap, self.max_seqs)
        while len(self.running) > kept:  # the latest admitted go back to the queue's head, in their order
            r = self.running.pop()
            r.recompute = True
            self.waiting.appendleft(r)
            self.preemptions += 1
        for _ in range(admit):
            self.running.append(self.waiting.popleft())
        self.kv_used = sum((int(r.prompt_tokens) + r.ntok + KV_BLOCK_TOKENS) // KV_BLOCK_TOKENS for r in self.running)

    def submit(self, req: DecodeRequest) -> None:
        if self.replay.wraps(req.row, req.max_tokens):
            self.wrapped += 1
        self.waiting.append(req)
        self._wake.set()

    async def _loop(self) -> None:
        replay = self.replay
        last_deadline = None
        while True:
            self._schedule()
            if not self.running:
                last_deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.perf_counter()
            # back-to-back steps chain on the previous deadline, so a late wake-up (a busy host) is made
            # up by the next step instead of stretching every token gap; lateness is still logged
            start = last_deadline if last_deadline is not None and now - last_deadline < CATCH_UP_S else now
            run = self.running
            rows = np.fromiter((r.row for r in run), dtype=np.int64, count=len(run))
            done = np.fromiter((r.ntok for r in run), dtype=np.int64, count=len(run))
            recompute = 0
            if self.kv_blocks is not None:
                for r in run:
                    if r.recompute:
                        recompute += int(r.prompt_tokens) + r.ntok
                        r.recompute = False
            ms, active = replay.decode_step_ms(rows, done, recompute)
            ms = max(ms, 0.01)
            deadline = start + ms / 1e3
            last_deadline = deadline
            await sleep_until(deadline)
            end = time.perf_counter()
            self.steps.append((start - self.t0, len(run), active, ms, (end - deadline) * 1e3))
            self.tpot_s_sum += (end - start) * len(run)
            self.tpot_count += len(run)
            keep = []
            for r in run:
                r.ntok += 1
                last = r.ntok >= r.max_tokens
                r.queue.put_nowait(last)
                if not last:
                    keep.append(r)
            self.running = keep
