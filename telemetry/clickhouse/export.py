"""The idempotent, resumable export of a verified store: one insert per segment, deduplicated by its
sha256, then its record in ``kvledger_segments`` (see the package's docstring)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from telemetry.clickhouse.ddl import SEGMENTS, ClickHouseError, ddl, quote
from telemetry.clickhouse.targets import Target
from telemetry.store.chain import originals, read_chain, replaced, verify
from telemetry.store.schema import arrow_schemas

def segment_table(table: str, data: pa.Table) -> pa.Table:
    """A segment's rows in today's schema: columns added since it was written are NULL, ``boot`` is
    '' in rows written before runs had ids (as ``open_store`` reads them)."""
    schema = arrow_schemas()[table]
    cols = []
    for f in schema:
        if f.name in data.column_names:
            col = data.column(f.name).cast(f.type)
        else:
            col = pa.nulls(data.num_rows, f.type)
        if f.name == "boot":
            col = pc.fill_null(col, "")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def ensure_schema(target: Target) -> None:
    for stmt in ddl(target.database):
        target.command(stmt)


def exported(target: Target, store_id: str) -> dict[int, str]:
    t = target.query_arrow(f"SELECT seq, sha256 FROM {quote(target.database)}.{SEGMENTS} FINAL "
                           "WHERE store_id = {sid:String}", params={"sid": store_id})
    return dict(zip(t.column("seq").to_pylist(), t.column("sha256").to_pylist()))


class ExportResult(dict):
    pass


def export(store: str | Path, target: Target, *, anchor=None, cache: dict | None = None, allow_unverified: bool = False,
           progress: Callable[[int, int, int], None] | None = None,
           after_insert: Callable[[int], None] | None = None) -> ExportResult:
    """Copy every chained segment of a verified store not yet in ``target``; returns counts.
    ``progress(done, total, rows)`` after each segment; ``after_insert(seq)`` between a segment's rows
    and its record (tests use it to crash there). ``allow_unverified``: copy the verified prefix of
    a store that does not verify (a reader that says so) instead of refusing."""
    store = Path(store)
    v = verify(store, anchor, cache=cache)
    if not v.ok and not allow_unverified:
        raise ClickHouseError(f"store {store} does not verify ({v.broken}); refusing to export it "
                              "(`kvledger verify` names the damage)")
    ensure_schema(target)
    done = exported(target, v.store_id)
    chain = [ln for ln in read_chain(store) if ln.seq <= v.seq]
    gone, flat = replaced(chain), originals(chain)
    links = [ln for ln in chain if ln.table in arrow_schemas() and ln.seq not in gone]
    todo = []
    for ln in links:
        # a compaction's file holds its flushes' rows one after another: those exported already
        # (by their own seq, before the merge) are skipped, the rest go in under their own seqs
        parts = flat.get(ln.seq, [ln])
        for o in parts:
            if o.seq in done and done[o.seq] != o.sha256:
                raise ClickHouseError(f"{target.url} holds segment {o.seq} of store {v.store_id} with sha256 "
                                      f"{done[o.seq][:16]}..., this store's is {o.sha256[:16]}...: not the store "
                                      "that was exported; refusing to mix them")
        if any(o.seq not in done for o in parts):
            todo.append((ln, parts))
    rows = 0
    for i, (ln, parts) in enumerate(todo):
        data = segment_table(ln.table, pq.read_table(store / ln.file))
        offset = 0
        for o in parts:
            if o.seq not in done:
                rows += _insert_segment(target, v.store_id, o, data.slice(offset, o.rows), after_insert)
            offset += o.rows
        if progress:
            progress(i + 1, len(todo), rows)
    return ExportResult(store_id=v.store_id, segments=len(todo), rows=rows, skipped=len(links) - len(todo),
                        head=v.head, seq=v.seq)


def _insert_segment(target: Target, store_id: str, ln, data: pa.Table,
                    after_insert: Callable[[int], None] | None) -> int:
    """One flush's rows and then its record (the record last: a crash between them re-sends the
    rows under the same deduplication token)."""
    target.insert_arrow(ln.table, data, token=f"{store_id}:{ln.seq}:{ln.sha256}")
    if after_insert:
        after_insert(ln.seq)
    rec = pa.table({"store_id": [store_id], "seq": pa.array([ln.seq], pa.int64()), "table": [ln.table],
                    "file": [ln.file], "rows": pa.array([ln.rows], pa.int64()), "sha256": [ln.sha256],
                    "exported_at": pa.array([time.time_ns()], pa.timestamp("ns", "UTC"))})
    target.insert_arrow(SEGMENTS, rec, token=f"record:{store_id}:{ln.seq}:{ln.sha256}")
    return ln.rows


def follow(store: str | Path, target: Target, interval: float, stop: threading.Event, *, anchor=None,
           on_batch: Callable[[ExportResult], None] | None = None) -> None:
    """Export a live store every ``interval`` seconds until ``stop`` is set (incremental
    verification: each pass hashes only the segments added since the last)."""
    cache: dict = {}
    while True:
        res = export(store, target, anchor=anchor, cache=cache)
        if on_batch:
            on_batch(res)
        if stop.wait(interval):
            return
