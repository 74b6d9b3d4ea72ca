"""The page ledger: who wrote and who read every KV slot, from the engine's own step tensors.

Rows are built from exactly what the attention op was given in that step (block tables, lengths,
expected generations and tags) and what its read check found, as numpy columns -> Arrow; they
go to the store's writer thread through a bounded queue. No per-read Python object, no span per
read. Read runs are coalesced on the writer thread (``ReadRuns``), off the engine's path.

    page_writes   one row per run of slots written together (prefill, decode, transfer_landing,
                  offload, reload), with one content tag per slot
    page_reads    one row per (reader, page, generation, block column) run of identical findings
    transfers     one row per KV transfer verdict
    releases      one row per page-set release
"""
from __future__ import annotations

import itertools
import operator
import threading
import time
from collections import deque
from typing import Callable, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from engine.attention import read_check
from engine.kernels import native as native_kernels
from engine.recorder import LandedRecords, TransferRecord
from telemetry.exposure_index import PATH_CODE, NodeIndex, Reads, Writes, finish as index_table
from telemetry.store.columns import concat_columns
from telemetry.store.keys import Keys
from telemetry.store import Coded, Columns, Ragged, SegmentWriter

SpanIds = Callable[[int], tuple[str | None, str | None]]


def _np(t: "torch.Tensor | np.ndarray") -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    try:
        return t.numpy()                       # CPU tensor without grad: a view, no copy
    except (RuntimeError, TypeError):          # on an accelerator, or tracking grad
        return t.detach().cpu().numpy()


def _cat(recs: list, field: str) -> np.ndarray:
    """One field of a batch of step records, flattened and concatenated in step order (tensors in
    one C++ call: a batch is hundreds of steps, and a Python call per step and field adds up)."""
    i = StepRecord._fields.index(field)
    ts = [r[i] for r in recs]
    if isinstance(ts[0], torch.Tensor):
        return _np(torch._utils._flatten_dense_tensors(ts))
    return np.concatenate([np.asarray(t).reshape(-1) for t in ts])


_READ_FIELDS = ("block_tables", "expected_gen", "slots_read", "found_gen", "bad_mask", "found_writers", "page_mass")


class _Batch:
    """A fold's step records, each thing a fold reads of them made once (a fold's writes, read runs
    and exposure index read the same): ``batch(field)`` a tensor field flattened and concatenated in
    step order (``_cat``); ``per_step`` a scalar per record, ``shape`` a field's extent per record;
    ``rows`` a per-batch-row list (incarnations, prompt lengths) concatenated, ``ids`` the (trace, span)
    pairs likewise. Consecutive records holding the very same lists - the engine hands its batch's
    lists over step after step while the batch stays (``PageLedger.on_step``) - convert them once:
    a Python call per step and field was about a tenth of a fold's CPU. Read only: nothing writes into what
    it returns."""

    def __init__(self, recs: list):
        self.recs = recs
        self._done: dict = {}
        first, last = [], None
        for i, r in enumerate(recs):
            key = (id(r.incs), id(r.ids), id(r.prompt_lens))
            if key != last:
                first.append(i)
                last = key
        self._first = first                                         # each run of records sharing the lists
        self._len = np.diff(np.append(first, len(recs)))

    def _memo(self, key, make):
        a = self._done.get(key)
        if a is None:
            a = self._done[key] = make()
        return a

    def __call__(self, field: str) -> np.ndarray:
        return self._memo(field, lambda: self._cat(field))

    def _cat(self, field: str) -> np.ndarray:
        """``_cat``, by ``torch.cat`` along the first dimension where the records' trailing extents
        agree - a step's written tokens [T], and each run of steps whose block tables have the same
        columns ([B, C], [B, C, S]): row-major, the same values in the same order, in a fifth of the
        time of flattening each tensor first (660 block tables of [8, 40]: 0.21 against 0.85 ms)."""
        i = StepRecord._fields.index(field)
        ts = [r[i] for r in self.recs]
        try:
            if isinstance(ts[0], np.ndarray) and ts[0].ndim == 1:
                return np.concatenate(ts)
            if isinstance(ts[0], torch.Tensor):
                if ts[0].dim() == 1:
                    return _np(torch.cat(ts))
                if field in _READ_FIELDS:
                    cut = np.flatnonzero(np.diff(self.shape("block_tables", 1))) + 1
                    parts = [torch.cat(ts[a:b]).reshape(-1) for a, b in zip([0, *cut], [*cut, len(ts)])]
                    return _np(torch.cat(parts) if len(parts) > 1 else parts[0])
        except (RuntimeError, TypeError, ValueError):      # extents that differ after all: each flattened
            pass
        return _cat(self.recs, field)

    def per_step(self, field: str) -> np.ndarray:
        return self._memo(("step", field), lambda: np.array([getattr(r, field) for r in self.recs], dtype=np.int64))

    def shape(self, field: str, axis: int) -> np.ndarray:
        i = StepRecord._fields.index(field)
        return self._memo(("shape", field, axis), lambda: np.array([r[i].shape[axis] for r in self.recs], dtype=np.int64))

    def rows(self, field: str) -> np.ndarray:
        def make() -> np.ndarray:
            parts = [np.tile(np.asarray(getattr(self.recs[f], field), dtype=np.int64), k)
                     for f, k in zip(self._first, self._len)]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._memo(("rows", field), make)

    def row_counts(self) -> np.ndarray:
        """Each record's batch rows (its incarnations)."""
        return self._memo("row_counts", lambda: np.repeat(
            np.array([len(self.recs[f].incs) for f in self._first], dtype=np.int64), self._len))

    def ids(self) -> list:
        return self._memo("ids", lambda: [x for f, k in zip(self._first, self._len) for _ in range(k)
                                          for x in self.recs[f].ids])

    def id_columns(self, rows: np.ndarray) -> dict[str, Coded]:
        """The trace and span id columns of the batch rows ``rows`` (indices into the concatenation),
        each distinct (trace, span) pair once in the columns' values: a segment's dictionary is the
        requests', not a copy per step (``writing_schema`` writes the values as they are)."""
        def make() -> tuple[np.ndarray, list]:
            uniq: dict = {}
            codes = [np.tile(np.array([uniq.setdefault(x, len(uniq)) for x in self.recs[f].ids], dtype=np.int32), k)
                     for f, k in zip(self._first, self._len)]
            return (np.concatenate(codes) if codes else np.zeros(0, np.int32)), list(uniq)
        codes, pairs = self._memo("id_codes", make)
        return {"trace_id": Coded(codes[rows], [t for t, _ in pairs]), "span_id": Coded(codes[rows], [s for _, s in pairs])}


