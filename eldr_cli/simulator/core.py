"""The decode side of the simulator: D decode workers doing continuous batching in virtual time.

Semantics (the same as the emulator's decode worker, eldr_cli/emulator/workers.py):
- a step starts with the running set R (requests admitted before it started, at most ``max_seqs``,
  and, with a KV capacity, as vLLM's scheduler allows: see below);
- its time is ``cost.step_ms(charged experts, L, |R|, context=R's context lengths)``, evaluated here
  from ``cost.step_terms`` (see :func:`step_time`); the charged experts are the union of R's
  current-step experts summed over layers, or with expert parallelism (``cost.ep_ranks`` > 1) the
  busiest rank's: per layer the max over ranks (contiguous, rank r holds experts [r*E/EP, (r+1)*E/EP))
  of the rank's active experts, summed over layers (METRO's metric); a request's context is its prompt
  tokens plus the tokens generated so far (the KV a GPU step reads; a measured CPU model ignores it);
- KV capacity (``kv_capacity_tokens``, from the cost model's deployment), vLLM's rule in blocks of 16
  tokens: at a step's start every running request needs blocks for its context + the token the step
  writes; while they exceed the pool the latest admitted request is preempted (its KV freed; it goes
  back to the queue's head, and the step that admits it again recomputes its prompt + generated tokens:
  they count as extra tokens of that step, as a chunked prefill in vLLM's batch); with no preemption,
  the FIFO queue's head joins while its context + 1 fits, else it (and everything behind it) waits. A
  request alone is never preempted nor refused (it runs even when larger than the pool);
- when it ends every request in R gets one token (its first token if it had none); requests that
  reached their max tokens finish; the next step starts at once with R minus the finished plus the
  queued requests (FIFO) -- a request arriving mid-step waits for the step boundary;
- an idle worker starts a step as soon as a request arrives.

The loops are numba-compiled (``nopython``): 8P16D x 5 rates x 150 s x 7 routers is millions of steps
and ~10^8 request-steps. The routing decision stays in Python and calls the router of ``eldr_cli.routing`` (see
simulate.py); admissions are queued in Python and applied by the next :meth:`DecodePool.advance`, so a
prefill hand-off costs one compiled call. State lives in a few packed arrays because every array
argument of a compiled call costs a type check on each of the ~10^5 calls of a run.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from eldr_cli.costmodel import step_ms_from_terms
from eldr_cli.costmodel.deployment import KV_BLOCK_TOKENS

INF = np.inf
# rows of the packed per-request int64 state; R_CUR = R_OFF + R_NTOK mod R_ST (the mask of its next step),
# kept up to date instead of divided out at every request-step
# R_RECOMP: 1 when the request was preempted and must recompute its KV when it runs again
R_OFF, R_ST, R_NTOK, R_MAX, R_MEAS, R_CTX0, R_CUR, R_RECOMP = range(8)
# rows of the packed per-worker int64 state (W_PREEMPT: preemptions so far)
W_NRUN, W_QHEAD, W_QTAIL, W_INFLIGHT, W_PREEMPT = range(5)
# the packed int64 geometry: layers, experts, EP ranks, KV capacity in blocks (-1: none)
G_L, G_E, G_EP, G_KV = range(4)
LOG_FIELDS = ("worker", "t_s", "batch", "active_experts", "charged_experts", "step_ms", "measured_itls")
LOG_DTYPES = (np.int32, np.float64, np.int32, np.int32, np.int32, np.float64, np.int32)


@njit(cache=True, inline="always")
def _popcount64(x):
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


# the one step formula (eldr_cli.costmodel.step_ms_from_terms), compiled for the simulator's loop
step_time = njit(cache=True, inline="always")(step_ms_from_terms)


@njit(cache=True, inline="always")
def _range_popcount(acc, lo, hi):
    """Set bits of the word array ``acc`` in bit positions [lo, hi)."""
    n = 0
    while lo < hi:
        w = lo >> 6
        b = lo & 63
        take = min(64 - b, hi - lo)
        word = acc[w] >> np.uint64(b)
        if take < 64:
            word &= (np.uint64(1) << np.uint64(take)) - np.uint64(1)
        n += _popcount64(word)
        lo += take
    return n


@njit(cache=True)
def busiest_rank_active(acc, n_layers, n_experts, ep):
    """Sum over layers of the max over ``ep`` ranks of the rank's active experts in the bit set ``acc``
    (bit ``l * E + e``); rank r holds experts [r*E/ep, (r+1)*E/ep) of every layer (contiguous layout)."""
    per = n_experts // ep
    total = 0
    for l in range(n_layers):
        base = l * n_experts
        best = 0
        for r in range(ep):
            c = _range_popcount(acc, base + r * per, base + (r + 1) * per)
            if c > best:
                best = c
        total += best
    return total


@njit(cache=True)
def union_active(masks, rows, acc, n_layers=0, n_experts=0, ep=1):
    """Charged experts of the OR of ``masks[rows]`` (prefill batches): the popcount of the union, or with
    ``ep`` > 1 the busiest rank's count (:func:`busiest_rank_active`)."""
    W = masks.shape[1]
    for w in range(W):
        acc[w] = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        for w in range(W):
            acc[w] |= masks[r, w]
    if ep > 1:
        return busiest_rank_active(acc, n_layers, n_experts, ep)
    active = 0
    for w in range(W):
        active += _popcount64(acc[w])
    return active


