"""The tag plane lives in the pool buffer and travels with every record copy."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kv.host import HostTier
from engine.kv.pool import KVPool


def test_tags_and_kv_share_one_buffer_and_one_record_copy():
    pool = KVPool(2, 6, 4, 8 * KVPool.page_bytes_for(2, 6, 4))
    pages, offs = torch.tensor([1, 1, 3]), torch.tensor([0, 3, 2])
    k = torch.randn(3, 6)
    v = torch.randn(3, 6)
    pool.store(0, pages, offs, k, v, torch.tensor([11, 12, 13]), torch.tensor([7, 7, 8]))
    pool.store(1, pages, offs, 2 * k, 2 * v)
    for view in (pool.tags, pool.writers, pool.generation, pool.k(1), pool.v(0)):
        assert view.untyped_storage().data_ptr() == pool.buf.untyped_storage().data_ptr()
    recs = pool.read_records(pages, offs)
    dst_p, dst_o = torch.tensor([5, 6, 6]), torch.tensor([1, 0, 2])
    pool.write_records(dst_p, dst_o, recs)      # one copy: K/V of both layers + tag + writer
    assert pool.tags[dst_p, dst_o].tolist() == [11, 12, 13]
    assert pool.writers[dst_p, dst_o].tolist() == [7, 7, 8]
    torch.testing.assert_close(pool.k(1)[dst_p, dst_o], 2 * k)
    torch.testing.assert_close(pool.v(0)[dst_p, dst_o], v)
    assert pool.record_tags(recs).tolist() == [11, 12, 13]
    assert pool.generation[5] == 0, "record copies never touch the allocator's generation header"


def test_capacity_is_derived_from_the_memory_budget():
    page = KVPool.page_bytes_for(2, 6, 4)
    pool = KVPool(2, 6, 4, 10 * page + page - 1)
    assert pool.num_pages == 10 and pool.capacity_tokens == 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers, kv_dim", [(4, 128), (2, 64), (3, 6), (1, 40)])
def test_every_record_and_head_row_starts_on_a_cache_line(dtype, layers, kv_dim):
    """The decode kernels read one head's row out of every record: records on whole 64-byte lines,
    and where a layer's rows are whole lines (heads of 32 dims or a multiple: every K and V row of
    every layer, at any head) a row never straddles one line more. Zero, as torch.zeros' was."""
    pool = KVPool(layers, kv_dim, 16, 5 * KVPool.page_bytes_for(layers, kv_dim, 16, dtype), dtype=dtype)
    es, base = pool.esize, pool.buf.data_ptr()
    assert base % 64 == 0 and pool.page_bytes % 64 == 0 and pool.rec_bytes % 64 == 0
    assert pool.rec_bytes - 2 * layers * kv_dim * es < 128        # the tag area and less than a line of padding
    assert pool.tags.data_ptr() % 64 == 0 and pool.k(0).data_ptr() % 64 == 0
    for layer in range(layers):
        for t in (pool.k(layer), pool.v(layer)):
            assert (t.stride(0) * es, t.stride(1) * es) == (pool.page_bytes, pool.rec_bytes)
            if kv_dim * es % 64 == 0:
                assert (t.data_ptr() - base) % 64 == 0
    assert int(pool.buf.count_nonzero()) == 0


def _smaps_field(addr: int, field: str) -> str | None:
    """``field`` of the mapping of this process holding ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_a_cpu_pools_buffer_is_advised_onto_huge_pages_unless_turned_off(monkeypatch):
    """A decode step reads a row out of every record, a new 4 KB page every other row: the pool asks
    for transparent huge pages (MADV_HUGEPAGE) - eligible wherever the kernel's THP is not "never" -
    and KVLEDGER_POOL_HUGEPAGES=0 keeps torch's own allocation."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = setting.read_text() if setting.exists() else "[never]"     # a kernel built without THP
    pb = KVPool.page_bytes_for(4, 128, 16, torch.bfloat16)
    pool = KVPool(4, 128, 16, 200 * pb, dtype=torch.bfloat16)
    assert pool.buf.data_ptr() % (2 << 20) == 0                 # from a huge page boundary
    assert _smaps_field(pool.buf.data_ptr(), "THPeligible") in ((None, "0") if "[never]" in thp else ("1",))
    if "[never]" not in thp:
        assert "hg" in (_smaps_field(pool.buf.data_ptr(), "VmFlags") or "").split()   # the madvise
    monkeypatch.setenv("KVLEDGER_POOL_HUGEPAGES", "0")
    plain = KVPool(4, 128, 16, 200 * pb, dtype=torch.bfloat16)
    assert "hg" not in (_smaps_field(plain.buf.data_ptr(), "VmFlags") or "").split()
    assert (plain.page_bytes, plain.rec_bytes) == (pool.page_bytes, pool.rec_bytes)


