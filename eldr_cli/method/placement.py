"""Expert placement for expert-parallel (EP) decoders (ELDR §5, METRO) and its baselines.

Each decode worker shards its E experts per MoE layer over R EP ranks. In memory-bound decode a
rank's MoE time follows the number of *distinct experts it activates* in a step (METRO), so the
decoder's slowest rank is the one holding the most of the batch's active experts.

Three layouts, all in one representation:

- **per-decoder** (:class:`PerDecoderPlacement`, ELDR §5): for every decoder k (a cluster of the
  routing artifact), estimate each expert's decode activation from the calibration requests of
  cluster k, then for every (decoder, layer) give the next most-active expert to the lightest
  rank that still has a free slot; E/R experts per rank, no replicas (uniform weight memory);
- **global EPLB** (:class:`GlobalEPLB`, DeepSeek's EPLB "global load balancing", written from its
  description): one layout for all decoders, fitted on all traffic's decode *token* load:
  (1) give ``n_redundant`` extra slots one by one to the expert with the highest load per
  replica, (2) pack the physical replicas (load split evenly over an expert's replicas) onto
  ranks heaviest first, each to the lightest rank with a free slot, (E + n_redundant)/R slots
  per rank;
- **contiguous** (:func:`contiguous_layout`): vLLM's default ``linear`` placement, rank r holds
  experts [r*E/R, (r+1)*E/R).

Representation (the one vLLM's EPLB state uses): a layout of one decoder is
``physical_to_logical`` int [L, P] with P = E + n_redundant physical slots; slot p lives on rank
``p // (P // R)`` and holds logical expert ``physical_to_logical[l, p]``. Without replication
P = E and every expert appears once; ``rank`` int [L, E] is then the inverse view
(:func:`ranks_of`). With replication an expert has several slots; which one a step activates is
the token-routing decision, made here with METRO's greedy (Algorithm 1): each active expert goes
to the candidate rank with the fewest experts activated so far (single-replica experts first,
they have no choice). That is the best case for EPLB's layout.

The metric (:func:`max_active_per_rank`): for a decode batch's active experts [L, E], the number
of activated experts on the busiest rank per layer, against the lower bound ceil(active / R).
"""

from __future__ import annotations

import numpy as np

from eldr_cli.constraints import validate_parameter
from eldr_cli.errors import InvalidDataError, InvalidParameterError

# -- layouts -----------------------------------------------------------------------------------

def check_ep_size(num_experts: int, ep_size: int, n_redundant: int = 0) -> int:
    """Slots per rank; InvalidParameterError unless R divides E + n_redundant (equal experts per rank)."""
    validate_parameter("ep_size", ep_size)
    validate_parameter("n_redundant", n_redundant)
    P = num_experts + n_redundant
    if P % ep_size:
        what = f"E={num_experts}" + (f" + {n_redundant} redundant" if n_redundant else "")
        divisors = [r for r in range(1, num_experts + 1) if num_experts % r == 0]
        raise InvalidParameterError(
            "n_redundant" if n_redundant else "ep_size",
            f"EP size R={ep_size} does not divide {what} experts per layer: every rank must hold the same number "
            "of experts", hint=f"choose ep_size from {divisors}" if not n_redundant else
            "choose n_redundant so that E + n_redundant is a multiple of R")
    return P // ep_size


