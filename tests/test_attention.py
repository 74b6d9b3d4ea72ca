"""The varlen attention op against the padded reference (``padded_attention``: every request padded,
every score materialised): the same outputs, the same read check, and the same attention mass on
every page it measures - all pages of decode requests, all pages of a prefill chunk that reads a
page the check flags, every page with ``exact_mass`` - and NaN (not measured) nowhere else."""
from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch

from engine import kernels
from engine.attention import BatchLayout, _read_check_torch, padded_attention, paged_attention, read_check
from engine.kv.pool import KVPool

CASES = [   # (seq_lens, query_lens, flagged (request, position) slots, page size, kv heads, group)
    ([37, 5, 64, 20, 1], [1, 5, 30, 1, 1], [(2, 3)], 16, 2, 3),
    ([9, 9, 9], [9, 1, 4], [], 4, 1, 4),
    ([50, 3, 31], [1, 3, 31], [(0, 49), (2, 0)], 8, 4, 1),
    ([1], [1], [], 16, 2, 2),
    ([80, 12], [16, 12], [(1, 11)], 16, 2, 2),
]


def _f32_prefill_runs(D: int) -> bool:
    """Whether the native fp32 prefill kernel runs here for heads of D values (AVX-512, or AVX2 with FMA)."""
    pool = KVPool(1, D, 4, 4 * KVPool.page_bytes_for(1, D, 4))
    return kernels.paged_prefill(torch.zeros(2, 1, D), pool, 0, torch.tensor([0]), 2, 1, 1.0, torch.empty(2, 1, D))


