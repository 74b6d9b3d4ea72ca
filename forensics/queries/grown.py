"""A snapshot's shared tables ``requests`` (with ``queues``) and ``exposure_slots`` (with the
whole store's ``exposure_pairs``), grown from the last snapshot's of the same store instead of
rebuilt from every segment.

A live store (a dashboard refreshing while the engine writes) gets a new snapshot every few
seconds, and each rebuilt these tables from every span, arrival and exposure-index row it holds
(0.2 s each at 41 M ledger rows, growing with the store), and folded every slot row again for
each query over ``exposures_in``. Segments are immutable and only ever added, so a snapshot whose
segments include the kept ones reads only the new segments:

- ``requests``: ``requests.sql`` over the new segments' spans and arrivals alone, merged with the
  kept rows: a request whose root span is new replaces its arrival row; a root span of a request
  already kept (a duplicated span) is grouped with the kept row as requests.sql groups duplicates
  (any value of each column); an unfinished request's arrivals in several segments combine as
  requests.sql combines them (the earliest arrival and its node, the largest prompt); an arrival
  after its request's end changes nothing. ``queues`` (queues.sql: each request's admission
  spans' time) adds up where a request's spans are in several segments.
- ``exposure_slots``, where it is read from the exposure index: kept as its runs (``exposure_runs``,
  exposure_runs_index.sql: a run's slots as a mask, 8 times fewer rows than slots at 121 M read rows)
  and read as a view over them (exposure_slots_of_runs.sql: one row per set bit). A run row depends
  only on the index rows of its (node, boot, reader, page, generation, block) group and on its run's
  page size. The groups the new index rows fall in - and the groups of a run whose first config
  snapshot is new - are recomputed from all of their index rows (kept + new); every other group's
  rows are kept as they were. Groups are told apart by a hash of their key; two groups sharing a
  hash are recomputed together, which changes nothing.
- ``exposure_pairs`` (exposure_pairs_of.sql over the whole store: what exposures_in reads for the
  readers' default window, exposure_pairs_in.sql): a pair's row depends only on its response's
  runs, so the responses of the recomputed groups get theirs again; the rest are kept.

The kept tables are Arrow, shown to the snapshot's connection as views (no copy). They are kept per
(store, run) for the newest ``KEEP`` stores of this process; a kept segment missing from the snapshot
(left out as damaged) or changed on disk (inode, size, change time) starts from scratch.

They are also left in the state directory (beside the kept answers, ``answers.py``: the same custody
and the same switch, ``KVLEDGER_ANSWER_CACHE``) after a build from scratch and after ``SAVE_AFTER``
new segments were read since, at most every ``SAVE_EVERY`` seconds per store and never for a store
that did not verify: the next process - the next command after the store changed, a restarted
dashboard - starts from them (memory-mapped) and reads only the segments added since. An entry
written by other SQL or another DuckDB, unreadable or partial is ignored.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from forensics.queries.answers import (enabled as kept_on_disk, entry_written, file_key as _stat, read_kept,
                                      write_entry_later)
from telemetry.store import carried, table_relation
from telemetry.store.keys import state_dir


class _Compute:
    """pyarrow.compute, imported on first use: 40-65 ms of a command's start (its kernels' Python
    wrappers and docstrings are generated at import), which a first command with nothing kept never
    needs - only growing a kept table does."""

    def __getattr__(self, name: str):
        import pyarrow.compute
        return getattr(pyarrow.compute, name)


pc = _Compute()

KEEP = 4                    # stores whose tables this process keeps (a dashboard reads one)
SAVE_EVERY = 30.0           # seconds between two saves of one kept table to the state directory
SAVE_AFTER = 16             # new segments read since the entry on disk before it is written again
COMPACT = 64                # chunks a kept table may have before they are joined into one
GROUP = "hash(node, boot, {reader}, page, generation, block_index)"   # an exposure_slots group's key
READS = {"requests": ("spans", "arrivals"), "exposure_slots": ("exposure_index", "config_snapshots")}

stats = {"built": 0, "grown": 0, "unchanged": 0, "groups_redone": 0, "loaded": 0, "saved": 0,   # (tests, bench)
         "carried": 0}          # kept over segments the writer merged since (their merge stands for them)


@dataclass
class _Kept:
    files: dict[str, tuple[int, int, int]]      # segment path -> (inode, size, ctime ns) of the tables read
    parts: dict[str, pa.Table]      # requests: done, open, queues; exposure_slots: raw, sizes, runs, pairs
    scratch: duckdb.DuckDBPyConnection          # where the new segments are read (a connection costs ~40 ms)
    on_disk: int = -1                           # segments the entry in the state directory covers (-1: none)
    saved_at: float = float("-inf")             # when this process last wrote it (monotonic)


_KEPT: dict[tuple, _Kept] = {}
_LOCK = threading.Lock()                    # guards _KEPT and _LOCKS
_LOCKS: dict[tuple, threading.Lock] = {}    # one per kept table: requests and exposure_slots grow side by side


def enabled() -> bool:
    """KVLEDGER_GROW=0 rebuilds the tables on every snapshot (the A/B switch of the benches)."""
    return os.environ.get("KVLEDGER_GROW", "1") != "0"


def _views(s: duckdb.DuckDBPyConnection, tables: dict[str, "list[str] | pa.Table"], boot: str | None = None) -> None:
    """Point the scratch connection's views at these segments (one run's rows, when the snapshot
    is narrowed to one) or Arrow tables."""
    for table, src in tables.items():
        if isinstance(src, pa.Table):
            rel = s.from_arrow(src)
        else:
            rel = table_relation(s, table, src)
            if boot is not None:
                rel = rel.filter(duckdb.ColumnExpression("boot") == duckdb.ConstantExpression(boot))
        rel.create_view(table, replace=True)


def _concat(*tables: pa.Table) -> pa.Table:
    out = pa.concat_tables([t for t in tables if t.num_rows] or tables[:1])
    return out.combine_chunks() if out.column(0).num_chunks > COMPACT else out


def _in(col: pa.ChunkedArray, values: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """Which of ``col`` are among ``values`` - a few: the set is hashed (a kept table's whole
    column as the set would cost ~30 ms a call at 140 K rows)."""
    return pc.is_in(col, value_set=values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values)


def _rows(con: duckdb.DuckDBPyConnection, text: str, schema: pa.Schema, **tables: pa.Table) -> pa.Table:
    """``text`` over these Arrow tables (by name), in ``schema``."""
    for name, t in tables.items():
        con.register(name, t)
    try:
        return con.sql(text).to_arrow_table().cast(schema)
    finally:
        for name in tables:
            con.unregister(name)


def _dir(key: tuple) -> Path:
    return state_dir() / "grown" / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


def _ident(text: str, more_sql: str) -> str:
    """What an entry's rows depend on besides the segments: the SQL and the DuckDB that ran it."""
    from telemetry.store.schema import SCHEMA_SQL
    return hashlib.sha256(json.dumps([text, more_sql, duckdb.__version__,
                                      SCHEMA_SQL.read_text()]).encode()).hexdigest()


