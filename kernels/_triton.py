"""Triton kernels of the signature cache (imported lazily; see kernels/signature_cache.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reduce_kernel(cache_ptr, bt_ptr, out_ptr, B, LE, BLOCK: tl.constexpr):
    """Program (r, c): out[r, c*BLOCK : (c+1)*BLOCK] = sum over r's blocks of those cache cells."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < LE
    acc = tl.full([BLOCK], 0, dtype=tl.int32)
    for j in range(0, B):
        blk = tl.full([BLOCK], 0, dtype=tl.int64) + tl.load(bt_ptr + r * B + j).to(tl.int64)
        v = tl.load(cache_ptr + blk * LE + offs, mask=m & (blk >= 0), other=0)
        acc += v.to(tl.int32)
    tl.store(out_ptr + r.to(tl.int64) * LE + offs, acc, mask=m)


@triton.jit
def accumulate_layers_kernel(words_ptr, picks_ptr, blocks_ptr, T, K, stride_l, stride_t, stride_k, layer0, L, E,
                             num_blocks, ELEMS_PER_WORD: tl.constexpr, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Program (i, j) = BLOCK_T tokens of cache layer ``layer0 + j`` (picks row j): one launch for all MoE
    layers of a forward (``accumulate_all``) or for one (``accumulate``: a grid of one layer). Each (token,
    pick) adds 1 to its cell with a 32-bit atomic on the word holding the cell:
    ``+ (1 << (BITS * (index % ELEMS_PER_WORD)))`` (no carry: see the bound)."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    layer = layer0 + j
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    b = tl.load(blocks_ptr + t, mask=tm, other=num_blocks).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    m = tm[:, None] & km[None, :]
    base = picks_ptr + j.to(tl.int64) * stride_l
    e = tl.load(base + t[:, None].to(tl.int64) * stride_t + kk[None, :] * stride_k, mask=m, other=-1).to(tl.int64)
    m = m & (e >= 0) & (e < E) & (b[:, None] >= 0) & (b[:, None] < num_blocks)
    idx = (b[:, None] * L + layer) * E + e
    word = idx // ELEMS_PER_WORD
    shift = ((idx % ELEMS_PER_WORD) * BITS).to(tl.int32)
    inc = tl.full((BLOCK_T, BLOCK_K), 1, tl.int32) << shift
    tl.atomic_add(words_ptr + word, inc, mask=m)