def _case(seq, ql, flagged, S, hkv, D, dtype) -> tuple[KVPool, BatchLayout]:
    """A pool of random values and a step's layout over it: each request's pages drawn out of order,
    one spare block-table column (padding in every row), the flagged slots' expected tags wrong."""
    B = len(seq)
    C = max(-(-n // S) for n in seq) + 1
    P = B * C + 3
    pool = KVPool(2, hkv * D, S, P * KVPool.page_bytes_for(2, hkv * D, S, dtype), dtype=dtype)
    pool.buf.view(dtype)[:] = torch.randn(pool.buf.numel() // pool.esize)
    bt = torch.full((B, C), -1, dtype=torch.long)
    perm, i = torch.randperm(P), 0
    for b, n in enumerate(seq):
        k = -(-n // S)
        bt[b, :k], i = perm[i:i + k], i + k
    tags = pool.tags[bt.clamp(min=0)].reshape(B, C * S).clone()
    for b, pos in flagged:
        tags[b, pos] ^= 0x5A5A
    return pool, BatchLayout.build(bt, seq, ql, pool.generation[bt.clamp(min=0)].clone(), tags)


@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq, ql, flagged, S, hkv, g", CASES)
def test_varlen_matches_the_padded_reference(seq, ql, flagged, S, hkv, g, dtype, D, monkeypatch):
    """(A bf16 pool too: every path widens the same stored values and computes in fp32. Head
    widths 16 and 64: the native decode kernel's per-key path (fp32: its one-pass path - online
    softmax a page at a time, partial last pages, 1-4 query heads a KV head), and its blocked one -
    heads of a multiple of 32 values, KB keys a block, a partial last block.)"""
    torch.manual_seed(len(seq) * 31 + S)
    B = len(seq)
    pool, lay = _case(seq, ql, flagged, S, hkv, D, dtype)
    q = torch.randn(sum(ql), hkv * g, D)
    ref = padded_attention(q, pool, 1, lay, hkv, D, D ** -0.5, True)
    flagged_req = {b for b, _ in flagged}
    # decode through the native kernel (engine/kernels), then through torch's ops
    paths = [("native", kernels.native())] * (kernels.native() is not None) + [("torch", None)]
    f32_prefill = _f32_prefill_runs(D)     # a bf16 pool's chunks too (fp32 products: its values widened)
    for (path, lib), exact in itertools.product(paths, (False, True)):
        monkeypatch.setattr(kernels, "_lib", lib)
        calls = kernels.CALLS
        got = paged_attention(q, pool, 1, lay, hkv, D, D ** -0.5, True, exact_mass=exact)
        # native calls: one for the decode rows; one per fp32 prefill chunk whose mass is not measured
        chunks = sum(n > 1 and b not in flagged_req for b, n in enumerate(ql)) if f32_prefill and not exact else 0
        assert kernels.CALLS - calls == (path == "native" and (1 in ql) + chunks), path
        torch.testing.assert_close(got.out, ref.out, atol=1e-5, rtol=1e-4)
        for a, b in zip(got.check[:5], ref.check[:5]):      # the tensors (any_failed: below)
            assert torch.equal(a[ref.check.slots_read > 0], b[ref.check.slots_read > 0])
        measured = ~torch.isnan(got.page_mass)
        for b in range(B):
            want = exact or ql[b] == 1 or b in flagged_req
            assert bool(measured[b].all()) == want, (b, exact)
        torch.testing.assert_close(got.page_mass[measured], ref.page_mass[measured], atol=1e-5, rtol=1e-4)
    if dtype == torch.bfloat16:
        # a bf16 prefill's attention in bf16 (prefill_dtype: where the CPU multiplies bf16 natively)
        # on the pool's values as stored, q rounded to bf16, bf16 results: a chunk from its request's
        # start and one that continues a context (its mask) within 3e-2 of the fp32 reference (values
        # of about +-3, one bf16 step 2^-8 of them); decode rows and chunks whose mass is measured
        # (flagged) stay fp32, as they were
        got = paged_attention(q, pool, 1, lay, hkv, D, D ** -0.5, True, prefill_dtype=torch.bfloat16)
        low = torch.tensor([ql[b] > 1 and b not in flagged_req for b in lay.tok_batch.tolist()])
        torch.testing.assert_close(got.out[low], ref.out[low], atol=3e-2, rtol=0)
        assert not low.any() or not torch.equal(got.out[low], ref.out[low])      # the bf16 path ran
        torch.testing.assert_close(got.out[~low], ref.out[~low], atol=1e-5, rtol=1e-4)
        measured = ~torch.isnan(got.page_mass)
        torch.testing.assert_close(got.page_mass[measured], ref.page_mass[measured], atol=1e-5, rtol=1e-4)
    monkeypatch.undo()
    # the native read check and the numpy one (CPU pools) and the torch one (other devices): equal
    # field for field, on these tags and with a page's generation wrong too
    gens = lay.expected_gen.clone()
    gens[0, 0] += 1
    for lay2 in (lay, BatchLayout.build(lay.block_tables, seq, ql, gens, lay.expected_tags)):
        b = _read_check_torch(pool, lay2)
        with monkeypatch.context() as m:
            m.setattr(kernels, "read_check", lambda *a: None)
            by_numpy = read_check(pool, lay2)
        a = read_check(pool, lay2)
        for got in (a, by_numpy):
            for name, x, y in zip(got._fields[:5], got, b):
                assert x.dtype == y.dtype and torch.equal(x, y), name
            assert got.any_failed is bool(b.bad_slots.any()) and b.any_failed is None
    assert int(a.bad_slots[0, 0]) == min(seq[0], S) and int(a.bad_mask[0, 0]) == (1 << min(seq[0], S)) - 1


@pytest.mark.skipif(shutil.which("cc") is None or os.environ.get("KVLEDGER_NATIVE") == "0",
                    reason="no C compiler on this machine, or the native kernels turned off (KVLEDGER_NATIVE=0)")
def test_the_native_decode_kernel_builds_and_loads_where_a_compiler_is():
    assert kernels.native() is not None, kernels.why_not()


@pytest.mark.parametrize("seq, ql, flagged, S, hkv, g", CASES)
def test_bf16_queries_with_their_fp32_rows_give_the_fp32_queries_numbers(seq, ql, flagged, S, hkv, g, monkeypatch):
    """A bf16 pool attending prefill in bf16: q handed over in bf16 (rounded as the prefill rounds
    it) with ``q_exact`` for the rows that want it unrounded - decode rows, a chunk whose mass is
    measured (a flagged page, exact_mass) - gives bit for bit what the fp32 q gives: outputs, mass,
    check; the native kernels and torch's path alike."""
    torch.manual_seed(len(seq) * 17 + S)
    D, B, dtype = 64, len(seq), torch.bfloat16
    pool, lay = _case(seq, ql, flagged, S, hkv, D, dtype)
    q = torch.randn(sum(ql), hkv * g, D)
    asked = []

    def q_exact(rows):
        asked.extend(rows.tolist())
        return q.index_select(0, rows)
    paths = [("native", kernels.native())] * (kernels.native() is not None) + [("torch", None)]
    for (path, lib), exact in itertools.product(paths, (False, True)):
        monkeypatch.setattr(kernels, "_lib", lib)
        args = (pool, 1, lay, hkv, D, D ** -0.5, True)
        want = paged_attention(q, *args, exact_mass=exact, prefill_dtype=dtype)
        asked.clear()
        got = paged_attention(q.to(dtype), *args, exact_mass=exact, prefill_dtype=dtype, q_exact=q_exact)
        assert got.out.dtype == torch.float32 and torch.equal(got.out, want.out), (path, exact)
        assert torch.equal(got.page_mass.nan_to_num(-1), want.page_mass.nan_to_num(-1))
        assert all(torch.equal(a, b) for a, b in zip(got.check[:5], want.check[:5]))
        # the fp32 rows asked for: the decode rows and the chunks whose mass is measured, no others
        starts = [sum(ql[:b]) for b in range(B)]
        flagged_req = {b for b, _ in flagged}
        rows = {t for b in range(B) if ql[b] == 1 or exact or b in flagged_req
                for t in range(starts[b], starts[b] + ql[b])}
        assert set(asked) == rows, (path, exact)


def test_later_layers_measure_the_pages_layer_0_flagged():
    """Layer 0 decides from its own check; later layers get the flagged pages passed in."""
    S, hkv, D = 8, 2, 16
    pool = KVPool(2, hkv * D, S, 12 * KVPool.page_bytes_for(2, hkv * D, S))
    pool.buf.view(torch.float32)[:] = torch.randn(pool.buf.numel() // 4)
    bt = torch.tensor([[0, 1, 2], [3, 4, -1]])
    lay = BatchLayout.build(bt, [20, 10], [20, 10], pool.generation[bt.clamp(min=0)].clone(),
                            pool.tags[bt.clamp(min=0)].reshape(2, -1).clone())
    q = torch.randn(30, 4, D)
    flagged = torch.tensor([[False, True, False], [False, False, False]])
    got = paged_attention(q, pool, 1, lay, hkv, D, 0.25, False, mass_pages=flagged)
    assert not torch.isnan(got.page_mass[0]).any() and torch.isnan(got.page_mass[1, :2]).all()