def test_host_tier_round_trip_carries_tags():
    pool = KVPool(1, 4, 2, 6 * KVPool.page_bytes_for(1, 4, 2))
    host = HostTier(pool, 1 << 20)
    pool.store(0, torch.tensor([2, 2]), torch.tensor([0, 1]), torch.ones(2, 4), torch.ones(2, 4),
               torch.tensor([5, 6]), torch.tensor([9, 9]))
    done = []
    hp = host.offload([2], lambda: done.append(True))
    assert host.in_flight == 1 and not done          # a DMA: queued, copied when the engine drains it
    host.drain()
    assert done and host.in_flight == 0
    pool.zero_pages(torch.tensor([2]))
    host.reload(hp, [4])
    assert pool.tags[4].tolist() == [5, 6] and pool.writers[4].tolist() == [9, 9]
    assert bool(pool.k(0)[4].eq(1).all())


def test_host_offload_copies_the_page_as_it_is_when_the_dma_runs():
    """Why the engine holds offloaded pages until the copy drains (fault 2): the copy reads the
    device page at drain time, so whatever was written into it before then is what comes back."""
    pool = KVPool(1, 4, 2, 6 * KVPool.page_bytes_for(1, 4, 2))
    host = HostTier(pool, 1 << 20)
    pool.store(0, torch.tensor([2]), torch.tensor([0]), torch.ones(1, 4), torch.ones(1, 4),
               torch.tensor([5]), torch.tensor([9]))
    hp = host.offload([2])
    pool.store(0, torch.tensor([2]), torch.tensor([0]), torch.full((1, 4), 7.0), torch.ones(1, 4),
               torch.tensor([8]), torch.tensor([3]))          # someone else's write before the DMA ran
    host.drain()
    host.reload(hp, [4])
    assert pool.tags[4, 0].item() == 8 and pool.writers[4, 0].item() == 3


_MAPPED = r"""
import ctypes, sys, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "1":
    from engine.osutil import keep_freed_buffers
    assert keep_freed_buffers()
mapped = []
for _ in range(3):                      # a step's activations: allocated, freed, allocated again
    t = torch.empty(16 << 20)           # 64 MB
    t.fill_(1.0)
    mapped.append(libc.mallinfo2().hblkhd)
    del t
print(max(mapped))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="not glibc >= 2.33")
def test_freed_activation_buffers_stay_in_the_heap_instead_of_being_mapped_afresh():
    """engine/osutil.keep_freed_buffers (LLMEngine calls it unless EngineConfig.keep_freed_buffers is
    False): a 64 MB buffer comes from the heap - glibc's own policy maps such a block on its own and
    unmaps it when freed, so each step's buffers fault in page by page again."""
    got = {}
    for keep in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", _MAPPED, keep], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got[keep] = int(r.stdout.split()[-1])
    assert got["0"] >= 64 << 20 and got["1"] < 64 << 20, got


_FROZEN = """
import gc, sys
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.models.llama import LlamaModel
model = LlamaModel.from_pretrained(sys.argv[1])
before = gc.get_freeze_count()
LLMEngine(model, None, EngineConfig(kv_memory_budget=1 << 20, freeze_gc=sys.argv[2] == "1"))
print(before, gc.get_freeze_count(), len(gc.get_objects(2)))
"""


@pytest.mark.parametrize("env, config, frozen", [(None, "1", True), ("0", "1", False), (None, "0", False)],
                         ids=["default", "KVLEDGER_GC_FREEZE=0", "freeze_gc=False"])
def test_a_built_engine_freezes_the_gc_heap_so_a_full_collection_skips_it(tiny_llama, env, config, frozen):
    """engine/osutil.freeze_heap (LLMEngine's last step unless EngineConfig.freeze_gc is False or
    KVLEDGER_GC_FREEZE=0): what exists once the engine is built - torch, the model, the pool - moves to
    the collector's permanent generation, so a later full collection scans only what came after (the
    oldest generation all but empty) instead of every object."""
    e = {k: v for k, v in os.environ.items() if k != "KVLEDGER_GC_FREEZE"} | ({"KVLEDGER_GC_FREEZE": env} if env else {})
    r = subprocess.run([sys.executable, "-c", _FROZEN, str(tiny_llama), config], capture_output=True, text=True,
                       timeout=300, env=e, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
    before, after, oldest = map(int, r.stdout.split()[-3:])
    assert before == 0
    if frozen:
        assert after > 100_000 and oldest < 1_000, (after, oldest)
    else:
        assert after == 0 and oldest > 100_000, (after, oldest)