def _index_reads(row_cells: np.ndarray, row_reader: np.ndarray, page, gen, sr, bad) \
        -> "tuple[np.ndarray, np.ndarray] | None":
    """The exposure index's holdings of a fold - every (page, generation, reader) read, once, in
    first-read order - and its failing cells, by ``kvl_index_reads`` (engine/kernels/read_runs.c);
    None where the kernels are not built (the numpy path runs)."""
    lib = native_kernels()
    if lib is None:
        return None
    i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)      # noqa: E731 (no copy when it is already)
    row_cells, row_reader, page, gen, sr, bad = map(i64, (row_cells, row_reader, page, gen, sr, bad))
    cap = len(page)
    holds, cells, n_bad = np.empty((max(cap, 1), 3), np.int64), np.empty(max(cap, 1), np.int64), np.zeros(1, np.int64)
    ptr = lambda a: a.ctypes.data                                  # noqa: E731
    n = lib.kvl_index_reads(len(row_cells), ptr(row_cells), ptr(row_reader), ptr(page), ptr(gen), ptr(sr), ptr(bad),
                            ptr(holds), ptr(cells), ptr(n_bad), cap)
    if n < 0:               # no memory for its set
        return None
    return holds[:n], cells[:int(n_bad[0])]


def _ts(n: int, ns: int) -> np.ndarray:
    return np.full(n, ns, dtype=np.int64)


def _dict(values: list, idx: np.ndarray) -> Coded:
    """A string column of len(idx) rows from a few distinct values (Arrow is built on the writer thread)."""
    return Coded(idx.astype(np.int32, copy=False), values)


def _take_all(q: deque) -> list:
    """Writer thread: everything queued so far (only this thread pops; producers only append)."""
    out = []
    while q:
        out.append(q.popleft())
    return out


def _coded(values: tuple) -> Coded:
    """Dictionary-coded strings from a few distinct values (node names, pseudonyms)."""
    names = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(names)}
    return Coded(np.array([index[v] for v in values], dtype=np.int32), names)