@njit(cache=True, inline="always")
def _blocks_for_step(req, rid):
    """KV blocks a request holds during its next step: its context plus the token the step writes."""
    return (req[R_CTX0, rid] + req[R_NTOK, rid] + KV_BLOCK_TOKENS) // KV_BLOCK_TOKENS


@njit(cache=True)
def _schedule_kv(d, req, wk, run, qbuf, cap, max_seqs):
    """vLLM's scheduler on a pool of ``cap`` KV blocks: preempt the latest admitted running requests
    while the running ones do not fit (back to the queue's head, to recompute), else admit from the
    queue's head while it fits."""
    used = 0
    for i in range(wk[W_NRUN, d]):
        used += _blocks_for_step(req, run[d, i])
    preempted = False
    while used > cap and wk[W_NRUN, d] > 1:
        k = wk[W_NRUN, d] - 1
        rid = run[d, k]
        used -= _blocks_for_step(req, rid)
        wk[W_NRUN, d] = k
        wk[W_QHEAD, d] -= 1  # the slot before the head held an admitted request: reuse it
        qbuf[d, wk[W_QHEAD, d]] = rid
        req[R_RECOMP, rid] = 1
        wk[W_PREEMPT, d] += 1
        preempted = True
    if preempted:
        return  # as vLLM: no admissions in a step that preempted
    while wk[W_NRUN, d] < max_seqs and wk[W_QHEAD, d] < wk[W_QTAIL, d]:
        rid = qbuf[d, wk[W_QHEAD, d]]
        need = _blocks_for_step(req, rid)
        if wk[W_NRUN, d] > 0 and used + need > cap:
            break  # FIFO: the head waits for KV to free
        used += need
        run[d, wk[W_NRUN, d]] = rid
        wk[W_NRUN, d] += 1
        wk[W_QHEAD, d] += 1


def schedule_kv(running_ctx, waiting_ctx, kv_blocks: int, max_seqs: int) -> tuple[int, int]:
    """vLLM's block scheduling (:func:`_schedule_kv`, the simulator's own compiled rule) for a caller that
    keeps its requests elsewhere (the emulator): ``running_ctx`` / ``waiting_ctx`` = each running request's
    and each queued request's (FIFO, head first) context tokens. Returns (running requests kept: the rest,
    the latest admitted, are preempted back to the queue's head in their order; queue heads admitted)."""
    n_run, n_wait = len(running_ctx), len(waiting_ctx)
    n = n_run + n_wait
    req = np.zeros((8, max(n, 1)), dtype=np.int64)
    req[R_CTX0, :n] = np.concatenate([np.asarray(running_ctx, dtype=np.int64),
                                      np.asarray(waiting_ctx, dtype=np.int64)])
    run = np.zeros((1, max(int(max_seqs), n_run, 1)), dtype=np.int64)
    run[0, :n_run] = np.arange(n_run)
    qbuf = np.zeros((1, max(n, 1)), dtype=np.int64)
    qbuf[0, :n] = np.arange(n)  # slots before the head stand for the running requests (room to preempt into)
    wk = np.zeros((5, 1), dtype=np.int64)
    wk[W_NRUN, 0], wk[W_QHEAD, 0], wk[W_QTAIL, 0] = n_run, n_run, n
    _schedule_kv(0, req, wk, run, qbuf, int(kv_blocks), int(max_seqs))
    kept = min(int(wk[W_NRUN, 0]), n_run) if wk[W_PREEMPT, 0] else n_run
    return kept, int(wk[W_NRUN, 0]) - kept


