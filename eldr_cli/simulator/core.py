"""The decode side of the simulator: D decode workers doing continuous batching in virtual time.

Semantics (the same as the emulator's decode worker, eldr_cli/emulator/server.py):
- a step starts with the running set R (requests admitted before it started, at most ``max_seqs``);
- its time is ``CostModel.step_ms(union of R's current-step experts, L, |R|)``;
- when it ends every request in R gets one token (its first token if it had none); requests that
  reached their max tokens finish; the next step starts at once with R minus the finished plus the
  queued requests (FIFO) -- a request arriving mid-step waits for the step boundary;
- an idle worker starts a step as soon as a request arrives.

The loops are numba-compiled (``nopython``) because 8P16D x 5 rates x 150 s x 6 routers is millions
of steps; the routing decision stays in Python and calls ``eldr_cli.stages.routing`` (see simulate.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf


@njit(cache=True, inline="always")
def _popcount64(x):
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(cache=True)
def _start_step(d, t, masks, offsets, steps, empty, req_row, req_ntok, req_meas, run, nrun, qbuf, qhead, qtail,
                step_end, max_seqs, k0, kb, kt, log_dec, log_t, log_batch, log_active, log_ms, log_meas, log_n):
    while nrun[d] < max_seqs and qhead[d] < qtail[d]:
        run[d, nrun[d]] = qbuf[d, qhead[d]]
        nrun[d] += 1
        qhead[d] += 1
    B = nrun[d]
    if B == 0:
        step_end[d] = INF
        return
    W = masks.shape[1]
    active = 0
    for w in range(W):
        acc = np.uint64(0)
        for i in range(B):
            rid = run[d, i]
            row = req_row[rid]
            st = steps[row]
            idx = empty if st == 0 else offsets[row] + req_ntok[rid] % st
            acc |= masks[idx, w]
        active += _popcount64(acc)
    meas = 0
    for i in range(B):
        rid = run[d, i]
        if req_meas[rid] and req_ntok[rid] >= 1:
            meas += 1
    ms = k0 + kb * active + kt * B
    if ms < 0.01:
        ms = 0.01
    step_end[d] = t + ms / 1000.0
    j = log_n[0]
    log_dec[j] = d
    log_t[j] = t
    log_batch[j] = B
    log_active[j] = active
    log_ms[j] = ms
    log_meas[j] = meas
    log_n[0] = j + 1


@njit(cache=True)
def advance(until, masks, offsets, steps, empty, req_row, req_ntok, req_max, req_meas, req_first, req_finish,
            run, nrun, qbuf, qhead, qtail, inflight, step_end, max_seqs, k0, kb, kt,
            log_dec, log_t, log_batch, log_active, log_ms, log_meas, log_n):
    """Run every decode worker's steps that end at or before ``until``. Returns 0, or -1 when the
    step log is nearly full (grow it and call again: state is kept in the arrays)."""
    cap = log_dec.shape[0]
    D = step_end.shape[0]
    for d in range(D):
        while step_end[d] <= until and step_end[d] < INF:
            if log_n[0] >= cap - 1:
                return -1
            t = step_end[d]
            B = nrun[d]
            k = 0
            for i in range(B):
                rid = run[d, i]
                req_ntok[rid] += 1
                if req_ntok[rid] == 1:
                    req_first[rid] = t
                if req_ntok[rid] >= req_max[rid]:
                    req_finish[rid] = t
                    inflight[d] -= 1
                else:
                    run[d, k] = rid
                    k += 1
            nrun[d] = k
            _start_step(d, t, masks, offsets, steps, empty, req_row, req_ntok, req_meas, run, nrun, qbuf, qhead,
                        qtail, step_end, max_seqs, k0, kb, kt, log_dec, log_t, log_batch, log_active, log_ms,
                        log_meas, log_n)
    return 0


@njit(cache=True)
def admit(d, rid, t, masks, offsets, steps, empty, req_row, req_ntok, req_meas, run, nrun, qbuf, qhead, qtail,
          inflight, step_end, max_seqs, k0, kb, kt, log_dec, log_t, log_batch, log_active, log_ms, log_meas, log_n):
    qbuf[d, qtail[d]] = rid
    qtail[d] += 1
    inflight[d] += 1
    if step_end[d] == INF:
        _start_step(d, t, masks, offsets, steps, empty, req_row, req_ntok, req_meas, run, nrun, qbuf, qhead, qtail,
                    step_end, max_seqs, k0, kb, kt, log_dec, log_t, log_batch, log_active, log_ms, log_meas, log_n)


class DecodePool:
    """State of D simulated decode workers for one run of n requests."""

    # the step log, grown by _alloc_log (one entry per decode step of any worker)
    log_dec: np.ndarray
    log_t: np.ndarray
    log_batch: np.ndarray
    log_active: np.ndarray
    log_ms: np.ndarray
    log_meas: np.ndarray
    log_n: np.ndarray

    def __init__(self, replay, n_workers: int, req_row: np.ndarray, req_max: np.ndarray, req_meas: np.ndarray,
                 max_seqs: int = 256, log_capacity: int = 1 << 16):
        n = len(req_row)
        self.masks = replay.decode_masks
        self.offsets = replay.offsets
        self.steps = replay.steps.astype(np.int64)
        self.empty = np.int64(replay._empty)
        self.req_row = np.ascontiguousarray(req_row, dtype=np.int64)
        self.req_max = np.ascontiguousarray(np.maximum(req_max, 1), dtype=np.int64)
        self.req_meas = np.ascontiguousarray(req_meas, dtype=np.bool_)
        self.req_ntok = np.zeros(n, dtype=np.int64)
        self.req_first = np.full(n, np.nan)
        self.req_finish = np.full(n, np.nan)
        self.req_worker = np.full(n, -1, dtype=np.int64)
        self.admit_t = np.full(n, np.nan)
        D = n_workers
        self.max_seqs = int(max_seqs)
        self.run = np.zeros((D, self.max_seqs), dtype=np.int64)
        self.nrun = np.zeros(D, dtype=np.int64)
        self.qbuf = np.zeros((D, max(n, 1)), dtype=np.int64)
        self.qhead = np.zeros(D, dtype=np.int64)
        self.qtail = np.zeros(D, dtype=np.int64)
        self.inflight = np.zeros(D, dtype=np.int64)
        self.step_end = np.full(D, INF)
        k0, kb, kt = replay.cost.coefficients(replay.token_scale)
        L = replay.n_layers
        self.k0, self.kb, self.kt = float(L * k0), float(kb), float(L * kt)
        self._alloc_log(log_capacity)

    def _alloc_log(self, cap: int, old=None):
        names = ("log_dec", "log_t", "log_batch", "log_active", "log_ms", "log_meas")
        dts = (np.int32, np.float64, np.int32, np.int32, np.float64, np.int32)
        for nm, dt in zip(names, dts, strict=True):
            a = np.zeros(cap, dtype=dt)
            if old is not None:
                a[: old] = getattr(self, nm)[: old]
            setattr(self, nm, a)
        if old is None:
            self.log_n = np.zeros(1, dtype=np.int64)

    def _log_args(self):
        return (self.log_dec, self.log_t, self.log_batch, self.log_active, self.log_ms, self.log_meas, self.log_n)

    def advance(self, until: float) -> None:
        while advance(until, self.masks, self.offsets, self.steps, self.empty, self.req_row, self.req_ntok,
                      self.req_max, self.req_meas, self.req_first, self.req_finish, self.run, self.nrun, self.qbuf,
                      self.qhead, self.qtail, self.inflight, self.step_end, self.max_seqs, self.k0, self.kb,
                      self.kt, *self._log_args()) < 0:
            n = int(self.log_n[0])
            self._alloc_log(2 * len(self.log_dec), old=n)

    def admit(self, worker: int, rid: int, t: float) -> None:
        if self.log_n[0] >= len(self.log_dec) - 1:
            self._alloc_log(2 * len(self.log_dec), old=int(self.log_n[0]))
        self.req_worker[rid] = worker
        self.admit_t[rid] = t
        admit(worker, rid, t, self.masks, self.offsets, self.steps, self.empty, self.req_row, self.req_ntok,
              self.req_meas, self.run, self.nrun, self.qbuf, self.qhead, self.qtail, self.inflight, self.step_end,
              self.max_seqs, self.k0, self.kb, self.kt, *self._log_args())

    def step_log(self) -> dict[str, np.ndarray]:
        n = int(self.log_n[0])
        return {"worker": self.log_dec[:n].copy(), "t_s": self.log_t[:n].copy(), "batch": self.log_batch[:n].copy(),
                "active_experts": self.log_active[:n].copy(), "step_ms": self.log_ms[:n].copy(),
                "measured_itls": self.log_meas[:n].copy()}
