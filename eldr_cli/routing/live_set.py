"""eldr-live's live set as a component: each decoder's in-flight requests as the per-step decode activations a
source predicts for them, and what follows from them (issues 35, 36).

- A *source of activations* turns a request into a :class:`LiveEntry` (its per-step activation probabilities
  a_r [L*E], their log(1 - a_r), and the prototype other replicas count it as): :class:`PrefillPredictor`
  predicts it from the request's prefill counts (eldr-live, :mod:`eldr_cli.method.live`), :class:`FutureSource`
  reads the truth from a trace (the clairvoyant limit row).
- :class:`LiveSet` holds per decoder the requests this process dispatched (each by its own entry) and the other
  replicas' requests (integer counts per prototype, which sum across replicas), and answers, lazily refreshed:
  ``q`` [K, L*E] (P(expert idle in a step)), ``active`` [K] (expected distinct experts), ``ctx`` [K] (context
  tokens) and :meth:`LiveSet.step_ms` (each decoder's predicted next step for given loads).

Nothing outside this module reads a live set's fields: policies and shadows use these methods.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from eldr_cli.costmodel import StepTerms, step_ms_from_terms
from eldr_cli.errors import EldrError
from eldr_cli.method.shrinkage import MAX_ACTIVATION
from eldr_cli.routing.model import RoutingModel

LOG_Q_FLOOR = -60.0
_FLOOR32 = np.float32(LOG_Q_FLOOR)  # the same floor as a float32 scalar: no type resolution per call
RECOUNT_EVERY = 4096  # changes of a decoder's live set between exact recounts of its log q
A_MAX = 1.0 - 1e-6  # a true activation of 1 (every step): log(1 - a) stays finite


class LiveEntry(NamedTuple):
    """One request as a live set holds it: a_r [L*E] and log(1 - a_r) (float32), and its prototype; ``cells``:
    the Eq. 2 cells [N* x E] (float64, not normalized) its prediction started from, when it was predicted from
    its prefill counts (the proxy's drift watch scores them instead of computing them again); ``prior``: its band
    prior [K] (float64, ``routing.live``), where the fit set one and the request has cells."""

    activation: np.ndarray
    log_idle: np.ndarray
    prototype: int
    cells: np.ndarray | None = None
    prior: np.ndarray | None = None


def entry_of(a: np.ndarray, prototype: int) -> LiveEntry:
    a32 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    return LiveEntry(a32, np.log1p(-a32.astype(np.float64)).astype(np.float32), int(prototype))


class ActivationSource(Protocol):
    """What a live set predicts a request's decode from."""

    table: np.ndarray  # log(1 - a) per prototype [M + 1, L*E] (row M: the mean request): other replicas' requests

    def entry(self, counts: Any, key: Any = None) -> LiveEntry | None: ...

    def of_vector(self, v: np.ndarray) -> LiveEntry: ...

    def mean(self) -> LiveEntry: ...


class PrefillPredictor:
    """eldr-live's source: the nearest prototype's mean decode activation, shrunk per layer toward the request's
    own prefill distribution when the fit found that it predicts better (``RoutingModel.live_shrinkage``)."""

    def __init__(self, model: RoutingModel):
        if model.live is None:
            raise EldrError("the routing artifact has no decode-activation model, which the eldr-live policy "
                            "needs (it was fitted before eldr-live existed)",
                            hint="refit it with `eldr fit` (or `eldr cluster`); the other policies still serve")
        protos, act = model.live
        L, E = model.shape
        if act.shape[1:] != (L, E):
            raise EldrError(f"the routing artifact's decode-activation model is {act.shape[1]}x{act.shape[2]}, "
                            f"its signatures {L}x{E}", hint="refit it with `eldr fit`")
        self.model = model
        self.protos = np.ascontiguousarray(protos, dtype=np.float32)  # float32: half the matvec
        self._signed = bool((self.protos < 0).any())  # a negative prototype element (the search's bound then differs)
        self.act = np.ascontiguousarray(act, dtype=np.float32)        # [M + 1, L, E]
        self.entries = [entry_of(a, m) for m, a in enumerate(self.act)]
        self.table = np.stack([e.log_idle for e in self.entries])
        self.shrinkage = model.live_shrinkage
        if self.shrinkage is not None:  # lam = w T / (T + kappa) per layer, in float32; kappa inf: w 0
            kappa, w = self.shrinkage
            inf = np.isinf(kappa)
            self._w = np.where(inf, 0.0, w).astype(np.float32)
            self._kappa = np.where(inf, 1.0, kappa).astype(np.float32)
        else:  # the compiled entry's arguments all the same (it does not read them without shrinkage)
            self._w = self._kappa = np.zeros(act.shape[1], dtype=np.float32)
        self._inv_k = np.float32(1.0 / max(model.top_k, 1))
        self._a_max = np.float32(MAX_ACTIVATION)
        self._eq2 = model.eq2_args  # Eq. 2's arguments to the compiled loops
        # the band prior, computed with the request's cells (once per request, not in each decision)
        self._band = np.ascontiguousarray(model.centroids, dtype=np.float32) if model.band_prior > 0 else None
        self._band_scale = model.band_prior / max(model.tau, 1e-9)
        from eldr_cli.routing.compiled import warm

        warm()  # the request path's compiled loops are ready before the first request

    def mean(self) -> LiveEntry:
        return self.entries[-1]

    def of_vector(self, v: np.ndarray) -> LiveEntry:
        """A request known only by its signature [N* x E] (no counts): its nearest prototype's mean."""
        return self.entries[self._nearest(np.asarray(v, dtype=np.float32))] if v.any() else self.mean()

    def _nearest(self, v32: np.ndarray) -> int:
        """The prototype nearest a float32 signature: the largest of BLAS's float32 product (its first on a tie)."""
        return int((self.protos @ v32).argmax())

    def entry(self, counts: Any, key: Any = None) -> LiveEntry | None:
        """The request's entry from its prefill counts [L, E] (raises EldrError on counts of another shape), with
        its band prior where the fit set one."""
        e = self._entry(counts)
        if e is None or e.cells is None or self._band is None:
            return e
        from eldr_cli.routing.compiled import band_prior_of

        prior = np.empty(self._band.shape[0])
        return e._replace(prior=prior) if band_prior_of(e.cells.reshape(-1), self._band, self._band_scale, prior) \
            else e

    def _entry(self, counts: Any) -> LiveEntry | None:
        if counts is None:
            return None
        c = counts if type(counts) is np.ndarray else np.asarray(counts)
        self.model.check_shape(c)
        if c.dtype.kind in "iu":  # the hand-off's counts: one compiled call (routing.compiled.live_entry)
            return self._entry_compiled(c)
        # other counts (float, bool): Eq. 2's cells and their float32 copy (the prototypes' product), then numpy
        sig32 = np.empty(self.protos.shape[1], dtype=np.float32)
        if c.dtype.kind == "f":
            sig, nonzero = self.model.cells(c, sig32)
        else:
            sig = self.model.signature(c, unit=False)
            sig32[:], nonzero = sig, bool(sig.any())
        if not nonzero:
            return self.mean()
        m = self._nearest(sig32)
        if self.shrinkage is None:
            return self.entries[m]._replace(cells=sig)
        a = self._shrunk(c, m)
        return LiveEntry(a, np.log1p(-a), m, sig)

    def _entry_compiled(self, c: np.ndarray) -> LiveEntry:
        """:meth:`entry` of integer counts in one compiled call: the same cells, prototype and activation, bit for
        bit (where the compiled search cannot be sure of the prototype, BLAS's float32 product finds it and
        :meth:`_shrunk` shrinks, as where the compiled shrinkage declines)."""
        from eldr_cli.routing.compiled import live_entry

        shrink = self.shrinkage is not None
        status, m, sig, a, neg_a = live_entry(c, *self._eq2, self.protos, self._signed, self.act, self._w,
                                              self._kappa, self._inv_k, self._a_max, shrink)
        if status == 0:
            return self.mean()
        if status == 2:  # two prototypes within float32 rounding of each other: BLAS's product decides, as before
            m = self._nearest(sig.astype(np.float32))
        if not shrink:
            return self.entries[m]._replace(cells=sig)
        if status != 1:  # the rare ones (a prototype BLAS found, a layer's counts past 2**24): numpy's shrinkage
            a = self._shrunk(c, m)
            return LiveEntry(a, np.log1p(-a), m, sig)
        return LiveEntry(a, np.log1p(neg_a, out=neg_a), m, sig)

    def _shrunk(self, counts: np.ndarray, m: int) -> np.ndarray:
        """method.live.shrink, in float32 and few passes over [L, E]: a = (1 - lam) A_m + (lam / T) c, flat
        [L*E] (the numpy form of ``routing.compiled.shrunk_activation``)."""
        c = np.array(counts, dtype=np.float32)  # a copy: scaled in place below
        tok = c.sum(axis=1) * self._inv_k
        lam = self._w * tok / np.maximum(tok + self._kappa, np.float32(1e-9))
        a = self.act[m] * (1 - lam)[:, None]
        c *= (lam / np.maximum(tok, np.float32(1e-9)))[:, None]
        a += c
        np.minimum(a, self._a_max, out=a)
        return a.reshape(-1)


class FutureSource:
    """The clairvoyant's source: each served row's true per-step decode activations, by the row's key."""

    def __init__(self, future: dict[int, np.ndarray], mean: LiveEntry, table: np.ndarray):
        self.future = future
        self._mean = mean
        self.table = table

    def mean(self) -> LiveEntry:
        return self._mean

    def entry(self, counts: Any, key: Any = None) -> LiveEntry | None:
        a = self.future.get(key)
        return None if a is None else self.of_vector(a)

    def of_vector(self, v: np.ndarray) -> LiveEntry:
        """A request's true per-step activations [L*E]."""
        return entry_of(np.clip(v, 0.0, A_MAX), len(self.table) - 1)


class LiveSet:
    """Per decoder: the requests in flight (this process's by their entries, the other replicas' as counts per
    prototype) and their context tokens; ``q``, ``active`` and ``ctx`` are refreshed lazily at the next read."""

    def __init__(self, n_workers: int, source: ActivationSource, terms: StepTerms):
        self.source, self.terms = source, terms
        M1, LE = source.table.shape
        self.counts = np.zeros((n_workers, M1), dtype=np.int64)           # this process's, per prototype
        self.remote = np.zeros((n_workers, M1), dtype=np.int64)           # the other replicas' (summed)
        self.tokens = np.zeros(n_workers, dtype=np.int64)
        self.remote_tokens = np.zeros(n_workers, dtype=np.int64)
        # log(1 - a), float32: half the memory traffic per dispatch; the rounding a sum of float32 updates
        # accumulates is wiped by an exact recount every RECOUNT_EVERY changes of a decoder
        self.log_q = np.zeros((n_workers, LE), dtype=np.float32)
        self._q = np.ones((n_workers, LE), dtype=np.float32)
        self._active = np.zeros(n_workers)
        self._ctx = np.zeros(n_workers)
        self._n_live = [0] * n_workers
        self._changes = [0] * n_workers
        self._dirty: set[int] = set()
        self.where: dict[Any, tuple[int, np.ndarray, int, int]] = {}  # key -> (decoder, log(1 - a), prototype, tokens)
        self.last_add = [0] * n_workers  # sequence of the latest request added to each decoder
        self._seq = 0

    # -- what the decision reads ------------------------------------------------------------------
    def view(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q [K, L*E], active [K], ctx [K]), up to date."""
        if self._dirty:
            self._refresh()
        return self._q, self._active, self._ctx

    def step_ms(self, loads) -> np.ndarray:
        """Each decoder's predicted next decode step for the in-flight counts ``loads`` (0 for an idle decoder),
        by the one step formula the simulator and the replay use (relative units without a cost model)."""
        _, active, ctx = self.view()
        B = np.asarray(loads, dtype=np.float64)
        return step_ms_from_terms(self.terms, active, B, ctx) * (B > 0)

    def is_empty(self) -> bool:
        """No request anywhere in the live set (reads only: safe to call from another thread)."""
        return not (self.where or self.counts.any() or self.remote.any() or self.tokens.any()
                    or self.remote_tokens.any() or self.log_q.any())

    # -- requests in and out ------------------------------------------------------------------------
    def add(self, worker: int, key: Any, entry: LiveEntry | None, tokens: int = 0) -> None:
        """Request ``key`` is on ``worker`` (moved there if it was elsewhere); None: the mean request."""
        entry = entry or self.source.mean()
        self.remove(key)
        self.where[key] = (worker, entry.log_idle, entry.prototype, int(tokens))  # what it sums, not its signature
        self._seq += 1
        self.last_add[worker] = self._seq
        self.counts[worker, entry.prototype] += 1
        self._n_live[worker] += 1
        self.tokens[worker] += int(tokens)
        self._changed(worker, entry.log_idle, 1)

    def remove(self, key: Any) -> bool:
        """Request ``key`` left (whatever its decoder); False when it was not in the set."""
        rec = self.where.pop(key, None)
        if rec is None:
            return False
        worker, log_idle, prototype, tok = rec
        self.counts[worker, prototype] -= 1
        self._n_live[worker] -= 1
        self.tokens[worker] -= tok
        self._changed(worker, log_idle, -1)
        return True

    def _changed(self, d: int, log_delta: np.ndarray, sign: int) -> None:
        if self._n_live[d]:
            row = self.log_q[d]
            (np.add if sign > 0 else np.subtract)(row, log_delta, out=row)
        else:
            self.log_q[d] = 0.0  # exactly empty again, whatever rounding accumulated
        self._changes[d] += 1
        self._dirty.add(d)

    def _refresh(self) -> None:
        """q_d and A_d of the decoders whose live set changed since the last read (a dispatch and a finish on
        one decoder between two decisions cost one refresh)."""
        floor, q = _FLOOR32, self._q
        for d in self._dirty:
            self._ctx[d] = float(self.tokens[d] + self.remote_tokens[d])
            if not self._n_live[d]:
                self._q[d] = 1.0
                self._active[d] = 0.0
                continue
            if self._changes[d] >= RECOUNT_EVERY:  # exact again, from the entries and the remote counts
                self._changes[d] = 0
                self.log_q[d] = self.exact_log_q(d)
            # floored at e^-60 (~1e-26, a normal float32): no denormals in the products, nothing lost
            row = q[d]  # in place: one row less through the caches
            np.maximum(self.log_q[d], floor, out=row)
            np.exp(row, out=row)
            self._active[d] = q.shape[1] - float(row.sum())
        self._dirty.clear()

    def exact_log_q(self, d: int) -> np.ndarray:
        """Decoder d's log q recounted from its entries and the other replicas' counts (float64)."""
        out = self.remote[d].astype(np.float64) @ self.source.table.astype(np.float64)
        for w, log_idle, _, _ in self.where.values():
            if w == d:
                out += log_idle
        return out

    # -- replicas: integer vectors that sum -------------------------------------------------------------
    def export(self, worker: int) -> list[int]:
        """This process's requests on ``worker`` per prototype, then their context tokens (the other replicas
        predict them by their prototype's mean: a request's own shrunk activation stays with its replica)."""
        return [*self.counts[worker].tolist(), int(self.tokens[worker])]

    def merge(self, worker: int, vector: list[int] | None) -> None:
        """The other replicas' summed :meth:`export` of ``worker`` (None or [] when there are none)."""
        M1 = self.counts.shape[1]
        new = np.zeros(M1, dtype=np.int64) if not vector or len(vector) != M1 + 1 else np.asarray(vector[:M1])
        delta = new - self.remote[worker]
        nz = np.flatnonzero(delta)
        if nz.size:
            self.remote[worker] = new
            self._n_live[worker] += int(delta[nz].sum())
            self._changed(worker, (delta[nz] @ self.source.table[nz]).astype(np.float32), 1)
        tok = int(vector[M1]) if vector and len(vector) == M1 + 1 else 0
        if tok != self.remote_tokens[worker]:
            self.remote_tokens[worker] = tok
            self._dirty.add(worker)
