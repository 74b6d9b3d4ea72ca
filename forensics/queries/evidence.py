"""The n-gram evidence (``exposure_ngrams``) of a snapshot, built from rows kept since the last
snapshot of the same store instead of two scans of the whole ``ngrams`` table.

``exposure_ngrams.sql`` is the rule. It reads ``ngrams`` twice: the rows of every pair's
incarnations (``ng``), then every row holding a candidate hash (``hits``) - at 256 M n-gram rows
about 3 s of a 4 s build, on every new snapshot of a live store (a dashboard refresh). Here the
same answer comes in three steps (``forensics/sql/evidence/``): the pairs' responses, the
candidates from ``_ng`` - those responses' output rows - and ``_hits`` - every row holding one of
their output hashes, where the donors' prompt rows that can match are - then the answer from
``_candidates`` and ``_hits`` (its rows of the candidate hashes). A response's prompt and a donor's
are read only where they hold one of those hashes: at 121 M read rows the pairs' 3,575
incarnations' rows were 2.3 M, almost all prompt rows, against 0.19 M output rows and 0.3 M rows of
the outputs' hashes; and a store written since the writer puts a segment's output rows in row groups
of their own (``telemetry/store/columns.APART``) has the outputs' lookup read only those.
``_ng`` and ``_hits`` are
kept in this process per store, with the segment files, incarnations and hashes they cover: on a
later snapshot whose segments include those files, only the new segments are read for the
covered incarnations and hashes, and the whole table only for incarnations or hashes not covered
yet (a new exposure). Rows of more incarnations or hashes than a snapshot needs change nothing:
every use joins on a pair or a candidate. Segments are immutable and named once in the chain; a
file is known by its path, inode, size and change time, so a store replaced at the same path, a
segment left out as damaged or rewritten starts from scratch.

When nothing the answer reads has changed since the kept snapshot - the same pairs and donor
positions (``evidence/digest``), no new ``_ng`` or ``_hits`` rows, the same tenant and arrival of
every request those rows name (``evidence/requests_digest``) - the kept answer is the answer: a
live store taking healthy traffic (no new exposure, none of the candidate n-grams) skips steps 2
and 3.

A build that read the whole table, or that made a new answer, also leaves the kept rows and that
answer (its candidates and digests) in the state directory (beside the kept answers,
``answers.py``: the same custody and the same switch, ``KVLEDGER_ANSWER_CACHE``), at most every
``SAVE_EVERY`` seconds: the next process - a command, a restarted dashboard - starts from them and
reads only the segments added since, and reuses the answer on the same terms as above where the
same steps' SQL and DuckDB made it (the digests are DuckDB hashes). An unreadable or partial entry
is ignored.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from forensics.queries.answers import (enabled as kept_on_disk, entry_written, file_key as _stat, read_kept,
                                      write_entry_later)
from telemetry.store import carried, table_relation
from telemetry.store.keys import state_dir

COLUMNS = ["incarnation", "role", "hash", "n", "pos"]
KEEP = 4                    # stores whose rows this process keeps (a dashboard reads one)
SAVE_EVERY = 30.0           # seconds between two saves of one store's rows to the state directory


@dataclass
class _Kept:
    files: dict[str, tuple[int, int, int]]      # segment path -> (inode, size, ctime ns)
    incs: set[int]          # _ng holds every output row of these incarnations in those files
    hashes: set[int]        # _hits holds every row with these hashes in those files
    ng: pa.Table
    hits: pa.Table
    digest: tuple | None = None         # evidence/digest of the snapshot that built the answer below
    candidates: pa.Table | None = None  # its step 2 result ...
    requests: tuple | None = None       # ... evidence/requests_digest then ...
    answer: pa.Table | None = None      # ... and exposure_ngrams (saved with the rows, under the SQL's ident)


LAYOUT = 2          # what _ng and _hits hold (2: the responses' output rows, and the rows of their output
                    # hashes with every column): a kept entry of another layout is not read
_KEPT: dict[str, _Kept] = {}
_SAVED: dict[str, float] = {}        # store -> when its rows were last saved
_LOCK = threading.Lock()
stats = {"whole_scans": 0, "new_segment_reads": 0, "loaded": 0, "reused": 0,     # what the builds did (tests)
         "carried": 0, "rebuilt": 0}


def _dir(key: str) -> Path:
    return state_dir() / "evidence" / hashlib.sha256(f"{LAYOUT}:{key}".encode()).hexdigest()[:32]


STEPS = ("pairs", "read_runs", "digest", "candidates", "requests_digest", "final")
FOLD = "read_runs: numpy 1"     # step 1a's fold in Python (read_runs): a kept answer depends on it too




def _ident(sql) -> str:
    """What a kept answer depends on besides the rows: the steps' SQL and the DuckDB that ran them
    (the digests are DuckDB hashes)."""
    return hashlib.sha256(json.dumps([[sql(f"evidence/{s}") for s in STEPS], FOLD, duckdb.__version__]).encode()).hexdigest()


def _load(key: str, ident: str) -> _Kept | None:
    """The rows a process left for this store, or None (none, unreadable, partial); with them the
    answer it built last (its candidates, digests and exposure_ngrams) where the same SQL and DuckDB
    made it - a new process whose snapshot reads the same pairs and rows then runs no step 2 or 3."""
    d = _dir(key)
    entry_written(d)
    try:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("store") != key or meta.get("layout") != LAYOUT:
            return None

        def table(name: str) -> pa.Table:
            t = read_kept(d / f"{name}-{meta['gen']}.arrow")
            if t.num_rows != meta[f"{name}_rows"]:
                raise ValueError(f"{name}: a partial table")
            return t
        ng, hits = table("ng"), table("hits")
        files = {f: tuple(st) for f, st in meta["files"].items()}
        kept = _Kept(files, set(meta["incs"]), set(meta["hashes"]), ng, hits)
        if meta.get("answer_ident") == ident:
            kept.candidates, kept.answer = table("candidates"), table("answer")
            kept.digest, kept.requests = tuple(meta["digest"]), tuple(meta["requests"])
        stats["loaded"] += 1
        return kept
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None


def _save(key: str, kept: _Kept, ident: str) -> None:
    """Write the rows, the last answer and the meta that names them (answers.write_entry), on a
    thread of its own (write_entry_later). No error if it cannot."""
    tables = {"ng": kept.ng, "hits": kept.hits}
    meta = {"store": key, "layout": LAYOUT, "files": kept.files, "incs": sorted(kept.incs), "hashes": sorted(kept.hashes)}
    if kept.answer is not None:
        tables |= {"candidates": kept.candidates, "answer": kept.answer}
        meta |= {"answer_ident": ident, "digest": list(kept.digest), "requests": list(kept.requests)}
    write_entry_later(_dir(key), tables, meta | {f"{name}_rows": t.num_rows for name, t in tables.items()})


def kept(store: str | Path, disk: bool = True) -> bool:
    """Whether rows of an earlier build of this store's evidence are at hand - in this process, or
    (``disk``) in the state directory: a build from them reads the segments added since, not every
    segment."""
    key = str(Path(store).resolve())
    if key in _KEPT:        # (not under _LOCK, which a build holds throughout: a dashboard's page asks
        return True         # while its server's warm-up builds - dashboard/serve.py - and must not wait)
    return disk and kept_on_disk() and (_dir(key) / "meta.json").is_file()


def _ids(con: duckdb.DuckDBPyConnection, text: str, col: str) -> set[int]:
    return {v for (v,) in con.sql(text).select(col).fetchall() if v is not None}


def read_runs(masks: pa.Table) -> pa.Table:
    """The maximal runs [lo, hi] of consecutive donor positions each (response, donor) pair read, from
    its read masks (``evidence/read_runs.sql``: response, donor, position_offset, slot_mask, width):
    a mask's intervals of set bits among its low ``width`` bits, shifted by the offset; a pair's
    intervals that overlap or touch merged into one run. In numpy (a single interval's ends from its
    bits' exponents, only masks of several intervals bit by bit): the step in SQL (a lambda over 64
    bits a row, then window functions) took 0.10-0.11 s of a first build at 121 M read rows (130 K
    masks), the masks' query and this 0.04 s (one-off, this session's AMD EPYC)."""
    out = {"response": pa.int64(), "donor": pa.int64(), "lo": pa.int64(), "hi": pa.int64()}
    if masks.num_rows == 0:
        return pa.table({c: pa.array([], t) for c, t in out.items()})
    width = np.clip(masks.column("width").to_numpy(), 0, 64).astype(np.uint64)     # (no slots below 0)
    keep = np.where(width >= 64, np.uint64(0xFFFFFFFFFFFFFFFF),
                    (np.uint64(1) << np.minimum(width, 63)) - np.uint64(1))
    m = masks.column("slot_mask").to_numpy().view(np.uint64) & keep
    starts = m & ~(m << np.uint64(1))           # a set bit whose bit below is clear
    ends = m & ~(m >> np.uint64(1))             # ... whose bit above is
    one = (m != 0) & ((starts & (starts - np.uint64(1))) == 0)      # a single interval (most masks)
    many = np.flatnonzero((m != 0) & ~one)
    bits = np.unpackbits(np.stack([starts[many], ends[many]]).astype("<u8").view(np.uint8).reshape(2, -1, 8),
                         axis=2, bitorder="little")
    row_many, lo_many = np.nonzero(bits[0])     # row-major: each row's starts and ends in bit order,
    _, hi_many = np.nonzero(bits[1])            # as many of each
    row = np.concatenate([np.flatnonzero(one), many[row_many]])
    # a power of two's bit: its exponent (exact in a float64)
    lo = np.concatenate([np.frexp(starts[one].astype(np.float64))[1] - 1, lo_many]).astype(np.int64)
    hi = np.concatenate([np.frexp(ends[one].astype(np.float64))[1] - 1, hi_many]).astype(np.int64)
    offset = masks.column("position_offset").to_numpy().astype(np.int64)[row]
    response = masks.column("response").to_numpy()[row]
    donor = masks.column("donor").to_numpy()[row]
    lo, hi = lo + offset, hi + offset
    order = np.lexsort((hi, lo, donor, response))
    response, donor, lo, hi = response[order], donor[order], lo[order], hi[order]
    first = np.ones(len(lo), bool)              # a pair's first interval, or one past all before it
    pair = (response[1:] != response[:-1]) | (donor[1:] != donor[:-1])
    if len(lo) > 1:
        # the running max of hi within a pair: the pairs are sorted, so with the pair's index as the
        # high half (positions are below 2^31) one running max over all rows stays within each pair
        high = np.concatenate([[0], np.cumsum(pair)]).astype(np.int64) << 32
        reach = np.maximum.accumulate(high + hi)[:-1] - high[1:]
        first[1:] = pair | (lo[1:] > reach + 1)
    heads = np.flatnonzero(first)
    return pa.table({"response": response[heads], "donor": donor[heads], "lo": lo[heads],
                     "hi": np.maximum.reduceat(hi, heads) if len(lo) else hi}, schema=pa.schema(out))


PUSHED = 4096      # values up to which the join's build side is pushed into the scan as an IN filter (see _rows)


OUTPUTS = "role = 'output'"     # the rows of _ng (filtered before the lookup: the row groups of a store's
                                # prompt rows apart - columns.APART - are skipped by their min and max)


def _rows(con, rel: duckdb.DuckDBPyRelation, col: str, values: set[int], cols: list[str]) -> pa.Table:
    """The rows of ``rel`` whose ``col`` is one of ``values``, by a semi join against them, with
    DuckDB told to push the join's values into the scan as a filter for up to PUSHED of them
    (``dynamic_or_filter_threshold``, 50 by default; this connection only, for this lookup): a
    segment's ngrams rows come in incarnation order, so the row groups of other incarnations are
    then skipped by their min and max. Measured on the bench's stores (DuckDB 2.0.1, one-off): 60 of
    the 121 M read rows' store's incarnations 0.53 -> 0.13 s, 500 0.52 -> 0.45 s, all 3575 the
    same; 979 on the 33 M store 0.65 -> 0.28 s against the literal IN list used before for up to
    1024 (which DuckDB checks row by row: slower than this join at 8-32 and 500-1024 values; only
    at 60, past DuckDB's own 50-value pushdown, was it faster than the join unpushed, 0.42 against
    0.53 s). Hashes are spread over every row group: their lookup reads them all either way."""
    con.register("_want", pa.table({"v": pa.array(sorted(values), pa.int64())}))
    pushed = min(max(len(values), 50), PUSHED)
    try:
        con.execute(f"SET dynamic_or_filter_threshold = {pushed}")
        return rel.join(con.table("_want"), f"{col} = v", how="semi").select(*cols).to_arrow_table()
    finally:
        con.execute("RESET dynamic_or_filter_threshold")
        con.unregister("_want")


def build(con: duckdb.DuckDBPyConnection, store: str | Path, files: list[str], sql, disk: bool = True,
          merges: "list[tuple[str, tuple[str, ...]]]" = (), cover: "Callable[[set[int]], None] | None" = None) -> None:
    """Create the table ``exposure_ngrams`` in ``con`` (a snapshot whose ``requests`` and
    ``exposure_slots`` are made and whose ``ngrams`` view is over ``files``); ``sql``: the named
    SQL reader (``sql("evidence/pairs")``...); ``disk``: the rows kept in the state directory may
    be read and written (the reader's own answer-cache switch; KVLEDGER_ANSWER_CACHE too);
    ``merges``: the store's (``segment_merges``), as grown.py takes them; ``cover``: where
    ``requests`` holds only some requests' rows (the pairs' responses and donors: the reader's
    narrow table), called with the incarnations of the candidate hashes' rows before the steps that
    join them to requests (their tenants and arrivals)."""
    key = str(Path(store).resolve())
    disk = disk and kept_on_disk()
    ident = _ident(sql) if disk else ""
    now = {f: _stat(f) for f in files}
    with _LOCK:
        kept = _KEPT.get(key)
        if kept is None and disk:
            kept = _load(key, ident)
        if kept is not None and merges:
            files_before = kept.files
            kept.files = carried(kept.files, now, merges)
            stats["carried"] += kept.files != files_before
        if kept is not None and any(now.get(f) != st for f, st in kept.files.items()):
            kept = None             # another store, a segment gone, left out or changed: from scratch
            stats["rebuilt"] += 1
        whole = con.table("ngrams")
        scans = stats["whole_scans"]
        new = [f for f in files if kept is None or f not in kept.files]
        delta = table_relation(con, "ngrams", new) if kept is not None and new else None
        old_incs, old_hashes = (kept.incs, kept.hashes) if kept is not None else (set(), set())
        kept_answer = kept.answer if kept is not None else None

        def grow(table: pa.Table | None, col: str, have: set[int], want: set[int], cols: list[str],
                 where: str | None = None) -> tuple[pa.Table, bool]:
            """The kept rows with those of the new segments (covered values) and of the whole table
            (values not covered yet), of the rows ``where`` holds; and whether any row or value was added."""
            parts, added = [table] if table is not None else [], False
            of = (lambda rel: rel.filter(where)) if where else (lambda rel: rel)     # noqa: E731
            if delta is not None and have:
                stats["new_segment_reads"] += 1
                parts.append(_rows(con, of(delta), col, have, cols))
                added = parts[-1].num_rows > 0
            if want - have:
                stats["whole_scans"] += 1
                parts.append(_rows(con, of(whole), col, want - have, cols))
                added = True
            if not parts:
                return _rows(con, of(whole), col, set(), cols), True
            return (pa.concat_tables(parts, promote_options="default") if len(parts) > 1 else parts[0]), added

        incs = _ids(con, sql("evidence/pairs"), "incarnation")          # the pairs' responses
        con.register("_read_runs", read_runs(con.sql(sql("evidence/read_runs")).to_arrow_table()))
        try:
            digest = tuple(con.sql(sql("evidence/digest")).fetchall()[0])
            ng, ng_added = grow(kept.ng if kept else None, "incarnation", old_incs, incs, COLUMNS, OUTPUTS)
            hashes = {h for h in pc.unique(ng.column("hash")).to_pylist() if h is not None}
            hits, hits_added = grow(kept.hits if kept else None, "hash", old_hashes, hashes, COLUMNS)
            same = (kept is not None and kept.answer is not None and kept.digest == digest
                    and not ng_added and not hits_added)
            if same:                    # the candidates read the same pairs, positions and rows
                candidates = kept.candidates
            else:
                con.register("_ng", ng)
                con.register("_hits", hits)
                try:
                    candidates = con.sql(sql("evidence/candidates")).to_arrow_table()
                finally:
                    con.unregister("_ng")
                    con.unregister("_hits")
        finally:
            con.unregister("_read_runs")
        # step 3 reads the rows of the candidate hashes only (those of other output hashes change nothing)
        chosen = hits.filter(pc.is_in(hits.column("hash"), value_set=candidates.column("hash").combine_chunks()
                                      .cast(pa.int64())))
        if cover is not None:
            cover({i for i in chosen.column("incarnation").unique().to_pylist() if i is not None})
        con.register("_candidates", candidates)
        con.register("_hits", chosen)
        try:
            requests = tuple(con.sql(sql("evidence/requests_digest")).fetchall()[0])
            if same and kept.requests == requests:
                stats["reused"] += 1
                answer = kept.answer
                con.register("_answer", answer)
                con.sql("CREATE TABLE exposure_ngrams AS SELECT * FROM _answer")
                con.unregister("_answer")
            else:
                con.sql(sql("evidence/final")).to_table("exposure_ngrams")
                answer = con.table("exposure_ngrams").to_arrow_table()
        finally:
            con.unregister("_candidates")
            con.unregister("_hits")
        _KEPT.pop(key, None)
        _KEPT[key] = fresh = _Kept(now, old_incs | incs, old_hashes | hashes, ng, hits, digest, candidates, requests,
                                   answer)
        while len(_KEPT) > KEEP:
            _KEPT.pop(next(iter(_KEPT)))
        # saved after a build that read the whole table, or that ran steps 2 and 3 (a new answer), at
        # most every SAVE_EVERY seconds
        if disk and (stats["whole_scans"] > scans or answer is not kept_answer) \
                and time.monotonic() - _SAVED.get(key, -SAVE_EVERY) >= SAVE_EVERY:
            _save(key, fresh, ident)
            _SAVED[key] = time.monotonic()
