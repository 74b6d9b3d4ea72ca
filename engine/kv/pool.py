"""The KV page pool: K/V and the tag plane in ONE preallocated buffer.

Byte layout of one page (header, tag area and records: whole 64-byte cache lines):

    [ generation: int64, padding ][ slot 0 record ][ slot 1 record ] ... [ slot S-1 record ]
    slot record = [ content tag: int64 ][ writer incarnation: int64 ][ padding ][ K: L x kv_dim ][ V: L x kv_dim ][ padding ]

The header, the tag area and every record are whole 64-byte cache lines (``ALIGN``), so a head's
K or V row of 64 dims (128 bytes in bf16) is two lines, not three: the decode kernel reads a row
out of every record (records are kilobytes apart), and a row straddling a line boundary cost it a
third line each time (the AMX decode kernel on 4 KB pages: 1.03-1.10x a step aligned,
bench/decode_attention.py). The padding is zeros from the buffer's allocation and travels with the
record like the rest; a record grows by at most 112 bytes.

A CPU pool's buffer is an anonymous mapping advised onto transparent huge pages (where the kernel
allows them: ``madvise`` mode or ``always``; ``KVLEDGER_POOL_HUGEPAGES=0`` turns it off): a decode
step reads one row out of every record of every request, a new 4 KB page every other row, and
with 4 KB pages most of those reads missed the TLB (2 MB pages: 1.1-1.9x a step, the same bench).
The mapping's pages are zero as the kernel hands them out, like ``torch.zeros``'.

Because the content tag and writer sit inside the same slot record as the K/V bytes, whatever
copies K/V by record (transfer landing, offload, reload) copies the tags in the same copy; no
separate metadata path exists that a one-sided write could skip. The compute paths (prefill,
decode append) write layer 0's K/V and the tag plane through ``store`` with one slot mapping.

The generation lives in the page header and belongs to the allocator: it changes only when a
page is (re)allocated, and record copies never touch it. Freed pages are NOT zeroed unless
``zero_on_free`` (the performance choice that made the GLM-5.3 incident possible).
"""
from __future__ import annotations

import mmap
import os

import torch

from engine import kernels
from engine.errors import InputError

