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
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from engine.attention import read_check
from engine.recorder import TransferRecord
from telemetry.keys import Keys
from telemetry.store import Coded, Columns, Ragged, SegmentWriter, concat_columns

SpanIds = Callable[[int], tuple[str | None, str | None]]


def _np(t: "torch.Tensor | np.ndarray") -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    try:
        return t.numpy()                       # CPU tensor without grad: a view, no copy
    except (RuntimeError, TypeError):          # on an accelerator, or tracking grad
        return t.detach().cpu().numpy()


def _ts(n: int, ns: int) -> np.ndarray:
    return np.full(n, ns, dtype=np.int64)


def _dict(values: list, idx: np.ndarray) -> Coded:
    """A string column of len(idx) rows from a few distinct values (Arrow is built on the writer thread)."""
    return Coded(idx.astype(np.int32, copy=False), values)


class Scopes:
    """incarnation -> its cache scope's pseudonym, registered when a request arrives (engine thread)
    and looked up per column on the writer thread: page_writes gets the writer's scope, page_reads
    the reader's and that of the writer found in every slot read. Bounded: past ``cap``
    incarnations the oldest half is forgotten, and a writer that old gets a NULL scope (its scope
    is still in its spans: forensics joins on the incarnation)."""

    def __init__(self, cap: int = 1 << 20):
        self.cap, self.code, self.values, self._index = cap, {}, [None], {}   # code 0: unknown / no writer

    def add(self, incarnation: int, scope_h: str) -> None:
        if len(self.code) >= self.cap:
            for k in list(itertools.islice(self.code, self.cap // 2)):
                del self.code[k]
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


class ReadRuns:
    """The open read runs of one node, kept on the writer thread as dense state per (reader, block
    column): each step's [B, C] read tensors are compared with it in a few array operations, a
    read that found the same thing as the run open there (page, generation, found generation,
    failing slots, the writer of every slot) extends it (n_reads, step/clock/time range, attention
    mass), any other read closes that run (it becomes a row) and opens a new one. ``drain`` closes
    every open run (the store calls it at each flush, so a long decode shows up live). Lossless:
    every read step is inside exactly one row. With coalesce=False every read is its own row.

    State: one int64 array [readers, columns, fields]; the key fields (what a read found) come first
    so a run is compared with a read in one operation."""

    def __init__(self, node: str, page_size: int, coalesce: bool = True, scopes: "Scopes | None" = None):
        self.node, self.S, self.coalesce = node, page_size, coalesce
        self.scopes = scopes if scopes is not None else Scopes()
        self.K = 4 + page_size                      # page, generation, found_generation, bad_mask, writers[S]
        K = self.K
        self.SR, self.SF, self.SL, self.LF, self.LL, self.N, self.TF, self.TL = range(K, K + 8)
        self.slot_of: dict[int, int] = {}
        self.incs: list[int] = []
        self.ids: list[tuple] = []
        self._closed: list[tuple] = []
        self.I = np.zeros((0, 0, K + 8), dtype=np.int64)
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

    def add(self, step: int, lclock: int, ts_ns: int, incs: list[int], ids: list[tuple], lay, chk, page_mass) -> None:
        B, C = lay.block_tables.shape
        rs = self._slots(incs, ids)
        R0, C0 = self.open.shape
        if len(self.incs) > R0 or C > C0:
            self._grow(max(R0, 2 * len(self.incs)), max(C0, C))
        page, sr = _np(lay.block_tables), _np(chk.slots_read)
        valid = (page >= 0) & (sr > 0)                                           # [B, C]: pages this step read
        key = np.empty((B, C, self.K), dtype=np.int64)                           # what each read found
        key[..., 0], key[..., 1], key[..., 2], key[..., 3] = page, _np(lay.expected_gen), _np(chk.found_gen), _np(chk.bad_mask)
        key[..., 4:] = np.where(np.arange(self.S) < sr[..., None], _np(chk.found_writers), -1)   # -1: slot not read
        mass = _np(page_mass)
        ri, ci = rs[:, None], np.arange(C)[None, :]
        st, was_open = self.I[ri, ci], self.open[ri, ci]                         # [B, C, F]: the runs open there
        same = valid & was_open & (st[..., :self.K] == key).all(axis=-1) if self.coalesce else np.zeros_like(valid)
        new = valid & ~same
        b, c = np.nonzero(new & was_open)
        if len(b):          # closed runs: kept as state rows, made columns once per flush (drain)
            self._closed.append((rs[b], c, st[b, c], self.mass[rs[b], c]))
        b, c = np.nonzero(same)
        if len(b):
            r, blk = rs[b], st[b, c]
            blk[:, self.SL], blk[:, self.LL], blk[:, self.TL] = step, lclock, ts_ns
            blk[:, self.N] += 1
            blk[:, self.SR] = np.maximum(blk[:, self.SR], sr[b, c])
            self.I[r, c] = blk
            self.mass[r, c] += mass[b, c]
        b, c = np.nonzero(new)
        if len(b):
            r, blk = rs[b], np.empty((len(b), self.I.shape[2]), dtype=np.int64)
            blk[:, :self.K], blk[:, self.SR] = key[b, c], sr[b, c]
            blk[:, self.SF] = blk[:, self.SL] = step
            blk[:, self.LF] = blk[:, self.LL] = lclock
            blk[:, self.TF] = blk[:, self.TL] = ts_ns
            blk[:, self.N] = 1
            self.I[r, c], self.mass[r, c], self.open[r, c] = blk, mass[b, c], True

    def _emit(self, r: np.ndarray, c: np.ndarray, blk: np.ndarray, mass: np.ndarray) -> Columns:
        n = len(r)
        reader = np.asarray(self.incs, dtype=np.int64)[r]
        return {"node": _dict([self.node], np.zeros(n)), "reader": reader, "scope_h": self.scopes.of(reader),
                "page": blk[:, 0].astype(np.int32), "generation": blk[:, 1], "found_generation": blk[:, 2],
                "block_index": c.astype(np.int32), "slots_read": blk[:, self.SR].astype(np.int16),
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
    def __init__(self, writer: SegmentWriter, keys: Keys, span_ids: SpanIds, coalesce: bool = True):
        self.writer, self.keys, self.span_ids, self.coalesce = writer, keys, span_ids, coalesce
        self.runs: dict[str, ReadRuns] = {}      # writer thread only: open read runs per node
        self.step_writes: dict[str, list] = {}  # writer thread only: each step's writes, built per flush
        self.scopes = Scopes()
        writer.add_drain(self._drain)

    def _drain(self) -> list[tuple[str, Columns]]:
        """Writer thread, before every flush: the steps' writes and read runs since the last one."""
        out = [("page_reads", d) for r in self.runs.values() if (d := r.drain()) is not None]
        for node, parts in self.step_writes.items():
            if parts:
                cols = [np.concatenate([p[i] for p in parts]) for i in range(9)]
                ids = concat_columns([p[9] for p in parts])
                out.append(("page_writes", self._write_cols(node, len(cols[0]), *cols[:8], ["prefill", "decode"], ids, cols[8])))
        self.step_writes = {}
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
    def on_step(self, engine, out) -> None:
        """Engine thread: capture what only exists now (page generations, the read check, ids);
        the columns are built on the writer thread from the step's own (immutable) tensors."""
        chk = out.read_check if out.read_check is not None else read_check(engine.pool, out.layout)
        incs = [s.req.incarnation for s in out.batch]
        snap = (engine.cfg.node_id, engine.steps, engine.lclock, time.time_ns(), incs,
                [self.span_ids(i) for i in incs], [len(s.req.prompt_ids) for s in out.batch],
                engine.pool.generation[out.slot_pages], engine.pool.page_size, out, chk)
        self.writer.submit_lazy(lambda: self._step_rows(*snap))

    def _step_rows(self, node, steps, lclock, ts_ns, incs, ids, prompt_lens, gen_written, S, out, chk):
        """Writer thread: a step's writes are kept as arrays (columns are built once per flush) and its
        reads go into the node's read runs."""
        lay = out.layout
        tok_b = _np(lay.tok_batch)
        n = len(tok_b)
        is_decode = _np(lay.positions) >= np.asarray(prompt_lens)[tok_b]
        self.step_writes.setdefault(node, []).append((
            np.full(n, lclock, dtype=np.int64), _np(out.slot_pages), _np(gen_written), _np(out.slot_offsets),
            _np(lay.positions), _np(out.new_writers), _np(out.new_tags), is_decode,
            np.full(n, ts_ns, dtype=np.int64),
            {"trace_id": _dict([t for t, _ in ids], tok_b), "span_id": _dict([s for _, s in ids], tok_b)}))
        runs = self.runs.get(node)
        if runs is None:
            runs = self.runs[node] = ReadRuns(node, S, self.coalesce, self.scopes)
        runs.add(steps, lclock, ts_ns, incs, ids, lay, chk, out.page_mass)
        return []

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
        self.writer.submit("page_writes", self._write_cols(node or engine.cfg.node_id, n, engine.lclock, page_of, gen, offs,
                                                           positions, writers, tags, np.zeros(n), [path],
                                                           self._ids([req.incarnation], np.zeros(n))))

    # ---- a transfer: its landed writes (read back from the receiver's tag plane) and its verdict ---
    def on_transfer(self, engine, rec: TransferRecord) -> None:
        n = rec.landed.numel()
        if n:       # what landed, as it landed (generation, tags and writer captured by the link per call)
            self.writer.submit("page_writes", self._write_cols(
                engine.cfg.node_id, n, rec.landed_lclock, rec.landed_pages, rec.landed_gen, rec.landed_offsets,
                rec.landed, rec.landed_writers, rec.landed_tags, np.zeros(n), ["transfer_landing"],
                self._ids([rec.incarnation], np.zeros(n))))
        trace, span = self.span_ids(rec.incarnation)
        reserved, landed = _np(rec.reserved), _np(rec.landed)
        ok = None if rec.checksum_dst is None else rec.checksum_dst == rec.checksum_src
        to_ns = _perf_to_unix_ns
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

    def on_arrived(self, req) -> None:
        self.scopes.add(req.incarnation, self.keys.pseudonym(req.scope))

    def on_finished(self, req) -> None:
        for role, toks in (("prompt", req.prompt_ids), ("output", req.output_ids)):
            h = ngram_hashes(self.keys, toks)
            if len(h):
                self.writer.submit("ngrams", {"incarnation": np.full(len(h), req.incarnation, dtype=np.int64),
                                              "role": _dict([role], np.zeros(len(h))),
                                              "n": np.full(len(h), NGRAM, dtype=np.int16), "hash": h})

    def on_release(self, engine, req, pages: list[int], kind: str, ended_by: str, hold_ns: int) -> None:
        self.writer.submit("releases", pa.table({
            "node": [engine.cfg.node_id], "incarnation": [req.incarnation], "pages": [list(pages)], "kind": [kind],
            "ended_by": [ended_by], "hold_ns": [hold_ns], "lclock": [engine.lclock],
            "ts": pa.array([time.time_ns()], pa.timestamp("ns"))}))


NGRAM = 12          # tokens per n-gram for "surfaced" (long enough that shared prose is rare)


def ngram_hashes(keys: Keys, tokens: list[int], n: int = NGRAM) -> np.ndarray:
    """Distinct keyed hashes of every n-token window (polynomial hash, then the keyed mix)."""
    if len(tokens) < n:
        return np.zeros(0, dtype=np.int64)
    win = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, dtype=np.uint64), n)
    powers = np.uint64(0x100000001B3) ** np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (win * powers).sum(axis=1, dtype=np.uint64)
    return np.unique(keys.tag_pseudonyms(h.view(np.int64)))


_PERF_EPOCH_NS = time.time_ns() - time.perf_counter_ns()


def _perf_to_unix_ns(t: float | None) -> int | None:
    return None if t is None else _PERF_EPOCH_NS + int(t * 1e9)