@njit(cache=True)
def _start_step(d, t, masks, req, wk, run, qbuf, step_end, terms, geo, acc, log, cnt):
    max_seqs = run.shape[1]
    cap = geo[G_KV]
    if cap >= 0:
        _schedule_kv(d, req, wk, run, qbuf, cap, max_seqs)
    else:
        while wk[W_NRUN, d] < max_seqs and wk[W_QHEAD, d] < wk[W_QTAIL, d]:
            run[d, wk[W_NRUN, d]] = qbuf[d, wk[W_QHEAD, d]]
            wk[W_NRUN, d] += 1
            wk[W_QHEAD, d] += 1
    B = wk[W_NRUN, d]
    if B == 0:
        step_end[d] = INF
        return
    W = masks.shape[1]
    # row-wise: each running request's current-step mask is one contiguous row of W words
    for w in range(W):
        acc[w] = 0
    meas = 0
    ctx = 0.0
    recompute = 0  # tokens of preempted requests recomputed in this step
    for i in range(B):
        rid = run[d, i]
        ntok = req[R_NTOK, rid]
        idx = req[R_CUR, rid]
        for w in range(W):
            acc[w] |= masks[idx, w]
        if req[R_MEAS, rid] != 0 and ntok >= 1:
            meas += 1
        ctx += float(req[R_CTX0, rid] + ntok)  # prompt + generated: the KV this step reads
        if cap >= 0 and req[R_RECOMP, rid] != 0:
            recompute += req[R_CTX0, rid] + ntok
            req[R_RECOMP, rid] = 0
    active = 0
    for w in range(W):
        active += _popcount64(acc[w])
    charged = active
    if geo[G_EP] > 1:
        charged = busiest_rank_active(acc, geo[G_L], geo[G_E], geo[G_EP])
    ms = step_time(terms, charged, B + recompute, ctx)
    if ms < 0.01:
        ms = 0.01
    step_end[d] = t + ms / 1000.0
    j = cnt[0]
    log[0, j] = d
    log[1, j] = t
    log[2, j] = B
    log[3, j] = active
    log[4, j] = charged
    log[5, j] = ms
    log[6, j] = meas
    cnt[0] = j + 1


@njit(cache=True)
def advance(until, adm_d, adm_rid, adm_t, masks, req, reqf, wk, run, qbuf, step_end, terms, geo, acc, log, cnt):
    """Apply the queued admissions (in order), then run every worker's steps that end at or before
    ``until``. Returns 0, or -1 when the step log is nearly full (grow it and call again with no
    admissions: they were applied, and the rest of the state is kept in the arrays)."""
    for a in range(adm_d.shape[0]):
        d, rid = adm_d[a], adm_rid[a]
        qbuf[d, wk[W_QTAIL, d]] = rid
        wk[W_QTAIL, d] += 1
        if step_end[d] == INF:
            _start_step(d, adm_t[a], masks, req, wk, run, qbuf, step_end, terms, geo, acc, log, cnt)
    cap = log.shape[1]
    D = step_end.shape[0]
    for d in range(D):
        while step_end[d] <= until and step_end[d] < INF:
            if cnt[0] >= cap - 1:
                return -1
            t = step_end[d]
            B = wk[W_NRUN, d]
            k = 0
            for i in range(B):
                rid = run[d, i]
                req[R_NTOK, rid] += 1
                req[R_CUR, rid] += 1
                if req[R_CUR, rid] >= req[R_OFF, rid] + req[R_ST, rid]:
                    req[R_CUR, rid] = req[R_OFF, rid]  # past the captured steps: wrap to the first
                if req[R_NTOK, rid] == 1:
                    reqf[0, rid] = t
                if req[R_NTOK, rid] >= req[R_MAX, rid]:
                    reqf[1, rid] = t
                    wk[W_INFLIGHT, d] -= 1
                else:
                    run[d, k] = rid
                    k += 1
            wk[W_NRUN, d] = k
            _start_step(d, t, masks, req, wk, run, qbuf, step_end, terms, geo, acc, log, cnt)
    return 0