def forget_oldest_half(d: dict, cap: int) -> None:
    """Keep a per-incarnation map bounded in a long-running server: once it holds ``cap`` entries,
    the oldest half (insertion order) is forgotten."""
    if len(d) >= cap:
        for k in list(itertools.islice(d, cap // 2)):
            del d[k]


class Scopes:
    """incarnation -> its cache scope's pseudonym, registered when a request arrives (engine thread)
    and looked up per column on the writer thread: page_writes gets the writer's scope, page_reads
    the reader's and that of the writer found in every slot read. Bounded: past ``cap``
    incarnations the oldest half is forgotten, and a writer that old gets a NULL scope (its scope
    is still in its spans: forensics joins on the incarnation)."""

    def __init__(self, cap: int = 1 << 20):
        self.cap, self.code, self.values, self._index = cap, {}, [None], {}   # code 0: unknown / no writer

    def add(self, incarnation: int, scope_h: str) -> None:
        forget_oldest_half(self.code, self.cap)
        c = self._index.get(scope_h)
        if c is None:
            c = self._index[scope_h] = len(self.values)
            self.values.append(scope_h)
        self.code[incarnation] = c

    def of(self, incarnations: np.ndarray) -> Coded:
        """A scope column (any shape, e.g. [rows, slots]) for an array of incarnations."""
        u, inv = np.unique(incarnations, return_inverse=True)
        codes = np.fromiter((self.code.get(int(i), 0) for i in u), dtype=np.int32, count=len(u))
        return Coded(codes[inv.reshape(np.shape(incarnations))], list(self.values))


_INCARNATION = operator.attrgetter("req.incarnation")      # a scheduled batch row's reader
_tuple_new = tuple.__new__      # a NamedTuple made without its __new__'s Python frame (every step)


class StepRecord(NamedTuple):
    """One model step as the engine thread hands it to the writer thread: exactly the tensors the
    ledger reads (the step's own, immutable), never the logits or the layout's expected-tag plane."""
    node: str
    step: int
    lclock: int
    ts_ns: int
    incs: list                      # reader incarnation per batch row
    ids: list                       # (trace id, span id) per batch row
    prompt_lens: list
    page_size: int
    # what the step wrote, one entry per new token
    tok_batch: object               # [T] batch row
    positions: object               # [T]
    slot_pages: object              # [T]
    slot_offsets: object            # [T]
    gen_written: object             # [T] the page's generation when written
    new_writers: object             # [T]
    new_tags: object                # [T]
    # what its attention read, per batch row and block-table column
    block_tables: object            # [B, C] pages (-1: none)
    expected_gen: object            # [B, C]
    slots_read: object              # [B, C]
    found_gen: object               # [B, C]
    bad_mask: object                # [B, C]
    found_writers: object           # [B, C, S]
    page_mass: object               # [B, C]


class ReadRuns:
    """The open read runs of one node, kept on the writer thread as dense state per (reader, block
    column). Each read is linked to the one before it in the same (reader, column) when it found
    the same page, generation, found generation and failing slots, and either

    - the same slots with the same writer in each (a page read again as it was), or
    - one slot more, the others as before (the page the reader is filling with its own decode: its
      context grew by one token since the last read).

    A run is a chain of reads linked the same way (all "same" or all "one more"), so every read
    of it is exact: the k-th read of a run read ``slots_first + k`` slots if the run grows
    (``slots_read > slots_first``), else ``slots_read``, and found the run's writer in each (the
    last read's, which read them all). A read that does not link (or links the other way) closes
    the run and opens a new one. Steps come in batches (``add``), folded with a fixed number of
    array operations per batch, not per step; each read's link depends only on the read before it
    and that one's link, so any batching folds to the same rows. ``drain`` closes every open run
    (the store calls it at each flush, so a long decode shows up live). Lossless: every read step
    is inside exactly one row (n_reads, step range). With coalesce=False every read is its own row.

    State: one int64 array [readers, columns, fields], a run as its last read (the key fields
    first, so a read is compared with a run in one operation) plus the run's ranges and counts."""

    def __init__(self, node: str, page_size: int, coalesce: bool = True, scopes: "Scopes | None" = None,
                 native: bool = True):
        """``native``: fold in engine/kernels/read_runs.c where the kernels are built (the numpy fold
        below is the reference and the fallback)."""
        self.node, self.S, self.coalesce, self.native = node, page_size, coalesce, native
        self.scopes = scopes if scopes is not None else Scopes()
        self.K = 4 + page_size                      # page, generation, found_generation, bad_mask, writers[S]
        K = self.K
        # slots read (the last read's: the most), step / clock / time ranges, reads, slots the first
        # read read, and how the last read linked to the one before it (0: it did not, 1: same, 2: one more)
        (self.SR, self.SF, self.SL, self.LF, self.LL, self.N, self.TF, self.TL, self.SB, self.LK) = range(K, K + 10)
        self.slot_of: dict[int, int] = {}
        self.incs: list[int] = []
        self.ids: list[tuple] = []
        self._closed: list[tuple] = []
        self.I = np.zeros((0, 0, K + 10), dtype=np.int64)
        self.mass = np.zeros((0, 0))
        self.open = np.zeros((0, 0), dtype=bool)
        self._grow(16, 16)

    def _grow(self, R: int, C: int) -> None:
        r, c = self.open.shape
        I, mass, open_ = np.zeros((R, C, self.I.shape[2]), np.int64), np.zeros((R, C)), np.zeros((R, C), bool)
        I[:r, :c], mass[:r, :c], open_[:r, :c] = self.I, self.mass, self.open
        self.I, self.mass, self.open = I, mass, open_

    def _slots(self, incs: list[int], ids: list[tuple]) -> np.ndarray:
        out = []
        for inc, id_ in zip(incs, ids):
            s = self.slot_of.get(inc)
            if s is None:
                s = self.slot_of[inc] = len(self.incs)
                self.incs.append(inc)
                self.ids.append(id_)
            out.append(s)
        return np.asarray(out, dtype=np.int64)

    def add(self, steps: list[StepRecord], cat: "_Batch | None" = None) -> None:
        """Fold a batch of steps' reads into the runs, in step order, with one set of array
        operations for the whole batch: the reads are flattened, a stable sort by (reader, column)
        lines each one's reads up in step order, each read is linked to the one before it (or to
        the run open there), and a run starts wherever a read does not link or links the other
        way. Every run but the last of each (reader, column) closes; the last stays open."""
        S, K = self.S, self.K
        rs, last = [], (None, None)
        for st in steps:                        # a decode batch is usually the same readers step after step
            if st.incs != last[0]:
                last = (st.incs, self._slots(st.incs, st.ids))
            rs.append(last[1])
        cat = cat or _Batch(steps)
        R0, C0 = self.open.shape
        Bs, Cs = cat.shape("block_tables", 0), cat.shape("block_tables", 1)
        Cmax = int(Cs.max())
        if len(self.incs) > R0 or Cmax > C0:
            self._grow(max(R0, 2 * len(self.incs)), max(C0, Cmax))
        R, C = self.open.shape
        if self.coalesce and self.native and self._add_native(steps, rs, Bs, Cs, cat):
            return
        page, sr = cat("block_tables"), cat("slots_read")
        idx = np.flatnonzero((page >= 0) & (sr > 0))                          # the cells that read a page
        n = len(idx)
        if n == 0:
            return
        row_c = np.repeat(Cs, Bs)                                             # block-table rows, all steps
        cell_row = np.repeat(np.arange(len(row_c)), row_c)[idx]
        col = idx - (np.cumsum(row_c) - row_c)[cell_row]
        r = np.concatenate(rs)[cell_row]
        si = np.repeat(np.arange(len(steps)), Bs)[cell_row]
        if self.coalesce:       # line each (reader, column)'s reads up in step order (stable radix sort)
            g = r * C + col
            order = np.argsort(g.astype(np.uint16) if R * C <= 1 << 16 else g, kind="stable")
            idx, g, r, col, si = idx[order], g[order], r[order], col[order], si[order]
        sr = sr[idx]
        # each read as a run of one: the scalar fields by column (page, generation, found generation,
        # bad mask, then SR..LK), the writers found per slot by row (-1: slot not read)
        sc = np.empty((n, 14), dtype=np.int64, order="F")
        sc[:, 0], sc[:, 1], sc[:, 2], sc[:, 3] = page[idx], cat("expected_gen")[idx], cat("found_gen")[idx], cat("bad_mask")[idx]
        wk = cat("found_writers").reshape(-1, S)[idx]      # slots past sr: whatever is there (masked in rows())
        sc[:, 4], sc[:, 9], sc[:, 12], sc[:, 13] = sr, 1, sr, 0                # SR, N, SB, LK
        for a_, v in ((5, "step"), (7, "lclock"), (10, "ts_ns")):            # SF = SL, LF = LL, TF = TL
            sc[:, a_] = cat.per_step(v)[si]
            sc[:, a_ + 1] = sc[:, a_]
        mass = cat("page_mass")[idx].astype(np.float64)

        def rows(at: np.ndarray) -> np.ndarray:          # reads `at` as state rows [len, K + 10], -1: slot not read
            out = np.empty((len(at), K + 10), dtype=np.int64)
            out[:, :4], out[:, 4:K], out[:, K:] = sc[at, :4], np.where(np.arange(S) < sr[at, None], wk[at], -1), sc[at, 4:]
            return out
        if not self.coalesce:
            self._closed.append((r, col, rows(np.arange(n)), mass))
            return
        # how each read links to the read before it in its (reader, column): in this batch, or the
        # open run's last read for the first read of a (reader, column) here
        fresh = np.ones(n, dtype=bool)                                        # first read of its (reader, column) in this batch
        fresh[1:] = g[1:] != g[:-1]
        link, more = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        before = np.zeros(n, dtype=np.int64)                                  # how the read before linked (LK)
        if n > 1:
            link[1:], more[1:] = self._links(sc[:-1, :4], wk[:-1], sr[:-1], sc[1:, :4], wk[1:], sr[1:])
            link[1:] &= ~fresh[1:]
        fs = np.flatnonzero(fresh)
        fs = fs[self.open[r[fs], col[fs]]]                                    # ... where a run is open
        run = self.I[r[fs], col[fs]]
        if len(fs):
            link[fs], more[fs] = self._links(run[:, :4], run[:, 4:K], run[:, self.SR], sc[fs, :4], wk[fs], sr[fs])
            before[fs] = run[:, self.LK]
        lk = np.where(link, 1 + more, 0)
        before[1:] = np.where(fresh[1:], before[1:], lk[:-1])
        start = ~link | ((before != 0) & (lk != before))                      # a run links one way only
        sc[:, 13] = lk
        first = np.flatnonzero(start | fresh)                                 # segments; a fresh one that links extends the open run
        last = np.append(first[1:], n) - 1
        runs = rows(last)                                                     # a run's key and writers: its last read's
        for f in (self.SF, self.LF, self.TF, self.SB):
            runs[:, f] = sc[first, f - K + 4]
        runs[:, self.N] = np.add.reduceat(sc[:, 9], first)
        mass = np.add.reduceat(mass, first)
        rr, rc = r[first], col[first]
        if len(fs):
            ext = ~start[fs]                                                  # linked, the same way as the run
            seg = np.searchsorted(first, fs[ext])                             # the segments that go on an open run
            se = run[ext]
            for f in (self.SF, self.LF, self.TF, self.SB):
                runs[seg, f] = se[:, f]
            runs[seg, self.N] += se[:, self.N]
            mass[seg] += self.mass[r[fs[ext]], col[fs[ext]]]
            if not ext.all():                                                 # the open run closes
                self._closed.append((r[fs[~ext]], col[fs[~ext]], run[~ext], self.mass[r[fs[~ext]], col[fs[~ext]]]))
        stays = np.ones(len(first), dtype=bool)                               # the last run of each (reader, column)
        stays[:-1] = fresh[first[1:]]
        if not stays.all():
            done = ~stays
            self._closed.append((rr[done], rc[done], runs[done], mass[done]))
        rr, rc = rr[stays], rc[stays]
        self.I[rr, rc], self.mass[rr, rc], self.open[rr, rc] = runs[stays], mass[stays], True

    def _add_native(self, steps: list[StepRecord], rs: list[np.ndarray], Bs: np.ndarray, Cs: np.ndarray,
                    cat: "_Batch") -> bool:
        """``add`` in one pass of engine/kernels/read_runs.c (same state, same rows in the same order;
        a run's mass summed in read order). False, with nothing changed, where it cannot run: no
        kernels, found writers not contiguous int64 [B, C, S] (the numpy fold runs)."""
        lib = native_kernels()
        if lib is None:
            return False
        S, ptrs, sizes = self.S, [], []
        i64t = torch.int64
        for st in steps:
            fw = st.found_writers
            if isinstance(fw, torch.Tensor):
                if fw.dtype != i64t or not fw.is_cpu or not fw.is_contiguous():
                    return False
                ptrs.append(fw.data_ptr())
                sizes.append(fw.numel())
            elif isinstance(fw, np.ndarray) and fw.dtype == np.int64 and fw.flags.c_contiguous:
                ptrs.append(fw.ctypes.data)
                sizes.append(fw.size)
            else:
                return False
        if not np.array_equal(np.array(sizes, dtype=np.int64), Bs * Cs * S):
            return False
        ptrs = np.array(ptrs, dtype=np.int64)
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)          # noqa: E731 (no copy when it is already)
        page, egen, sr, fgen, mask = (i64(cat(f)) for f in ("block_tables", "expected_gen", "slots_read", "found_gen",
                                                           "bad_mask"))
        mass = np.ascontiguousarray(cat("page_mass"), dtype=np.float64)
        rows = i64(np.concatenate(rs))
        meta = [i64(cat.per_step(v)) for v in ("step", "lclock", "ts_ns")]
        R, W = self.open.shape
        F, cap = self.I.shape[2], len(page)       # a read closes at most one run
        out_rows, out_rc = np.empty((cap, F), np.int64), np.empty((cap, 2), np.int64)
        out_mass, out_kind = np.empty(cap), np.empty(cap, np.int64)
        Bs, Cs = i64(Bs), i64(Cs)
        ptr = lambda a: a.ctypes.data                                     # noqa: E731
        k = lib.kvl_fold_reads(len(steps), ptr(Bs), ptr(Cs), *map(ptr, meta), ptr(rows), ptr(page), ptr(egen), ptr(sr),
                               ptr(fgen), ptr(mask), ptr(mass), ptr(ptrs), S, R, W, ptr(self.I), ptr(self.mass),
                               ptr(self.open.view(np.uint8)), ptr(out_rows), ptr(out_rc), ptr(out_mass), ptr(out_kind),
                               cap)
        if k == -1:             # no memory for its scratch: nothing changed
            return False
        if k < 0:
            raise RuntimeError("read-run fold: more closed runs than reads (a kernel bug)")
        if k:                   # as the numpy fold lists them: runs open before the batch, then the batch's own,
            rc = out_rc[:k]     # each by (reader, column), then in step order
            order = np.lexsort((np.arange(k), rc[:, 0] * W + rc[:, 1], out_kind[:k]))
            self._closed.append((rc[order, 0], rc[order, 1], out_rows[:k][order], out_mass[:k][order]))
        return True

    def _links(self, pk, pw, psr, k, w, sr) -> tuple[np.ndarray, np.ndarray]:
        """Whether each read links to the read before it (same key; the same slots with the same
        writers, or one slot more and the others unchanged), and whether by one slot more."""
        d = sr - psr
        same_w = ((w == pw) | (np.arange(self.S) >= psr[:, None])).all(axis=1)   # slots the read before did not read do not count
        return (k == pk).all(axis=1) & same_w & ((d == 0) | (d == 1)), d == 1

    def _emit(self, r: np.ndarray, c: np.ndarray, blk: np.ndarray, mass: np.ndarray) -> Columns:
        n = len(r)
        reader = np.asarray(self.incs, dtype=np.int64)[r]
        return {"node": _dict([self.node], np.zeros(n)), "reader": reader, "scope_h": self.scopes.of(reader),
                "page": blk[:, 0].astype(np.int32), "generation": blk[:, 1], "found_generation": blk[:, 2],
                "block_index": c.astype(np.int32), "slots_read": blk[:, self.SR].astype(np.int16),
                "slots_first": blk[:, self.SB].astype(np.int16),
                "bad_mask": blk[:, 3], "check_passed": blk[:, 3] == 0, "found_writers": blk[:, 4:self.K],
                "found_scopes_h": self.scopes.of(blk[:, 4:self.K]),
                "attention_mass": mass.astype(np.float64), "step_first": blk[:, self.SF], "step_last": blk[:, self.SL],
                "lclock_first": blk[:, self.LF], "lclock_last": blk[:, self.LL],
                "n_reads": blk[:, self.N].astype(np.int32), "ts_first": blk[:, self.TF], "ts_last": blk[:, self.TL],
                "trace_id": _dict([t for t, _ in self.ids], r), "span_id": _dict([s for _, s in self.ids], r)}

    def drain(self) -> "Columns | None":
        """Every run closed since the last drain plus every open one, as rows; then forget the
        readers (their state slots are reused)."""
        r, c = np.nonzero(self.open)
        parts = self._closed + [(r, c, self.I[r, c], self.mass[r, c])]
        out = None
        if sum(len(p[0]) for p in parts):
            out = self._emit(*(np.concatenate([p[i] for p in parts]) for i in range(4)))
        self.open[:] = False
        self.slot_of.clear()
        self.incs, self.ids, self._closed = [], [], []
        return out


class PageLedger:
    def __init__(self, writer: SegmentWriter, keys: Keys, span_ids: SpanIds, coalesce: bool = True,
                 exposure_index: bool = True):
        self.writer, self.keys, self.span_ids, self.coalesce = writer, keys, span_ids, coalesce
        self.index_on = exposure_index          # keep the exposure index (telemetry/exposure_index.py)
        self.index_cpu_s = 0.0                  # writer thread CPU spent on it (bench/index.py)
        self.runs: dict[str, ReadRuns] = {}      # writer thread only: open read runs per node
        self.scopes = Scopes()
        self._pending: deque = deque()          # steps handed over by the engine, not yet folded (engine appends)
        self._pending_cells = 0                 # engine thread only
        self._cells_in = 0                      # block-table cells handed over (engine thread only)
        self._cells_out = 0                     # ... and folded (writer thread only)
        self._caught_up = threading.Event()     # set by the writer after each fold
        self.waited_s = 0.0                     # engine time spent waiting for a writer that fell behind
        self._batch: tuple = (None, None, None)  # engine thread only: the last step's incarnations, ids, prompt lengths
        self._gen_view: tuple | None = None     # engine thread only: (pool, numpy view of its generations)
        self._finished: deque = deque()         # (incarnation, prompt ids, output ids, tokenizer) of finished requests, not yet hashed
        self._streaming: dict = {}              # incarnation -> (request, tokenizer) still running (engine adds and drops)
        self._hashed: dict = {}                 # writer thread only: incarnation -> [prompt hashed, output tokens hashed]
        self._masks: dict[int, np.ndarray] = {}  # id(tokenizer) -> its content mask
        self._releases: deque = deque()         # releases not yet written (one tuple each)
        self._arrivals: deque = deque()         # requests admitted, not yet written (one tuple each)
        self.index: dict[str, NodeIndex] = {}   # writer thread only: the exposure index's state per node
        self.native = True                      # the index's holdings and failing cells by engine/kernels (where built)
        self._index_rows: list = []             # writer thread only: index rows not yet flushed
        # (node, page size, Writes or None, page_writes rows) of copies outside a step (landings, reloads,
        # offloads), not yet folded: taken by the same fold as the steps around them (not the writer's queue),
        # so a write is never in a later flush than a read of it (a store cut between flushes agrees)
        self._moved: deque = deque()
        writer.add_drain(self._drain)

    def _drain(self) -> list[tuple[str, Columns]]:
        """Writer thread, before every flush: the steps still waiting, and every read run."""
        out = self._take()
        out += [("page_reads", d) for r in self.runs.values() if (d := r.drain()) is not None]
        if self._index_rows:            # flushed with the page_reads rows it is derived from
            t0 = time.thread_time()
            rows, self._index_rows = self._index_rows, []
            out.append(("exposure_index", index_table(concat_columns(rows))))
            self.index_cpu_s += time.thread_time() - t0
        return out

    def _ids(self, incarnations: list[int], idx: np.ndarray) -> dict[str, Coded]:
        ids = [self.span_ids(i) for i in incarnations]
        return {"trace_id": _dict([t for t, _ in ids], idx), "span_id": _dict([s for _, s in ids], idx)}

    def _write_cols(self, node: str, n: int, lclock: "np.ndarray | int", pages, generation, offsets, positions,
                    writers, tags, path_idx: np.ndarray, paths: list[str], ids: dict[str, Coded],
                    ts: "np.ndarray | None" = None) -> dict:
        """page_writes columns: one row per run of slots written together (call on the writer thread
        where possible: it runs the keyed mix). Lossless: run i holds slots slot_first..+n_slots of
        its page at positions position_first..+n_slots, with one content tag per slot."""
        lc = np.full(n, lclock, dtype=np.int64) if isinstance(lclock, int) else _np(lclock).astype(np.int64)
        page, gen, off = _np(pages).astype(np.int32), _np(generation).astype(np.int64), _np(offsets).astype(np.int16)
        pos, wr, path = _np(positions).astype(np.int32), _np(writers).astype(np.int64), np.asarray(path_idx)
        start = np.ones(n, dtype=bool)
        if n > 1:       # a run goes on while page, generation, writer, path, clock and request stay and slot, position step by 1
            same = (page[1:] == page[:-1]) & (off[1:] == off[:-1] + 1) & (pos[1:] == pos[:-1] + 1)
            for c in (gen, wr, lc, path, *(c.codes for c in ids.values())):
                same &= c[1:] == c[:-1]
            start[1:] = ~same
        first = np.flatnonzero(start)
        bounds = np.append(first, n)
        ts = _ts(n, time.time_ns()) if ts is None else ts
        return {"node": _dict([node], np.zeros(len(first))), "lclock": lc[first], "ts": ts[first],
                "page": page[first], "generation": gen[first], "slot_first": off[first],
                "n_slots": np.diff(bounds).astype(np.int16), "position_first": pos[first], "writer": wr[first],
                "scope_h": self.scopes.of(wr[first]),
                "tag_h": Ragged(bounds, self.keys.tag_pseudonyms(_np(tags))), "path": _dict(paths, path[first]),
                **{k: Coded(np.asarray(c.codes)[first], c.values) for k, c in ids.items()}}

    # ---- a model step: its writes, then everything its attention read ---------------------------
    FOLD_CELLS = 65536   # block-table cells (reads) waiting before the writer thread is woken (also
                         # folded at every flush): many decode steps per batch of array calls
    MAX_WAITING_CELLS = 8 * FOLD_CELLS   # the bound on what waits for a writer that falls behind (an idle-
                         # priority one, under load that leaves no core idle): past it the engine waits
                         # until the writer has folded all but FOLD_CELLS (found writers alone: 8 x 65536 x
                         # page_size x 8 bytes, 64 MiB at 16)

    def on_step(self, engine, out) -> None:
        """Engine thread: capture what only exists now (page generations, the read check, ids) and
        hand the step's own (immutable) tensors over; the writer thread folds them in batches, at
        every flush and whenever FOLD_CELLS reads are waiting. A writer that falls behind by more
        than MAX_WAITING_CELLS blocks the engine until it catches up: memory stays bounded, and no
        step is lost."""
        # (every step, on the engine's thread: built without a Python call that can be spared - a map over
        # the batch, the generations through the pool's numpy view inline, the record made as a tuple)
        pool, lay, batch = engine.pool, out.layout, out.batch
        chk = out.read_check if out.read_check is not None else read_check(pool, lay)
        incs = list(map(_INCARNATION, batch))
        if incs != self._batch[0]:              # a decode batch is usually the same requests step after step
            self._batch = (incs, [self.span_ids(i) for i in incs], [len(s.req.prompt_ids) for s in batch])
        incs, ids, prompt_lens = self._batch
        view, pages = self._gen_view, getattr(out, "slot_pages_np", None)
        if view is None or view[0] is not pool or view[1] is None or pages is None:
            gens = self._generations(pool, out.slot_pages if pages is None else pages)
        else:
            gens = view[1][pages]
        self._pending.append(_tuple_new(StepRecord, (
            engine.cfg.node_id, engine.steps, engine.lclock, time.time_ns(), incs, ids, prompt_lens, pool.page_size,
            lay.tok_batch, lay.positions, out.slot_pages, out.slot_offsets, gens, out.new_writers, out.new_tags,
            lay.block_tables, lay.expected_gen, chk.slots_read, chk.found_gen, chk.bad_mask, chk.found_writers,
            out.page_mass)))
        self.writer.nudge()                     # an idle-priority writer's overdue flush goes ahead
        cells = lay.block_tables.numel()
        self._pending_cells += cells
        self._cells_in += cells
        if self._pending_cells >= self.FOLD_CELLS:
            self._pending_cells = 0
            self.writer.submit_lazy(self._take)
            if self._cells_in - self._cells_out > self.MAX_WAITING_CELLS:
                self._wait_for_writer()

    def _generations(self, pool, pages) -> "np.ndarray | torch.Tensor":
        """Engine thread: the pages' generations now (a copy). Through a numpy view of a CPU pool's
        headers (a torch index of a strided view is ~20 us a step, numpy's ~1)."""
        if self._gen_view is None or self._gen_view[0] is not pool:
            try:
                self._gen_view = (pool, pool.generation.numpy())
            except (RuntimeError, TypeError):       # an accelerator's pool: torch indexes it
                self._gen_view = (pool, None)
        view = self._gen_view[1]
        if view is None:
            return pool.generation[pages]
        return view[_np(pages)]

    def _wait_for_writer(self) -> None:
        """Engine thread: wait until the writer has folded all but FOLD_CELLS of what waits (or has
        stopped: its error reaches the engine on the next submit)."""
        t0 = time.perf_counter()
        while self._cells_in - self._cells_out > self.FOLD_CELLS and self.writer.accepting:
            self._caught_up.clear()
            if self._cells_in - self._cells_out <= self.FOLD_CELLS:
                break
            self._caught_up.wait(0.1)
        self.waited_s += time.perf_counter() - t0

    def _take(self) -> list[tuple[str, Columns]]:
        """Writer thread: fold every step waiting, per node in step order (its writes become
        page_writes rows, write runs; its reads go into the node's read runs), then the n-grams of
        the requests finished and the releases made since the last fold."""
        by_node: dict[str, list[StepRecord]] = {}
        cells = 0
        while self._pending:                    # only this thread pops; the engine only appends
            rec = self._pending.popleft()
            by_node.setdefault(rec.node, []).append(rec)
            cells += rec.block_tables.numel()
        moved: dict[str, list[Writes]] = {}     # (after the steps: a landing queued before a step is here)
        copied = []
        for node, page_size, w, rows in _take_all(self._moved):
            copied.append(("page_writes", rows))
            if w is None:
                continue
            moved.setdefault(node, []).append(w)
            if node not in self.index:
                self.index[node] = NodeIndex(node, page_size)
        for node in moved.keys() - by_node.keys():      # writes with no step: applied to the index's state
            self._index(node, None, moved[node])
        # arrivals first: a request's arrival is in the same flush as (or one before) its first read
        out = self._arrival_rows() + copied + [("page_writes", self._fold(node, recs, moved.get(node, [])))
                                               for node, recs in by_node.items()] \
            + self._ngrams() + self._release_rows()
        self._cells_out += cells                # (after the fold: what waits includes what is being folded)
        self._caught_up.set()
        return out

    def _fold(self, node: str, recs: list[StepRecord], moved: "list[Writes]" = ()) -> Columns:
        cat = _Batch(recs)
        n = cat.shape("tok_batch", 0)
        rows = cat.row_counts()                                              # each step's batch rows
        base = np.cumsum(rows) - rows                                        # ... where they start in the concatenation
        tb = cat("tok_batch").astype(np.int64, copy=False) + np.repeat(base, n)
        positions = cat("positions")
        runs = self.runs.get(node)
        if runs is None:
            runs = self.runs[node] = ReadRuns(node, recs[0].page_size, self.coalesce, self.scopes)
        runs.add(recs, cat)
        decode = positions >= cat.rows("prompt_lens")[tb]
        lc = np.repeat(cat.per_step("lclock"), n)
        ts = np.repeat(cat.per_step("ts_ns"), n)
        self._index(node, recs, [Writes(lc, cat("slot_pages"), cat("slot_offsets"), cat("gen_written"), cat("new_writers"),
                                        positions, decode.astype(np.int64), ts), *moved], cat)
        return self._write_cols(
            node, len(positions), lc, cat("slot_pages"), cat("gen_written"), cat("slot_offsets"), positions,
            cat("new_writers"), cat("new_tags"), decode,     # decode append
            ["prefill", "decode"], cat.id_columns(tb), ts)

    def _index(self, node: str, recs: "list[StepRecord] | None", writes: "list[Writes]", cat=None) -> None:
        """Writer thread: the exposure index's part of a fold - every read of the steps held (who
        read which page in which generation), the failing ones answered against the slots' last
        writes, then the fold's writes (the steps' and the landings' and reloads') applied."""
        if not self.index_on:
            return
        t0 = time.thread_time()
        try:
            self._index_fold(node, recs, writes, cat)
        finally:
            self.index_cpu_s += time.thread_time() - t0

    def _index_fold(self, node: str, recs: "list[StepRecord] | None", writes: "list[Writes]", cat=None) -> None:
        ix = self.index.get(node)
        if ix is None:
            ix = self.index[node] = NodeIndex(node, recs[0].page_size)
        reads = Reads()
        if recs:
            cat = cat or _Batch(recs)
            page, sr, gen = cat("block_tables"), cat("slots_read"), cat("expected_gen")
            Cs, Bs = cat.shape("block_tables", 1), cat.shape("block_tables", 0)
            row_reader = cat.rows("incs")
            row_c = np.repeat(Cs, Bs)
            bad = cat("bad_mask")
            got = _index_reads(row_c, row_reader, page, gen, sr, bad) if self.native else None
            if got is None:         # numpy: every read cell, its holdings by a lexsort
                reader = np.repeat(row_reader, row_c)
                read = (page >= 0) & (sr > 0)
                ix.hold(page[read], gen[read], reader[read])
                cells = np.flatnonzero(read & (bad != 0))
            else:
                holds, cells = got
                ix.hold(holds[:, 0], holds[:, 1], holds[:, 2], unique=True)
            if len(cells):
                cell_row = np.repeat(np.arange(len(row_c)), row_c)[cells]
                col = cells - (np.cumsum(row_c) - row_c)[cell_row]
                si = np.repeat(np.arange(len(recs)), Bs)[cell_row]
                step_of = lambda f: cat.per_step(f)[si]                      # noqa: E731
                ids = cat.ids()
                reads.update(reader=row_reader[cell_row], page=page[cells].astype(np.int64), generation=gen[cells].astype(np.int64),
                             found_generation=cat("found_gen")[cells].astype(np.int64), block_index=col.astype(np.int64),
                             bad_mask=bad[cells].astype(np.int64), slots_read=sr[cells].astype(np.int64),
                             step=step_of("step"), lclock=step_of("lclock"), ts=step_of("ts_ns"),
                             mass=cat("page_mass")[cells].astype(np.float64), ids=[ids[i] for i in cell_row])
        w = writes[0] if len(writes) == 1 else Writes.concat(writes) if writes else Writes(*(np.zeros(0, np.int64),) * 8)
        rows = ix.fold(w, reads)
        if rows is not None:
            self._index_rows.append(rows)

    # ---- records copied outside a step (host tier) ------------------------------------------------
    def on_moved(self, engine, req, path: str, pages: list[int], positions: torch.Tensor) -> None:
        S = engine.pool.page_size
        page_of = torch.tensor(pages, dtype=torch.long)[positions // S]
        offs = positions % S
        node = None
        if path == "offload":       # host pages (node "<node>/host"): the host tier's copy of the records
            host, node = engine.host, f"{engine.cfg.node_id}/host"
            tags = host.records[page_of, offs, :8].contiguous().view(torch.int64).flatten()
            writers = host.records[page_of, offs, 8:16].contiguous().view(torch.int64).flatten()
            gen = torch.zeros_like(page_of)
        else:
            tags, writers, gen = engine.pool.tags[page_of, offs], engine.pool.writers[page_of, offs], None
        n = positions.numel()
        gen = engine.pool.generation[page_of] if gen is None else gen
        ts = _ts(n, time.time_ns())
        w = None
        if node is None and self.index_on:      # a reload into the pool: the index sees it (an offload: the host tier)
            w = Writes(engine.lclock, _np(page_of), _np(offs), _np(gen), _np(writers), _np(positions), PATH_CODE[path], ts)
        self._moved.append((engine.cfg.node_id, S, w, self._write_cols(
            node or engine.cfg.node_id, n, engine.lclock, page_of, gen, offs, positions, writers, tags, np.zeros(n),
            [path], self._ids([req.incarnation], np.zeros(n)), ts)))

    # ---- a transfer: its writes as each call lands, then its verdict ---------------------------------
    def on_landed(self, engine, c: LandedRecords) -> None:
        """A landed call's writes (read back from the receiver's tag plane), as they landed: before
        any step of the receiver can read them, so the exposure index answers a read of a slot the
        transfer is still filling with the write that is there (not the one before it)."""
        n = c.positions.numel()
        if not n:
            return
        ts = _ts(n, time.time_ns())
        w = Writes(_np(c.lclock), _np(c.pages), _np(c.offsets), _np(c.generation), _np(c.writers), _np(c.positions),
                   PATH_CODE["transfer_landing"], ts) if self.index_on else None
        self._moved.append((engine.cfg.node_id, engine.pool.page_size, w, self._write_cols(
            engine.cfg.node_id, n, c.lclock, c.pages, c.generation, c.offsets, c.positions, c.writers, c.tags,
            np.zeros(n), ["transfer_landing"], self._ids([c.incarnation], np.zeros(n)), ts)))

    def on_transfer(self, engine, rec: TransferRecord) -> None:
        """The transfer's row (its slot sets and decode's verdict); its writes went out as they landed."""
        n = rec.landed.numel()
        trace, span = self.span_ids(rec.incarnation)
        reserved, landed = _np(rec.reserved), _np(rec.landed)
        ok = None if rec.checksum_dst is None else rec.checksum_dst == rec.checksum_src
        to_ns = perf_to_unix_ns
        self.writer.submit("transfers", pa.table({
            "transfer_id": [rec.transfer_id], "seq": [rec.seq], "incarnation": [rec.incarnation],
            "src_node": [rec.src_node], "dst_node": [rec.dst_node],
            "reserved_slots": [reserved.tolist()], "sent_slots": [_np(rec.sent).tolist()],
            "landed_slots": [landed.tolist()], "n_reserved": [len(reserved)], "n_sent": [rec.sent.numel()],
            "n_landed": [len(landed)], "landed_is_reserved": [bool(np.array_equal(np.sort(landed), np.sort(reserved)))],
            "checksum_src": [rec.checksum_src],
            "checksum_dst": [rec.checksum_dst], "checksum_ok": [ok], "outcome": [rec.outcome],
            "lclock_dst": [int(rec.landed_lclock.max()) if n else engine.lclock],
            "ts_submit": pa.array([to_ns(rec.submitted_at)], pa.timestamp("ns")),
            "ts_landed": pa.array([to_ns(rec.landed_at)], pa.timestamp("ns")), "trace_id": [trace], "span_id": [span]}))

    def on_arrived(self, engine, req) -> None:
        scope = self.keys.pseudonym(req.scope)
        self.scopes.add(req.incarnation, scope)
        self._arrivals.append((engine.cfg.node_id, req.incarnation, self.keys.pseudonym(req.tenant), scope,
                               len(req.prompt_ids), perf_to_unix_ns(req.arrival) or time.time_ns()))

    def _arrival_rows(self) -> list[tuple[str, Columns]]:
        got = _take_all(self._arrivals)
        if not got:
            return []
        node, inc, tenant, scope, prompt, ts = zip(*got)
        return [("arrivals", {"node": _coded(node), "incarnation": np.array(inc, dtype=np.int64),
                              "tenant_h": _coded(tenant), "scope_h": _coded(scope),
                              "prompt_tokens": np.array(prompt, dtype=np.int64), "ts": np.array(ts, dtype=np.int64)})]

    STREAMING_CAP = 1 << 16                     # running requests whose streamed tokens are hashed as they come

    def on_streaming(self, req, tokenizer=None) -> None:
        """Engine thread, at a request's arrival: its prompt, and its output as it is streamed, are
        hashed at every fold, so a response still running or cut off by a crash is judged for
        ``surfaced`` on what it had streamed (and a donor still running on its prompt)."""
        forget_oldest_half(self._streaming, self.STREAMING_CAP)   # those left out are hashed when they finish
        self._streaming[req.incarnation] = (req, tokenizer)

    def on_finished(self, req, tokenizer=None) -> None:
        """Engine thread: copies of the request's token lists; what is not hashed yet of them is
        hashed on the writer thread with every other request finished since the last fold, in one
        pass. ``tokenizer``: the engine's, for which tokens carry content (``content_mask``)."""
        self._streaming.pop(req.incarnation, None)
        self._finished.append((req.incarnation, list(req.prompt_ids), list(req.output_ids), tokenizer))

    def _content(self, tokenizer) -> np.ndarray | None:
        """The tokenizer's content mask, computed once per tokenizer on the writer thread."""
        if tokenizer is None or not hasattr(tokenizer, "content_mask"):
            return None
        key = id(tokenizer)
        if key not in self._masks:
            self._masks[key] = np.asarray(tokenizer.content_mask(), dtype=bool)
        return self._masks[key]

    def _ngrams(self) -> list[tuple[str, Columns]]:
        """Writer thread: the n-gram rows not written yet of every request finished since the last
        fold and of every request still running (its output so far): each window once, as if its
        whole lists had been hashed at the end (a window is new when it ends past what was hashed)."""
        parts: dict[int, tuple[object, list]] = {}        # id(tokenizer) -> (tokenizer, [(inc, role, tokens, offset)])

        def new_windows(inc: int, prompt, output: list, tok, state: list) -> None:
            _, todo = parts.setdefault(id(tok), (tok, []))
            if not state[0]:
                todo.append((inc, 0, list(prompt), 0))
                state[0] = True
            if len(output) > state[1]:
                off = max(0, state[1] - (NGRAM - 1))     # the first window not yet complete before
                todo.append((inc, 1, output[off:], off))
                state[1] = len(output)
        done = set()
        while self._finished:                   # only this thread pops; the engine only appends
            inc, prompt, output, tok = self._finished.popleft()
            done.add(inc)
            new_windows(inc, prompt, output, tok, self._hashed.pop(inc, None) or [False, 0])
        for inc, (req, tok) in list(self._streaming.items()):
            if inc not in done:                 # (a list's copy is atomic; the engine only appends to it)
                forget_oldest_half(self._hashed, 4 * self.STREAMING_CAP)
                new_windows(inc, req.prompt_ids, list(req.output_ids), tok, self._hashed.setdefault(inc, [False, 0]))
        out = []
        for tok, todo in parts.values():
            group, h, pos = ngram_hashes(self.keys, [t for _, _, t, _ in todo], content=self._content(tok))
            if len(h):
                inc, role, off = (np.array([x[i] for x in todo], dtype=np.int64) for i in (0, 1, 3))
                out.append(("ngrams", {"incarnation": inc[group], "role": _dict(["prompt", "output"], role[group]),
                                       "n": np.full(len(h), NGRAM, dtype=np.int16), "hash": h,
                                       "pos": (pos + off[group]).astype(np.int32)}))
        return out

    def on_release(self, engine, req, pages: list[int], kind: str, ended_by: str, hold_ns: int) -> None:
        """Any thread (a deferred release may end on a timer): one tuple; the rows are built on the
        writer thread, all releases since the last fold as one set of columns."""
        self._releases.append((engine.cfg.node_id, req.incarnation, list(pages), kind, ended_by, hold_ns, engine.lclock,
                               time.time_ns()))

    def _release_rows(self) -> list[tuple[str, Columns]]:
        rel = _take_all(self._releases)
        if not rel:
            return []
        node, inc, pages, kind, ended_by, hold, lclock, ts = zip(*rel)
        sizes = np.array([len(p) for p in pages], dtype=np.int64)

        coded = _coded
        return [("releases", {"node": coded(node), "incarnation": np.array(inc, dtype=np.int64),
                              "pages": Ragged(np.concatenate([[0], np.cumsum(sizes)]),
                                              np.fromiter((p for ps in pages for p in ps), dtype=np.int32, count=int(sizes.sum()))),
                              "kind": coded(kind), "ended_by": coded(ended_by), "hold_ns": np.array(hold, dtype=np.int64),
                              "lclock": np.array(lclock, dtype=np.int64), "ts": np.array(ts, dtype=np.int64)})]


NGRAM = 12          # tokens per n-gram for "surfaced" (long enough that shared prose is rare)
NGRAM_MIN_CONTENT = 4   # distinct content tokens an n-gram needs to be evidence (not 12 spaces, "----", "a a a")


def ngram_hashes(keys: Keys, token_lists: list[list[int]], n: int = NGRAM,
                 content: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The keyed hashes of every n-token window of each token list that can be evidence, all lists
    in one pass: (list index, hash, start position), ordered by list then position. A window is
    evidence only with at least ``NGRAM_MIN_CONTENT`` distinct content tokens (``content``: the
    tokenizer's mask of tokens holding a letter or digit; None: every token counts): whitespace,
    punctuation and one repeated token are nobody's data."""
    empty = np.zeros(0, dtype=np.int64)
    lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    if not (lens >= n).any():
        return empty, empty, empty
    total = int(lens.sum())
    toks = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.uint64, count=total)
    ends = np.cumsum(lens)
    group = np.repeat(np.arange(len(lens)), lens)[: total - n + 1]
    start = np.flatnonzero(np.arange(len(group)) + n <= ends[group])      # windows inside one list
    start = start[_distinct_content(toks, n, content)[start] >= NGRAM_MIN_CONTENT]
    h = keys.ngram_pseudonyms(np.lib.stride_tricks.sliding_window_view(toks, n)[start])
    g = group[start]
    return g, h, start - (ends - lens)[g]                # the window's first token, in its own list


def _distinct_content(toks: np.ndarray, n: int, content: np.ndarray | None) -> np.ndarray:
    """For the window ``toks[s:s + n]`` at every s (0 past the last): how many distinct tokens of it
    carry content, in a few passes over ``toks`` (no per-window sort). A token counts at its first
    place in a window: one whose last occurrence before it lies p places back (p < n) is a repeat
    in the windows that start between its own place - n + 1 and that occurrence's."""
    N = len(toks)
    if content is None:
        ok = np.ones(N, dtype=bool)
    elif len(content) == 0:
        ok = np.zeros(N, dtype=bool)
    else:
        mask = np.asarray(content, dtype=bool)
        ok = (toks < np.uint64(len(mask))) & mask[np.minimum(toks, np.uint64(len(mask) - 1)).astype(np.intp)]
    back = np.zeros(N, dtype=np.int64)              # places back to the token's last occurrence (0: none within n - 1)
    for k in range(n - 1, 0, -1):                   # (the nearest wins: written last)
        back[k:][toks[k:] == toks[:-k]] = k
    j = np.flatnonzero(ok & (back > 0))
    repeats = np.cumsum(np.bincount(np.maximum(j - n + 1, 0), minlength=N + 1)
                        - np.bincount(j - back[j] + 1, minlength=N + 1))
    held = np.concatenate([[0], np.cumsum(ok)])    # content tokens before each place
    out = np.zeros(N, dtype=np.int64)
    s = np.arange(max(N - n + 1, 0))
    out[: len(s)] = held[s + n] - held[s] - repeats[: len(s)]
    return out


_PERF_EPOCH_NS = time.time_ns() - time.perf_counter_ns()


def perf_to_unix_ns(t: float | None) -> int | None:
    return None if t is None else _PERF_EPOCH_NS + int(t * 1e9)