def balanced_packing(weight: np.ndarray, n_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy balanced packing with equal item counts per pack, vectorized over rows.

    weight: float [N, n] (n divisible by n_packs). Items are taken heaviest first (ties to the lower
    item index); each goes to the pack with the smallest total weight among packs that still have
    a free slot (ties to the lower pack index). Returns ``pack`` int64 [N, n] and ``slot`` int64
    [N, n] (the item's position within its pack, in assignment order).
    """
    w = np.asarray(weight, dtype=np.float64)
    N, n = w.shape
    cap = n // n_packs
    if n % n_packs:
        raise InvalidDataError(f"{n} items do not split evenly into {n_packs} packs")
    order = np.argsort(-w, axis=1, kind="stable")
    rows = np.arange(N)
    load = np.zeros((N, n_packs))
    count = np.zeros((N, n_packs), dtype=np.int64)
    pack = np.empty((N, n), dtype=np.int64)
    slot = np.empty((N, n), dtype=np.int64)
    for j in range(n):
        item = order[:, j]
        g = np.argmin(np.where(count < cap, load, np.inf), axis=1)
        pack[rows, item] = g
        slot[rows, item] = count[rows, g]
        load[rows, g] += w[rows, item]
        count[rows, g] += 1
    return pack, slot


def _physical_from_packing(pack: np.ndarray, slot: np.ndarray, logical: np.ndarray, cap: int) -> np.ndarray:
    """Rows of items with (pack, slot) -> physical_to_logical [N, n] (slot p = pack * cap + slot)."""
    N, n = pack.shape
    out = np.empty((N, n), dtype=np.int32)
    out[np.arange(N)[:, None], pack * cap + slot] = logical
    return out


def greedy_placement(activation: np.ndarray, ep_size: int) -> np.ndarray:
    """ELDR §5: physical_to_logical int32 [..., E] for activation float [..., E] (no replicas).

    For every row (a (decoder, layer) pair) the next most-active expert goes to the lightest rank
    that has fewer than E/R experts.
    """
    a = np.asarray(activation, dtype=np.float64)
    E = a.shape[-1]
    cap = check_ep_size(E, ep_size)
    flat = a.reshape(-1, E)
    pack, slot = balanced_packing(flat, ep_size)
    logical = np.broadcast_to(np.arange(E), flat.shape)
    return _physical_from_packing(pack, slot, logical, cap).reshape(a.shape)


def contiguous_layout(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """vLLM's default ``linear`` placement: physical_to_logical = identity, int32 [L, E]."""
    check_ep_size(num_experts, ep_size)
    return np.broadcast_to(np.arange(num_experts, dtype=np.int32), (num_layers, num_experts)).copy()


def replicate_experts(load: np.ndarray, n_redundant: int) -> np.ndarray:
    """EPLB step 1: replica count int32 [L, E] (>= 1), n_redundant extra slots per layer, each to
    the expert whose load per replica is currently the highest (ties to the lower expert id)."""
    w = np.asarray(load, dtype=np.float64)
    L, E = w.shape
    count = np.ones((L, E), dtype=np.int32)
    rows = np.arange(L)
    for _ in range(n_redundant):
        e = np.argmax(w / count, axis=1)
        count[rows, e] += 1
    return count


def ranks_of(physical_to_logical: np.ndarray, ep_size: int, num_experts: int | None = None) -> np.ndarray:
    """Inverse view of an unreplicated layout: rank int32 [..., E] of every logical expert."""
    p2l = np.asarray(physical_to_logical)
    P = p2l.shape[-1]
    E = P if num_experts is None else num_experts
    if P != E:
        raise InvalidDataError("ranks_of needs a layout without replicas (P == E)")
    cap = P // ep_size
    rank = np.empty(p2l.shape, dtype=np.int32)
    slot_rank = (np.arange(P) // cap).astype(np.int32)
    np.put_along_axis(rank, p2l.astype(np.int64), np.broadcast_to(slot_rank, p2l.shape), axis=-1)
    return rank


def replica_ranks(physical_to_logical: np.ndarray, ep_size: int, num_experts: int) -> np.ndarray:
    """bool [..., E, R]: does rank r hold a replica of logical expert e."""
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    P = p2l.shape[-1]
    cap = P // ep_size
    lead = p2l.shape[:-1]
    out = np.zeros((*lead, num_experts, ep_size), dtype=bool)
    flat = out.reshape(-1, num_experts, ep_size)
    rows = np.arange(flat.shape[0])[:, None]
    flat[rows, p2l.reshape(-1, P), np.arange(P)[None, :] // cap] = True
    return out


def check_layout(physical_to_logical: np.ndarray, num_experts: int, ep_size: int) -> None:
    """Invariants of a layout [L, P]: every logical expert has >= 1 slot, ids in range, R | P."""
    p2l = np.asarray(physical_to_logical)
    P = p2l.shape[-1]
    if P % ep_size or P < num_experts:
        raise InvalidDataError(f"layout has {P} physical slots, not a multiple of R={ep_size} or fewer than "
                               f"E={num_experts}")
    if p2l.min() < 0 or p2l.max() >= num_experts:
        raise InvalidDataError(f"layout names experts outside [0, {num_experts})")
    counts = np.apply_along_axis(np.bincount, -1, p2l.reshape(-1, P), minlength=num_experts)
    if (counts == 0).any():
        raise InvalidDataError("layout leaves some experts without a slot")


# -- activation estimates ------------------------------------------------------------------------

def decode_activation(decode_counts: np.ndarray, decode_steps: np.ndarray,
                      batch_size: int | None = None) -> np.ndarray:
    """Per-expert decode activation float64 [L, E] of a group of requests.

    decode_counts int [n, L, E], decode_steps int [n]. p(l, e) = steps in which layer l picked e /
    all decode steps (the chance a random decode token of the group uses e; sums to k over e).
    With ``batch_size`` B: 1 - (1 - p)^B, the chance e is active in a step of B such tokens.
    """
    steps = float(np.asarray(decode_steps).sum())
    L, E = decode_counts.shape[1:]
    if steps <= 0:
        return np.zeros((L, E))
    p = np.asarray(decode_counts, dtype=np.float64).sum(axis=0) / steps
    p = np.clip(p, 0.0, 1.0)
    if batch_size is not None:
        p = 1.0 - (1.0 - p) ** int(batch_size)
    return p


class PerDecoderPlacement:
    """ELDR §5: one EP layout per decoder from its cluster's calibration decode activation.

    >>> PerDecoderPlacement(ep_size=4, batch_size=8).fit(decode_counts, decode_steps, labels, 16)
    >>> est.physical_to_logical_   # int32 [K, L, E]; est.rank_  int32 [K, L, E]

    decode_counts int [R, L, E], decode_steps int [R], labels int [R] (cluster of each request, -1 =
    none). A decoder whose cluster has no calibration requests gets the placement of all traffic
    (``empty_decoders_`` lists them).
    """

    def __init__(self, ep_size: int, batch_size: int | None = None):
        self.ep_size = ep_size
        self.batch_size = batch_size

    def fit(self, decode_counts: np.ndarray, decode_steps: np.ndarray, labels: np.ndarray,
            n_decoders: int) -> "PerDecoderPlacement":
        dc = np.asarray(decode_counts)
        steps = np.asarray(decode_steps, dtype=np.float64)
        labels = np.asarray(labels)
        if dc.ndim != 3 or steps.shape != dc.shape[:1] or labels.shape != dc.shape[:1]:
            raise InvalidDataError(f"decode_counts {dc.shape}, decode_steps {steps.shape} and labels {labels.shape} "
                            "disagree on the number of requests")
        if self.batch_size is not None:
            validate_parameter("batch_size", self.batch_size)
        if labels.size and labels.max() >= n_decoders:
            raise InvalidDataError(f"labels name decoder {int(labels.max())} but K={n_decoders}")
        _, L, E = dc.shape
        check_ep_size(E, self.ep_size)
        K = int(n_decoders)
        # per-cluster sums [K, L, E] (exact integer sums) and [K] decode steps
        ok = labels >= 0
        cnt = np.zeros((K, L, E), dtype=np.int64)
        for k in np.unique(labels[ok]):
            cnt[k] = dc[labels == k].sum(axis=0, dtype=np.int64)
        stp = np.bincount(labels[ok], weights=steps[ok], minlength=K)
        # all traffic (the fallback for a decoder without calibration requests)
        glob = np.clip(cnt.sum(axis=0) / max(float(stp.sum()), 1.0), 0.0, 1.0)
        if self.batch_size is not None:
            glob = 1.0 - (1.0 - glob) ** int(self.batch_size)
        act = np.empty((K, L, E))
        empty = stp <= 0
        p = np.clip(cnt / np.where(empty, 1.0, stp)[:, None, None], 0.0, 1.0)
        if self.batch_size is not None:
            p = 1.0 - (1.0 - p) ** int(self.batch_size)
        act[:] = p
        act[empty] = glob
        self.activation_ = act
        self.physical_to_logical_ = greedy_placement(act, self.ep_size)
        self.rank_ = ranks_of(self.physical_to_logical_, self.ep_size)
        self.cluster_steps_ = stp
        self.empty_decoders_ = np.flatnonzero(empty).tolist()
        return self


class GlobalEPLB:
    """DeepSeek EPLB, global policy (one layout for every decoder), from its description.

    load float [L, E]: each expert's token load (here: decode tokens of all calibration traffic).
    Step 1 (:func:`replicate_experts`) adds ``n_redundant`` replicas per layer to the experts with the
    highest load per replica; step 2 (:func:`balanced_packing`) packs the E + n_redundant physical
    replicas, each carrying load / replicas, heaviest first onto the lightest rank with a free slot,
    (E + n_redundant) / R slots per rank. Attributes: ``replicas_`` int32 [L, E],
    ``physical_to_logical_`` int32 [L, E + n_redundant], ``rank_load_`` float [L, R].
    """

    def __init__(self, ep_size: int, n_redundant: int = 0):
        self.ep_size = ep_size
        self.n_redundant = n_redundant

    def fit(self, load: np.ndarray) -> "GlobalEPLB":
        w = np.asarray(load, dtype=np.float64)
        L, E = w.shape
        cap = check_ep_size(E, self.ep_size, self.n_redundant)
        count = replicate_experts(w, self.n_redundant)
        P = E + self.n_redundant
        # physical replicas in logical order: expert e's replicas are consecutive items
        logical = np.repeat(np.broadcast_to(np.arange(E), (L, E)).ravel(), count.ravel()).reshape(L, P)
        item_w = np.take_along_axis(w / count, logical, axis=1)
        pack, slot = balanced_packing(item_w, self.ep_size)
        self.replicas_ = count
        self.physical_to_logical_ = _physical_from_packing(pack, slot, logical, cap)
        self.load_ = w
        self.rank_load_ = np.zeros((L, self.ep_size))
        np.add.at(self.rank_load_, (np.arange(L)[:, None], pack), item_w)
        return self


# -- the metric: activated experts per rank (METRO) ----------------------------------------------

def active_experts(picks: np.ndarray, num_experts: int) -> np.ndarray:
    """bool [L, E] experts active in one decode step of a batch; picks int [b, L, k]."""
    p = np.asarray(picks, dtype=np.int64)
    L = p.shape[1]
    act = np.zeros((L, num_experts), dtype=bool)
    if p.size:
        act[np.broadcast_to(np.arange(L)[None, :, None], p.shape), p] = True
    return act


def max_active_per_rank(active: np.ndarray, physical_to_logical: np.ndarray, ep_size: int) -> np.ndarray:
    """Activated experts on the busiest rank, int [N, L], for active bool [N, L, E] under one layout
    ``physical_to_logical`` [L, P].

    Without replicas the count per rank is exact; with replicas each active expert activates one
    replica, chosen by METRO's greedy (single-replica experts first, then each replicated expert,
    in id order, to its candidate rank with the fewest activated experts so far; ties to the
    lower rank).
    """
    act = np.asarray(active, dtype=bool)
    N, L, E = act.shape
    holds = replica_ranks(physical_to_logical, ep_size, E)          # [L, E, R]
    nrep = holds.sum(axis=-1)                                        # [L, E]
    single = act & (nrep == 1)[None]
    load = np.einsum("nle,ler->nlr", single.astype(np.float32), holds.astype(np.float32)).astype(np.int64)
    for l, e in zip(*np.nonzero(nrep > 1), strict=True):  # replicated experts, in id order per layer
        n = np.flatnonzero(act[:, l, e])
        if n.size == 0:
            continue
        # one expert at a time, vectorized over batches (each batch's greedy is independent)
        g = np.argmin(np.where(holds[l, e][None], load[n, l], np.iinfo(np.int64).max), axis=1)
        load[n, l, g] += 1
    return load.max(axis=-1)


def lower_bound(active: np.ndarray, ep_size: int) -> np.ndarray:
    """ceil(active experts / R), int [N, L], for active bool [N, L, E]."""
    n = np.asarray(active).sum(axis=-1)
    return -(-n // ep_size)


def expected_max_rank_share(activation: np.ndarray, physical_to_logical: np.ndarray, ep_size: int) -> float:
    """Mean over rows of (heaviest rank's expected activation / the mean rank's), for an
    unreplicated layout. activation float [..., L, E]; layout [L, E] or [..., L, E]. 1.0 is perfect."""
    a = np.asarray(activation, dtype=np.float64)
    rank = ranks_of(np.broadcast_to(physical_to_logical, a.shape), ep_size)
    oh = np.eye(ep_size)[rank]                               # [..., L, E, R]
    per_rank = np.einsum("...e,...er->...r", a, oh)
    tot = per_rank.sum(axis=-1)
    ok = tot > 0
    share = per_rank.max(axis=-1)[ok] / (tot[ok] / ep_size)
    return float(share.mean()) if share.size else 1.0