def served_masks(replay, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decode masks of the served rows only, contiguous (a run serves a split of the trace: a smaller
    table stays in cache), and each request's offset into it. A row without captured decode steps
    replays one empty (all-zero) mask, the table's last row."""
    u = np.unique(rows)
    st = replay.steps.astype(np.int64)[u]
    keep, kst = u[st > 0], st[st > 0]
    start = np.concatenate([[0], np.cumsum(kst)])
    src = np.repeat(replay.offsets[keep] - start[:-1], kst) + np.arange(int(start[-1]), dtype=np.int64)
    masks = np.vstack([replay.decode_masks[src], np.zeros((1, replay.decode_masks.shape[1]), dtype=np.uint64)])
    pos = np.searchsorted(keep, rows)
    has = (pos < len(keep)) & (keep[np.minimum(pos, max(len(keep) - 1, 0))] == rows) if len(keep) else \
        np.zeros(len(rows), dtype=bool)
    off = np.where(has, start[np.minimum(pos, len(keep))], len(src))
    return np.ascontiguousarray(masks), off.astype(np.int64)


_NO_I = np.zeros(0, dtype=np.int64)
_NO_F = np.zeros(0, dtype=np.float64)


class DecodePool:
    """State of D simulated decode workers for one run of n requests."""

    def __init__(self, replay, n_workers: int, req_row: np.ndarray, req_max: np.ndarray, req_meas: np.ndarray,
                 max_seqs: int = 256, log_capacity: int = 1 << 16, kv_capacity_tokens: int | None = None):
        """``kv_capacity_tokens``: each worker's KV pool (None: no cap); EP ranks from ``replay.cost``."""
        n = len(req_row)
        rows = np.asarray(req_row, dtype=np.int64)
        self.masks, off = served_masks(replay, rows)
        st = replay.steps.astype(np.int64)[rows]
        self.req = np.zeros((8, n), dtype=np.int64)
        self.req[R_OFF] = off
        self.req[R_CUR] = off
        self.req[R_ST] = np.maximum(st, 1)
        self.req[R_MAX] = np.maximum(req_max, 1)
        self.req[R_MEAS] = np.asarray(req_meas, dtype=bool)
        self.req[R_CTX0] = replay.prompt_tokens[rows]
        self.reqf = np.full((2, n), np.nan)
        self.req_worker = np.full(n, -1, dtype=np.int64)
        self.admit_t = np.full(n, np.nan)
        D = n_workers
        self.run = np.zeros((D, int(max_seqs)), dtype=np.int64)
        self.qbuf = np.zeros((D, max(n, 1)), dtype=np.int64)
        self.wk = np.zeros((5, D), dtype=np.int64)
        self.step_end = np.full(D, INF)
        self.terms = np.asarray(replay.cost.step_terms(replay.n_layers, replay.token_scale), dtype=np.float64)
        self.geo = np.array([replay.n_layers, replay.num_experts, replay.cost.ep_ranks,
                             -1 if kv_capacity_tokens is None else int(kv_capacity_tokens) // KV_BLOCK_TOKENS],
                            dtype=np.int64)
        self.acc = np.zeros(self.masks.shape[1], dtype=np.uint64)
        self.log = np.zeros((len(LOG_FIELDS), max(int(log_capacity), 4)))
        self.cnt = np.zeros(1, dtype=np.int64)
        self._adm_d: list[int] = []
        self._adm_rid: list[int] = []
        self._adm_t: list[float] = []

    # views the event loop and the result columns read
    @property
    def inflight(self) -> np.ndarray:
        """Requests admitted and not finished, per worker (the routing loads)."""
        return self.wk[W_INFLIGHT]

    @property
    def preemptions(self) -> int:
        """Requests preempted for KV so far (all workers)."""
        return int(self.wk[W_PREEMPT].sum())

    @property
    def req_ntok(self) -> np.ndarray:
        return self.req[R_NTOK]

    @property
    def req_first(self) -> np.ndarray:
        return self.reqf[0]

    @property
    def req_finish(self) -> np.ndarray:
        return self.reqf[1]

    def _grow(self, need: int) -> None:
        cap = self.log.shape[1]
        if need >= cap - 1:
            new = np.zeros((self.log.shape[0], max(2 * cap, need + 2)))
            new[:, :cap] = self.log
            self.log = new

    def advance(self, until: float) -> None:
        """Apply the queued admissions, then run the steps that end at or before ``until``."""
        k = len(self._adm_d)
        if k:
            self._grow(int(self.cnt[0]) + k + 1)  # an admission starts at most one step
            ad, ar, at = (np.array(self._adm_d, dtype=np.int64), np.array(self._adm_rid, dtype=np.int64),
                          np.array(self._adm_t, dtype=np.float64))
            self._adm_d, self._adm_rid, self._adm_t = [], [], []
        else:
            ad, ar, at = _NO_I, _NO_I, _NO_F
        while advance(until, ad, ar, at, self.masks, self.req, self.reqf, self.wk, self.run, self.qbuf,
                      self.step_end, self.terms, self.geo, self.acc, self.log, self.cnt) < 0:
            ad, ar, at = _NO_I, _NO_I, _NO_F
            self._grow(self.log.shape[1])

    def admit(self, worker: int, rid: int, t: float) -> None:
        """Hand request ``rid`` to ``worker`` at ``t``: counted in its load at once, queued (and its
        step started if the worker is idle) by the next :meth:`advance` -- nothing in between can
        observe the difference, because only advance moves decode time."""
        self.wk[W_INFLIGHT, worker] += 1
        self.req_worker[rid] = worker
        self.admit_t[rid] = t
        self._adm_d.append(worker)
        self._adm_rid.append(rid)
        self._adm_t.append(t)

    def step_log(self) -> dict[str, np.ndarray]:
        n = int(self.cnt[0])
        return {f: self.log[i, :n].astype(dt) for i, (f, dt) in enumerate(zip(LOG_FIELDS, LOG_DTYPES, strict=True))}
