"""The page ledger: who wrote and who read every KV slot, from the engine's own step tensors.

Rows are built from exactly what the attention op was given in that step (block tables, lengths,
expected generations and tags) and what its read check found, as numpy columns -> Arrow; they
go to the store's writer thread through a bounded queue. No per-read Python object, no span per
read. Read runs are coalesced on the writer thread (``coalesce_reads``), off the engine's path.

    page_writes   one row per slot written (prefill, decode, transfer_landing, offload, reload)
    page_reads    one row per (reader, page, generation, block column) run of identical findings
    transfers     one row per KV transfer verdict
    releases      one row per page-set release
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from engine.attention import read_check
from engine.recorder import TransferRecord
from telemetry.keys import Keys
from telemetry.store import SegmentWriter

SpanIds = Callable[[int], tuple[str | None, str | None]]
_READ_RUN_KEY = ["node", "reader", "block_index", "page", "generation"]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _ts(n: int, ns: int) -> pa.Array:
    return pa.array(np.full(n, ns, dtype=np.int64), pa.timestamp("ns"))


def _dict(values: list, idx: np.ndarray) -> pa.DictionaryArray:
    """A string column of len(idx) rows from a few distinct values (cast to string in C++ later)."""
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32)), pa.array(values, pa.string()))


def _lists(values: np.ndarray, width: int) -> pa.ListArray:
    n = len(values) // width if width else 0
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32) * width), pa.array(values))


def coalesce_reads(t: pa.Table) -> pa.Table:
    """Merge consecutive reads of one page by one reader that found the same thing (lossless:
    n_reads counts the steps, [step_first, step_last] spans them, attention mass is summed)."""
    df = pl.from_arrow(t).sort(_READ_RUN_KEY + ["lclock_first"])
    same = [pl.col(c) for c in _READ_RUN_KEY + ["found_generation", "bad_mask"]]
    df = df.with_columns(_w=pl.col("found_writers").hash())
    changed = pl.any_horizontal([(e != e.shift(1)).fill_null(True) for e in same + [pl.col("_w")]])
    df = df.with_columns(_run=changed.cum_sum())
    out = df.group_by("_run", maintain_order=True).agg(
        *[pl.col(c).first() for c in _READ_RUN_KEY + ["found_generation", "bad_mask", "check_passed",
                                                       "found_writers", "trace_id", "span_id"]],
        pl.col("slots_read").max(), pl.col("attention_mass").sum(),
        pl.col("step_first").min(), pl.col("step_last").max(), pl.col("lclock_first").min(),
        pl.col("lclock_last").max(), pl.col("n_reads").sum(), pl.col("ts_first").min(), pl.col("ts_last").max())
    return out.drop("_run").to_arrow()


class PageLedger:
    def __init__(self, writer: SegmentWriter, keys: Keys, span_ids: SpanIds):
        self.writer, self.keys, self.span_ids = writer, keys, span_ids

    def _ids(self, incarnations: list[int], idx: np.ndarray) -> dict[str, pa.Array]:
        ids = [self.span_ids(i) for i in incarnations]
        return {"trace_id": _dict([t for t, _ in ids], idx), "span_id": _dict([s for _, s in ids], idx)}

    def _writes(self, engine, pages: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor,
                writers: torch.Tensor, tags: torch.Tensor, path_idx: np.ndarray, paths: list[str],
                lclock: torch.Tensor | int, ids: dict[str, pa.Array], generation: torch.Tensor | None = None,
                node: str | None = None) -> None:
        n = pages.numel()
        if not n:
            return
        gen = engine.pool.generation[pages] if generation is None else generation
        lc = np.full(n, lclock, dtype=np.int64) if isinstance(lclock, int) else _np(lclock).astype(np.int64)
        self.writer.submit("page_writes", {
            "node": _dict([node or engine.cfg.node_id], np.zeros(n)), "lclock": lc, "ts": _ts(n, time.time_ns()),
            "page": _np(pages).astype(np.int32), "generation": _np(gen), "slot": _np(offsets).astype(np.int16),
            "position": _np(positions).astype(np.int32), "writer": _np(writers),
            "tag_h": self.keys.tag_pseudonyms(_np(tags)), "path": _dict(paths, path_idx), **ids})

    # ---- a model step: its writes, then everything its attention read ---------------------------
    def on_step(self, engine, out) -> None:
        lay, incs = out.layout, [s.req.incarnation for s in out.batch]
        tok_b = _np(lay.tok_batch)
        prompt_len = torch.tensor([len(s.req.prompt_ids) for s in out.batch])
        is_decode = _np((lay.positions >= prompt_len[lay.tok_batch]).to(torch.int32))
        self._writes(engine, out.slot_pages, out.slot_offsets, lay.positions, out.new_writers, out.new_tags,
                     is_decode, ["prefill", "decode"], engine.lclock, self._ids(incs, tok_b))
        chk = out.read_check if out.read_check is not None else read_check(engine.pool, lay)
        S = engine.pool.page_size
        read = (lay.block_tables >= 0) & (chk.slots_read > 0)                    # [B, C]
        b_idx, c_idx = (_np(x) for x in torch.nonzero(read, as_tuple=True))
        n = len(b_idx)
        slots_read = chk.slots_read[read]
        in_run = torch.arange(S)[None, :] < slots_read[:, None]
        writers = torch.where(in_run, chk.found_writers[read], -1)               # -1: slot not read
        ts = _ts(n, time.time_ns())
        self.writer.submit("page_reads", {
            "node": _dict([engine.cfg.node_id], np.zeros(n)), "reader": np.asarray(incs, dtype=np.int64)[b_idx],
            "page": _np(lay.block_tables[read]).astype(np.int32), "generation": _np(lay.expected_gen[read]),
            "found_generation": _np(chk.found_gen[read]), "block_index": c_idx.astype(np.int32),
            "slots_read": _np(slots_read).astype(np.int16), "bad_mask": _np(chk.bad_mask[read]),
            "check_passed": _np(chk.bad_slots[read] == 0), "found_writers": _lists(_np(writers).ravel(), S),
            "attention_mass": _np(out.page_mass[read]).astype(np.float64),
            "step_first": np.full(n, engine.steps, dtype=np.int64), "step_last": np.full(n, engine.steps, dtype=np.int64),
            "lclock_first": np.full(n, engine.lclock, dtype=np.int64), "lclock_last": np.full(n, engine.lclock, dtype=np.int64),
            "n_reads": np.ones(n, dtype=np.int32), "ts_first": ts, "ts_last": ts, **self._ids(incs, b_idx)})

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
        self._writes(engine, page_of, offs, positions, writers, tags, np.zeros(n), [path], engine.lclock,
                     self._ids([req.incarnation], np.zeros(n)), generation=gen, node=node)

    # ---- a transfer: its landed writes (read back from the receiver's tag plane) and its verdict ---
    def on_transfer(self, engine, rec: TransferRecord) -> None:
        idx = torch.searchsorted(rec.sent, rec.landed)
        pages, offs = rec.dst_pages[idx], rec.dst_offsets[idx]
        n = pages.numel()
        ids = self._ids([rec.incarnation], np.zeros(max(n, 1)))
        self._writes(engine, pages, offs, rec.landed, engine.pool.writers[pages, offs], engine.pool.tags[pages, offs],
                     np.zeros(n), ["transfer_landing"], rec.landed_lclock, {k: v[:n] for k, v in ids.items()})
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