ALIGN = 64      # bytes: header, tag area and records are whole cache lines
_HDR = ALIGN    # bytes of page header (generation, then padding)
TAG_BYTES = ALIGN   # bytes of tag + writer (then padding) at the start of each slot record
HUGE = 2 << 20  # a transparent huge page


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _zeroed(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes on transparent huge pages where the kernel grants them (module doc),
    else ``torch.zeros``'."""
    if os.environ.get("KVLEDGER_POOL_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:     # THP off in this kernel: 4 KB pages, as torch's allocator would give
        pass
    start = -torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr() % HUGE     # to a huge page boundary
    # (a storage of its own from there: the pool's views set their storage offsets themselves;
    # the tensor holds the mapping as long as a view of it lives)
    buf = torch.frombuffer(m, dtype=torch.uint8, offset=start, count=nbytes)
    buf.zero_()     # every page faulted in now, as torch.zeros' would be, not during the first requests
    return buf


class KVPool:
    HDR, TAG_BYTES = _HDR, TAG_BYTES        # (the native store's offsets)

    def __init__(self, num_layers: int, kv_dim: int, page_size: int, memory_budget: int,
                 dtype: torch.dtype = torch.float32, zero_on_free: bool = False, device: str = "cpu",
                 shared_path: str | None = None, create: bool = True):
        if not 0 < page_size <= 63 or num_layers <= 0 or kv_dim <= 0:
            raise InputError(f"invalid pool geometry: page_size={page_size} (1..63: the read check keeps one bit "
                             f"per slot), layers={num_layers}, kv_dim={kv_dim}")
        self.num_layers, self.kv_dim, self.page_size, self.dtype = num_layers, kv_dim, page_size, dtype
        self.zero_on_free = zero_on_free
        esize = torch.empty((), dtype=dtype).element_size()
        self.esize = esize
        self.rec_bytes = _aligned(TAG_BYTES + 2 * num_layers * kv_dim * esize)
        self.page_bytes = self.page_bytes_for(num_layers, kv_dim, page_size, dtype)
        self.num_pages = memory_budget // self.page_bytes
        if self.num_pages < 1:
            raise InputError(f"KV memory budget {memory_budget} B holds no page: one page of {page_size} "
                             f"tokens needs {self.page_bytes} B")
        self.memory_bytes = self.num_pages * self.page_bytes
        if shared_path is None:
            self.buf = (_zeroed(self.memory_bytes) if torch.device(device).type == "cpu"
                        else torch.zeros(self.memory_bytes, dtype=torch.uint8, device=device))
        else:
            # the buffer is a shared file mapping (e.g. under /dev/shm): another process - a
            # prefill node - maps the same bytes and writes records into it (engine/disagg/procs.py)
            if create:
                with open(shared_path, "wb") as f:
                    f.truncate(self.memory_bytes)
            self.buf = torch.from_file(shared_path, shared=True, size=self.memory_bytes, dtype=torch.uint8)
        P, S = self.num_pages, page_size
        i64 = self.buf.view(torch.int64)
        pw, rw = self.page_bytes // 8, self.rec_bytes // 8
        self.generation = i64.as_strided((P,), (pw,), 0)
        self.tags = i64.as_strided((P, S), (pw, rw), _HDR // 8)
        self.writers = i64.as_strided((P, S), (pw, rw), _HDR // 8 + 1)
        el = self.buf.view(dtype)
        pe, re_ = self.page_bytes // esize, self.rec_bytes // esize
        base = (_HDR + TAG_BYTES) // esize
        self._k = [el.as_strided((P, S, kv_dim), (pe, re_, 1), base + l * kv_dim) for l in range(num_layers)]
        self._v = [el.as_strided((P, S, kv_dim), (pe, re_, 1), base + (num_layers + l) * kv_dim)
                   for l in range(num_layers)]
        self._heads: dict = {}
        self.records = self.buf.as_strided((P, S, self.rec_bytes), (self.page_bytes, self.rec_bytes, 1), _HDR)
        # Bumped by every write path below (never read by the engine): lets the independent
        # oracle re-fingerprint only slots whose bytes may have changed.
        self.write_seq = torch.zeros((P, S), dtype=torch.int64)

    @staticmethod
    def page_bytes_for(num_layers: int, kv_dim: int, page_size: int, dtype: torch.dtype = torch.float32) -> int:
        esize = torch.empty((), dtype=dtype).element_size()
        return _HDR + page_size * _aligned(TAG_BYTES + 2 * num_layers * kv_dim * esize)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def head_views(self, layer: int, num_kv_heads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per KV head, [P, S, head_dim] strided views of a layer's K and V (no copy): gathering
        one head's pages yields the [keys, head_dim] matrix a batched matmul reads as it is."""
        key = (layer, num_kv_heads)
        if key not in self._heads:
            D = self.kv_dim // num_kv_heads
            self._heads[key] = tuple([t.view(self.num_pages, self.page_size, num_kv_heads, D)[:, :, h]
                                      for h in range(num_kv_heads)] for t in (self._k[layer], self._v[layer]))
        return self._heads[key]

    # ---- compute paths (prefill, decode append) -------------------------------------------
    def store(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              tags: torch.Tensor | None = None, writers: torch.Tensor | None = None) -> None:
        """Write one layer's K/V for new tokens; with layer 0 the same slot mapping writes the tag plane.
        One native call where the kernels run (kernels.store_kv), else torch's index_puts."""
        if kernels.store_kv(self, layer, pages, offsets, k, v, tags, writers):
            return
        if layer == 0:
            self.write_seq[pages, offsets] += 1
        for dst, src in ((self._k[layer], k), (self._v[layer], v)):
            dst[pages, offsets] = src.reshape(-1, self.kv_dim).to(self.dtype)
        if tags is not None:
            self.tags[pages, offsets] = tags
            self.writers[pages, offsets] = writers

    # ---- copy paths (transfer landing, offload, reload): whole records, tags included -----
    def read_records(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.records[pages, offsets]

    def write_records(self, pages: torch.Tensor, offsets: torch.Tensor, records: torch.Tensor) -> None:
        self.records[pages, offsets] = records
        self.write_seq[pages, offsets] += 1

    def record_tags(self, records: torch.Tensor) -> torch.Tensor:
        """Content tags carried inside a batch of copied records (for checksums and the ledger)."""
        return records[:, :8].contiguous().view(torch.int64).reshape(-1)

    def record_writers(self, records: torch.Tensor) -> torch.Tensor:
        return records[:, 8:16].contiguous().view(torch.int64).reshape(-1)

    def zero_pages(self, pages: torch.Tensor) -> None:
        self.records[pages] = 0
        self.write_seq[pages] += 1
