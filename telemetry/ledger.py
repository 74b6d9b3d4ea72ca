"""The page ledger: who wrote and who read every KV slot, from the engine's own step tensors.

Rows are built from exactly what the attention op was given in that step (block tables, lengths,
expected generations and tags) and what its read check found, as numpy columns -> Arrow; they
go to the store's writer thread through a bounded queue. No per-read Python object, no span per
read. Read runs are coalesced on the writer thread (``coalesce_reads``), off the engine's path.

    page_writes   one row per run of slots written together (prefill, decode, transfer_landing,
                  offload, reload), with one content tag per slot
    page_reads    one row per (reader, page, generation, block column) run of identical findings
    transfers     one row per KV transfer verdict
    releases      one row per page-set release
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from engine.attention import read_check
from engine.recorder import TransferRecord
from telemetry.keys import Keys
from telemetry.store import Coded, Columns, Ragged, SegmentWriter, take_columns

SpanIds = Callable[[int], tuple[str | None, str | None]]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _ts(n: int, ns: int) -> np.ndarray:
    return np.full(n, ns, dtype=np.int64)


def _dict(values: list, idx: np.ndarray) -> Coded:
    """A string column of len(idx) rows from a few distinct values (Arrow is built on the writer thread)."""
    return Coded(idx.astype(np.int32, copy=False), values)


def coalesce_reads(c: Columns) -> Columns:
    """Merge consecutive reads of one page by one reader that found the same thing (lossless:
    n_reads counts the steps, [step_first, step_last] spans them, attention mass is summed).
    Runs on the writer thread on numpy columns, before any Arrow is built: rows are grouped by a
    hash of their key (stable, in logical-clock order within a key), then runs are cut wherever a
    key field or a finding differs from the previous row - compared exactly, so a hash collision
    can only split a run, never merge two different ones."""
    n = len(c["reader"])
    if n == 0:
        return c
    keys = [c["node"].codes, c["reader"], c["block_index"], c["page"], c["generation"]]
    with np.errstate(over="ignore"):
        h = np.zeros(n, dtype=np.uint64)
        for k, mul in zip(keys, _MUL):
            h = (h ^ k.astype(np.int64, copy=False).view(np.uint64)) * mul
            h ^= h >> np.uint64(29)
    order = np.lexsort((c["lclock_first"], h))
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for f in (*keys, c["found_generation"], c["bad_mask"]):
        fs = f[order]
        change[1:] |= fs[1:] != fs[:-1]
    w = c["found_writers"][order]
    change[1:] |= (w[1:] != w[:-1]).any(axis=1)
    starts = np.flatnonzero(change)
    out = take_columns(c, order[starts])
    for name, ufunc in (("slots_read", np.maximum), ("attention_mass", np.add), ("step_first", np.minimum),
                        ("step_last", np.maximum), ("lclock_first", np.minimum), ("lclock_last", np.maximum),
                        ("n_reads", np.add), ("ts_first", np.minimum), ("ts_last", np.maximum)):
        out[name] = ufunc.reduceat(c[name][order], starts).astype(c[name].dtype, copy=False)
    return out


_MUL = [np.uint64(m) for m in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xFF51AFD7ED558CCD,
                               0xC4CEB9FE1A85EC53)]


class PageLedger:
    def __init__(self, writer: SegmentWriter, keys: Keys, span_ids: SpanIds):
        self.writer, self.keys, self.span_ids = writer, keys, span_ids

    def _ids(self, incarnations: list[int], idx: np.ndarray) -> dict[str, Coded]:
        ids = [self.span_ids(i) for i in incarnations]
        return {"trace_id": _dict([t for t, _ in ids], idx), "span_id": _dict([s for _, s in ids], idx)}

    def _write_cols(self, node: str, n: int, lclock: "np.ndarray | int", pages, generation, offsets, positions,
                    writers, tags, path_idx: np.ndarray, paths: list[str], ids: dict[str, Coded]) -> dict:
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
        return {"node": _dict([node], np.zeros(len(first))), "lclock": lc[first], "ts": _ts(len(first), time.time_ns()),
                "page": page[first], "generation": gen[first], "slot_first": off[first],
                "n_slots": np.diff(bounds).astype(np.int16), "position_first": pos[first], "writer": wr[first],
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
        lay = out.layout
        tok_b = _np(lay.tok_batch)
        traces, spans = [t for t, _ in ids], [s for _, s in ids]
        is_decode = _np((lay.positions >= torch.tensor(prompt_lens)[lay.tok_batch]).to(torch.int32))
        writes = self._write_cols(node, len(tok_b), lclock, out.slot_pages, gen_written, out.slot_offsets,
                                  lay.positions, out.new_writers, out.new_tags, is_decode, ["prefill", "decode"],
                                  {"trace_id": _dict(traces, tok_b), "span_id": _dict(spans, tok_b)})
        read = ((lay.block_tables >= 0) & (chk.slots_read > 0)).flatten()      # [B*C]: pages this step read
        flat = torch.nonzero(read).flatten()
        n = flat.numel()
        # one gather for every [B, C] column: page, granted gen, found gen, slots read, bad mask, bad count
        cols = torch.stack([lay.block_tables, lay.expected_gen, chk.found_gen, chk.slots_read, chk.bad_mask,
                            chk.bad_slots]).flatten(1)[:, flat].numpy()
        C = lay.block_tables.shape[1]
        b_idx, c_idx = (flat // C).numpy(), (flat % C).numpy()
        in_run = torch.arange(S)[None, :] < torch.from_numpy(cols[3])[:, None]
        writers = torch.where(in_run, chk.found_writers.flatten(0, 1)[flat], -1).numpy()   # -1: slot not read
        ts, step, lc = _ts(n, ts_ns), np.full(n, steps, dtype=np.int64), np.full(n, lclock, dtype=np.int64)
        reads = {
            "node": _dict([node], np.zeros(n)), "reader": np.asarray(incs, dtype=np.int64)[b_idx],
            "page": cols[0].astype(np.int32), "generation": cols[1], "found_generation": cols[2],
            "block_index": c_idx.astype(np.int32), "slots_read": cols[3].astype(np.int16), "bad_mask": cols[4],
            "check_passed": cols[5] == 0, "found_writers": writers,
            "attention_mass": out.page_mass.flatten()[flat].numpy().astype(np.float64),
            "step_first": step, "step_last": step, "lclock_first": lc, "lclock_last": lc,
            "n_reads": np.ones(n, dtype=np.int32), "ts_first": ts, "ts_last": ts,
            "trace_id": _dict(traces, b_idx), "span_id": _dict(spans, b_idx)}
        return [("page_writes", writes), ("page_reads", reads)]

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
        ok = None if rec.checksum_dst is None else rec.checksum_dst == rec.checksum_src
        to_ns = _perf_to_unix_ns
        self.writer.submit("transfers", pa.table({
            "transfer_id": [rec.transfer_id], "seq": [rec.seq], "incarnation": [rec.incarnation],
            "src_node": [rec.src_node], "dst_node": [rec.dst_node],
            "reserved_slots": [_np(rec.reserved).tolist()], "sent_slots": [_np(rec.sent).tolist()],
            "landed_slots": [_np(rec.landed).tolist()], "checksum_src": [rec.checksum_src],
            "checksum_dst": [rec.checksum_dst], "checksum_ok": [ok], "outcome": [rec.outcome],
            "lclock_dst": [int(rec.landed_lclock.max()) if n else engine.lclock],
            "ts_submit": pa.array([to_ns(rec.submitted_at)], pa.timestamp("ns")),
            "ts_landed": pa.array([to_ns(rec.landed_at)], pa.timestamp("ns")), "trace_id": [trace], "span_id": [span]}))

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