def _load(key: tuple, ident: str) -> _Kept | None:
    """The tables a process left for this store and run, or None (none, other SQL, unreadable, partial)."""
    d = _dir(key)
    entry_written(d)
    try:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("key") != list(key) or meta.get("ident") != ident:
            return None
        parts = {}
        for name, rows in meta["rows"].items():
            parts[name] = read_kept(d / f"{name}-{meta['gen']}.arrow")
            if parts[name].num_rows != rows:
                return None
        files = {f: tuple(st) for f, st in meta["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException):
        return None
    stats["loaded"] += 1
    return _Kept(files, parts, duckdb.connect(), on_disk=len(files))


def _save(key: tuple, ident: str, kept: _Kept) -> None:
    """Write the tables and the meta that names them (answers.write_entry), on a thread of its own
    (write_entry_later: counted as saved when it starts). No error if it cannot."""
    write_entry_later(_dir(key), dict(kept.parts), {"key": list(key), "ident": ident, "files": dict(kept.files),
                                                    "rows": {name: t.num_rows for name, t in kept.parts.items()}})
    stats["saved"] += 1
    kept.on_disk, kept.saved_at = len(kept.files), time.monotonic()


def _any(column: str) -> str:
    return f'any_value("{column}")'


def _merge_requests(s: duckdb.DuckDBPyConnection, kept: dict[str, pa.Table], delta: pa.Table) -> dict[str, pa.Table]:
    done, open_ = kept["done"], kept["open"]
    schema = done.schema
    names = schema.names
    new_done, new_open = (t.cast(schema) for t in _finished(delta))
    if new_done.num_rows:
        again = _in(done["incarnation"], new_done["incarnation"])
        if pc.any(again).as_py():           # a root span of a request already kept: grouped as requests.sql does
            dup = _in(new_done["incarnation"], done["incarnation"].filter(again))
            cols = ", ".join(f'{_any(c)} AS "{c}"' for c in names[1:])
            grouped = _rows(s, f"SELECT incarnation, {cols} FROM (SELECT * FROM _old UNION ALL SELECT * FROM _new) "
                               "GROUP BY incarnation", schema,
                            _old=done.filter(again), _new=new_done.filter(dup))
            done = _concat(done.filter(pc.invert(again)), grouped, new_done.filter(pc.invert(dup)))
        else:
            done = _concat(done, new_done)
    if new_open.num_rows or new_done.num_rows:
        # the requests that have ended: those of the new root spans, and kept ones a new arrival names
        ended = pa.concat_arrays([new_done["incarnation"].combine_chunks(),
                                  kept["done"]["incarnation"].filter(_in(kept["done"]["incarnation"],
                                                                         new_open["incarnation"])).combine_chunks()])
        agg = {"incarnation": "incarnation", "node": "arg_min(node, arrived_at)", "arrived_at": "min(arrived_at)",
               "prompt_tokens_billed": "max(prompt_tokens_billed)"}
        cols = ", ".join(f'{agg.get(c) or _any(c)} AS "{c}"' for c in names)
        open_ = _rows(s, f"SELECT {cols} FROM (SELECT * FROM _old UNION ALL SELECT * FROM _new) "
                         "ANTI JOIN _ended USING (incarnation) GROUP BY incarnation", schema,
                      _old=open_, _new=new_open, _ended=pa.table({"incarnation": ended}))
    return {"done": done, "open": open_}


def _merge_queues(s: duckdb.DuckDBPyConnection, queues: pa.Table, delta: pa.Table) -> pa.Table:
    if not delta.num_rows:
        return queues
    again = _in(queues["incarnation"], delta["incarnation"])
    if not pc.any(again).as_py():
        return _concat(queues, delta.cast(queues.schema))
    summed = _rows(s, "SELECT incarnation, sum(queue_ns)::BIGINT AS queue_ns FROM "
                      "(SELECT * FROM _old UNION ALL SELECT * FROM _new) GROUP BY incarnation", queues.schema,
                   _old=queues.filter(again), _new=delta)
    return _concat(queues.filter(pc.invert(again)), summed)


def _finished(requests: pa.Table) -> tuple[pa.Table, pa.Table]:
    """The finished requests' rows and the others (``finished`` is never NULL: requests.sql), as
    slices of ``requests`` where they already lie apart - none open (a store no writer holds), or the
    open ones all after the finished (requests.sql's UNION ALL may give them so) - else copied out by a mask. At
    520 K requests (95 MB of rows; one-off, this session's AMD EPYC) a copy by a mask took 0.3 s the
    first time in a process (fresh memory from pyarrow's pool, mimalloc; 0.03-0.06 s after) and the
    filter by an expression used before (``pc.field``: Acero) 0.43 s: the grown requests' first
    build 0.77 -> 0.35 s, a first dashboard page's early banner about 0.1 s sooner."""
    finished = requests["finished"]
    n = requests.num_rows
    k = n - (pc.sum(finished).as_py() or 0)         # the open ones
    if not pc.any(finished.slice(n - k)).as_py():   # (none: k = 0)
        return requests.slice(0, n - k), requests.slice(n - k)
    return requests.filter(finished), requests.filter(pc.invert(finished))


def _build_requests(con, text: str, queues_sql: str) -> dict[str, pa.Table]:
    done, open_ = _finished(con.sql(text).to_arrow_table())
    return {"done": done, "open": open_, "queues": con.sql(queues_sql).to_arrow_table()}


WHOLE = "TIMESTAMP '1970-01-01', TIMESTAMP '2262-01-01'"      # the readers' default window: the whole store


def _pairs(s: duckdb.DuckDBPyConnection, runs: pa.Table, pairs_sql: str) -> pa.Table:
    """exposure_pairs_of.sql's pairs over these runs, the whole store's window."""
    _views(s, {"exposure_runs": runs.drop_columns(["_g"])})
    s.execute(pairs_sql)
    return s.sql(f"SELECT * FROM exposure_pairs_of({WHOLE}, false)").to_arrow_table()


def _build_slots(con, s, text: str, pairs_sql: str) -> dict[str, pa.Table]:
    """The index's rows and the page sizes read once, the runs over them (as _grow_slots redoes a
    group): the index's segments are not scanned a second time for the runs (0.05-0.08 s at 121 M read rows)."""
    raw = con.sql(f"SELECT *, {GROUP.format(reader='reader')} AS _g FROM exposure_index").to_arrow_table()
    sizes = con.sql("SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots "
                    "GROUP BY node, boot").to_arrow_table()
    _views(s, {"exposure_index": raw.drop_columns(["_g"]), "config_snapshots": sizes})
    runs = s.sql(f"SELECT *, {GROUP.format(reader='response')} AS _g FROM ({text})").to_arrow_table()
    return {"raw": raw, "sizes": sizes, "runs": runs, "pairs": _pairs(s, runs, pairs_sql)}


def _grow_slots(s: duckdb.DuckDBPyConnection, kept: dict[str, pa.Table], text: str, pairs_sql: str) -> dict[str, pa.Table]:
    raw, sizes, runs, pairs = kept["raw"], kept["sizes"], kept["runs"], kept["pairs"]
    new_raw = s.sql(f"SELECT *, {GROUP.format(reader='reader')} AS _g FROM exposure_index").to_arrow_table()
    s.register("_sizes", sizes)
    new_sizes = s.sql("SELECT node, boot, any_value(page_size) AS page_size FROM config_snapshots "
                      "ANTI JOIN _sizes USING (node, boot) GROUP BY node, boot").to_arrow_table().cast(sizes.schema)
    s.unregister("_sizes")
    raw = _concat(raw, new_raw.cast(raw.schema))
    sizes = _concat(sizes, new_sizes)
    # the groups to recompute: those of the new index rows, and those of a run whose page size is new
    touched = pc.unique(new_raw["_g"])
    if new_sizes.num_rows:
        s.register("_raw", kept["raw"])
        s.register("_new_sizes", new_sizes)
        late = s.sql("SELECT DISTINCT _g FROM _raw SEMI JOIN _new_sizes USING (node, boot)").to_arrow_table()["_g"]
        s.unregister("_raw")
        s.unregister("_new_sizes")
        touched = pc.unique(pa.chunked_array([touched, *late.chunks], touched.type))
    if len(touched):
        stats["groups_redone"] += len(touched)
        rows = raw.filter(_in(raw["_g"], touched))
        _views(s, {"exposure_index": rows.drop_columns(["_g"]), "config_snapshots": sizes})
        redo = s.sql(f"SELECT *, {GROUP.format(reader='response')} AS _g FROM ({text})").to_arrow_table().cast(runs.schema)
        runs = _concat(runs.filter(pc.invert(_in(runs["_g"], touched))), redo)
        # a pair's row depends on all of its response's runs: the touched responses' pairs again
        responses = pc.unique(rows["reader"])
        again = _pairs(s, runs.filter(_in(runs["response"], responses)), pairs_sql).cast(pairs.schema)
        pairs = _concat(pairs.filter(pc.invert(_in(pairs["response"], responses))), again)
    return {"raw": raw, "sizes": sizes, "runs": runs, "pairs": pairs}


def build(con: duckdb.DuckDBPyConnection, name: str, store: str | Path, run: str | None, boot: str | None,
          files: dict[str, list[str]], text: str, more_sql: str = "", disk: bool = True,
          merges: "list[tuple[str, tuple[str, ...]]]" = (), view_sql: str = "") -> dict[str, pa.Table]:
    """Create the view ``name`` (requests, then queues too: ``more_sql`` is queues.sql; or
    exposure_runs from the index, exposure_slots over them - ``view_sql`` - then exposure_pairs:
    exposure_pairs_of.sql) in ``con``, a snapshot whose views are over ``files`` (``segment_files``'
    lists) and narrowed to ``boot`` when ``run`` named one; ``text``: the kept table's SQL. Returns
    the Arrow tables under the views (the caller keeps them alive as long as ``con``). ``disk``: the
    state directory's entry may be read and written (a verified store, the reader's answer-cache
    switch; KVLEDGER_ANSWER_CACHE too). ``merges``: the store's (``segment_merges``): a kept table
    over segments the writer merged since is kept over the merge."""
    key = (str(Path(store).resolve()), run, name)
    disk = disk and kept_on_disk()
    ident = _ident(text, more_sql + view_sql) if disk else ""
    reads = READS[name]
    now = {f: _stat(f) for t in reads for f in files[t]}
    with _LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _LOCK:
            kept = _KEPT.pop(key, None)
        if kept is None and disk:
            kept = _load(key, ident)
        if kept is not None and merges:
            files_before = kept.files
            kept.files = carried(kept.files, now, merges)
            stats["carried"] += kept.files != files_before
        if kept is not None and any(now.get(f) != st for f, st in kept.files.items()):
            kept.scratch.close()
            kept = None             # a segment gone, left out or changed: from scratch
        if kept is None:
            stats["built"] += 1
            scratch = duckdb.connect()
            parts = (_build_requests(con, text, more_sql) if name == "requests"
                     else _build_slots(con, scratch, text, more_sql))
            kept = _Kept(now, parts, scratch)
        elif len(now) == len(kept.files):
            stats["unchanged"] += 1
        else:
            stats["grown"] += 1
            s = kept.scratch
            _views(s, {t: [f for f in files[t] if f not in kept.files] for t in reads}, boot)
            if name == "requests":
                kept.parts = {**_merge_requests(s, kept.parts, s.sql(text).to_arrow_table()),
                              "queues": _merge_queues(s, kept.parts["queues"], s.sql(more_sql).to_arrow_table())}
            else:
                kept.parts = _grow_slots(s, kept.parts, text, more_sql)
            kept.files = now
        parts = kept.parts
        if disk and (kept.on_disk < 0 or len(kept.files) - kept.on_disk >= SAVE_AFTER) \
                and time.monotonic() - kept.saved_at >= SAVE_EVERY:
            _save(key, ident, kept)
        with _LOCK:
            _KEPT[key] = kept
            while len(_KEPT) > KEEP * len(READS):
                _LOCKS.pop(gone := next(iter(_KEPT)), None)
                _KEPT.pop(gone).scratch.close()
    if name == "requests":
        views = {"requests": _concat(parts["done"], parts["open"]), "queues": parts["queues"]}
    else:
        views = {"exposure_runs": parts["runs"].drop_columns(["_g"]), "exposure_pairs": parts["pairs"]}
    for view, table in views.items():
        con.from_arrow(table).create_view(view)
    if name == "exposure_slots":
        con.execute(f"CREATE OR REPLACE VIEW exposure_slots AS {view_sql}")
    return views
