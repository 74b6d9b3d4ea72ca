"""The n-gram evidence (``exposure_ngrams``) of a snapshot, built from rows kept since the last
snapshot of the same store instead of two scans of the whole ``ngrams`` table.

``exposure_ngrams.sql`` is the rule. It reads ``ngrams`` twice: the rows of every pair's
incarnations (``ng``), then every row holding a candidate hash (``hits``) - at 256 M n-gram rows
about 3 s of a 4 s build, on every new snapshot of a live store (a dashboard refresh). Here the
same answer comes in three steps (``forensics/sql/evidence/``): the pairs' incarnations, the
candidates from ``_ng``, the answer from ``_candidates`` and ``_hits``. ``_ng`` and ``_hits`` are
kept in this process per store, with the segment files, incarnations and hashes they cover: on a
later snapshot whose segments include those files, only the new segments are read for the
covered incarnations and hashes, and the whole table only for incarnations or hashes not covered
yet (a new exposure). Rows of more incarnations or hashes than a snapshot needs change nothing:
every use joins on a pair or a candidate. Segments are immutable and named once in the chain; a
file is known by its path, inode, size and change time, so a store replaced at the same path, a
segment left out as damaged or rewritten starts from scratch.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from telemetry.store import table_relation

COLUMNS = ["incarnation", "role", "hash", "n", "pos"]
KEEP = 4                    # stores whose rows this process keeps (a dashboard reads one)


@dataclass
class _Kept:
    files: dict[str, tuple[int, int, int]]      # segment path -> (inode, size, ctime ns)
    incs: set[int]          # _ng holds every row of these incarnations in those files
    hashes: set[int]        # _hits holds every row with these hashes in those files
    ng: pa.Table
    hits: pa.Table


_KEPT: dict[str, _Kept] = {}
_LOCK = threading.Lock()
stats = {"whole_scans": 0, "new_segment_reads": 0}     # what the builds read (tests)


def _stat(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_ctime_ns


def _ids(con: duckdb.DuckDBPyConnection, text: str, col: str) -> set[int]:
    return {v for (v,) in con.sql(text).select(col).fetchall() if v is not None}


def _rows(con, rel: duckdb.DuckDBPyRelation, col: str, values: set[int], cols: list[str]) -> pa.Table:
    """The rows of ``rel`` whose ``col`` is one of ``values`` (joined against them, not pasted)."""
    con.register("_want", pa.table({"v": pa.array(sorted(values), pa.int64())}))
    try:
        return rel.join(con.table("_want"), f"{col} = v", how="semi").select(*cols).to_arrow_table()
    finally:
        con.unregister("_want")


def build(con: duckdb.DuckDBPyConnection, store: str | Path, files: list[str], sql) -> None:
    """Create the table ``exposure_ngrams`` in ``con`` (a snapshot whose ``requests`` and
    ``exposure_slots`` are made and whose ``ngrams`` view is over ``files``); ``sql``: the named
    SQL reader (``sql("evidence/pairs")``...)."""
    key = str(Path(store).resolve())
    now = {f: _stat(f) for f in files}
    with _LOCK:
        kept = _KEPT.get(key)
        if kept is None or any(now.get(f) != st for f, st in kept.files.items()):
            kept = None             # another store, a segment gone, left out or changed: from scratch
        whole = con.table("ngrams")
        new = [f for f in files if kept is None or f not in kept.files]
        delta = table_relation(con, "ngrams", new) if kept is not None and new else None
        old_incs, old_hashes = (kept.incs, kept.hashes) if kept is not None else (set(), set())

        def grow(table: pa.Table | None, col: str, have: set[int], want: set[int], cols: list[str]) -> pa.Table:
            parts = [table] if table is not None else []
            if delta is not None and have:
                stats["new_segment_reads"] += 1
                parts.append(_rows(con, delta, col, have, cols))
            if want - have:
                stats["whole_scans"] += 1
                parts.append(_rows(con, whole, col, want - have, cols))
            return pa.concat_tables(parts) if parts else _rows(con, whole, col, set(), cols)

        incs = _ids(con, sql("evidence/pairs"), "incarnation")
        ng = grow(kept.ng if kept else None, "incarnation", old_incs, incs, COLUMNS)
        con.register("_ng", ng)
        try:
            candidates = con.sql(sql("evidence/candidates")).to_arrow_table()
        finally:
            con.unregister("_ng")
        hashes = {h for h in candidates.column("hash").to_pylist() if h is not None}
        hits = grow(kept.hits if kept else None, "hash", old_hashes, hashes, ["incarnation", "role", "hash"])
        con.register("_candidates", candidates)
        con.register("_hits", hits)
        try:
            con.sql(sql("evidence/final")).to_table("exposure_ngrams")
        finally:
            con.unregister("_candidates")
            con.unregister("_hits")
        _KEPT.pop(key, None)
        _KEPT[key] = _Kept(now, old_incs | incs, old_hashes | hashes, ng, hits)
        while len(_KEPT) > KEEP:
            _KEPT.pop(next(iter(_KEPT)))
