"""The store on ClickHouse: DDL generated from ``schema.sql`` and an idempotent, resumable export.

    ddl("kvledger")                       CREATE DATABASE / TABLE statements, one MergeTree per table
    ddl("kvledger", cluster="prod")       the cluster variant: ReplicatedMergeTree ``<table>_local`` on
                                          every shard, a ``Distributed`` table in front of it
    target = connect("clickhouse://host:8123/kvledger")    a server, through clickhouse-connect
    target = connect("chdb:/var/lib/kvledger-chdb?db=kvledger")  embedded ClickHouse (chdb): nothing to start
    export(store, target)                 verify the chain, then copy every segment not yet copied

One source of truth: the columns and their types come from ``schema.sql`` as DuckDB parses it; the
``-- clickhouse:`` line above each table gives the sorting key (chosen for the as-of join: node,
boot, page, then the logical clock), the partition (by day where the table has a time) and the
cluster's sharding key. A page's reads and writes hash to one shard (``cityHash64(node, boot,
page)``), so the exposure join never crosses shards; small tables (``everywhere``) are held whole
by every shard (a ReplicatedMergeTree whose ZooKeeper path has no shard in it).

Type mapping: VARCHAR String, BIGINT Int64, INTEGER Int32, SMALLINT Int16, DOUBLE Float64, BOOLEAN
Bool, TIMESTAMP_NS DateTime64(9, 'UTC'), MAP(VARCHAR, V) Map(LowCardinality(String), V) (as the
OpenTelemetry Collector's ``otel_traces``), T[] Array(T). A column without NOT NULL is Nullable(T),
except arrays, which ClickHouse cannot make Nullable: a NULL list is exported as [] (no query tells
the two apart). String arrays hold Nullable(String) elements (``found_scopes_h`` has NULLs).

Export is idempotent per segment: each segment's rows go in as one insert whose deduplication token
is the segment's sha256 (MergeTree drops a repeated token: ``non_replicated_deduplication_window``),
then a row naming it (store id, seq, table, sha256, rows) goes into ``kvledger_segments``. A re-run
skips what that table names; a crash between the two re-inserts the segment under the same token,
which ClickHouse drops. A segment seq recorded with another sha256 is refused: the store in hand is
not the one exported.
"""
from __future__ import annotations

import datetime as dt
import os
import re
import threading
import time
from functools import cache
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, unquote, urlparse

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.errors import KvledgerError
from telemetry.store.chain import read_chain, verify
from telemetry.store.schema import SCHEMA_SQL, arrow_schemas

SEGMENTS = "kvledger_segments"
DEDUP_WINDOW = 100_000         # segments whose tokens MergeTree remembers (a store has one per table per flush)
SCALAR = {"VARCHAR": "String", "BIGINT": "Int64", "INTEGER": "Int32", "SMALLINT": "Int16", "DOUBLE": "Float64",
          "BOOLEAN": "Bool", "TIMESTAMP_NS": "DateTime64(9, 'UTC')"}


class ClickHouseError(KvledgerError):
    pass


@cache
def layouts() -> dict[str, dict[str, str]]:
    """table -> its ``-- clickhouse:`` line: ORDER BY, PARTITION BY (optional), SHARD BY."""
    text = SCHEMA_SQL.read_text()
    out = {}
    for m in re.finditer(r"^-- clickhouse: (.*)\nCREATE TABLE (\w+) \(", text, re.M):
        spec, table = m.group(1), m.group(2)
        parts = re.split(r"\s*\b(ORDER BY|PARTITION BY|SHARD BY)\s+", " " + spec)
        out[table] = dict(zip(parts[1::2], (p.strip() for p in parts[2::2])))
    missing = set(arrow_schemas()) - set(out)
    if missing:
        raise ValueError(f"schema.sql: no `-- clickhouse:` line above {sorted(missing)}")
    return out


def ch_type(duck: str, nullable: bool) -> str:
    """The ClickHouse type of a DuckDB column type (see the module docstring)."""
    if duck.endswith("[]"):
        inner = duck[:-2]
        return f"Array({ch_type(inner, inner == 'VARCHAR')})"
    m = re.fullmatch(r"MAP\((\w+), (\w+)\)", duck)
    if m:
        key = "LowCardinality(String)" if m.group(1) == "VARCHAR" else SCALAR[m.group(1)]
        return f"Map({key}, {SCALAR[m.group(2)]})"
    base = SCALAR[duck]
    return f"Nullable({base})" if nullable else base


@cache
def columns() -> dict[str, list[tuple[str, str]]]:
    """table -> [(column, ClickHouse type)] in schema order, from schema.sql as DuckDB reads it."""
    con = duckdb.connect()
    con.execute(SCHEMA_SQL.read_text())
    rows = con.execute("SELECT table_name, column_name, data_type, is_nullable = 'YES' FROM information_schema.columns "
                       "ORDER BY table_name, ordinal_position").fetchall()
    con.close()
    out: dict[str, list[tuple[str, str]]] = {}
    for table, col, typ, nullable in rows:
        out.setdefault(table, []).append((col, ch_type(typ, nullable)))
    return out


def _q(name: str) -> str:
    return f"`{name}`"


def _body(table: str) -> str:
    return ",\n".join(f"    {_q(c)} {t}" for c, t in columns()[table])


def ddl(database: str = "kvledger", cluster: str | None = None) -> list[str]:
    """Every statement that creates the store's tables (idempotent: IF NOT EXISTS). Single node:
    one MergeTree per table. ``cluster``: ON CLUSTER statements - sharded tables as
    ``<table>_local`` (ReplicatedMergeTree per shard) behind a ``Distributed`` ``<table>`` that routes
    each row by the sharding key; ``everywhere`` tables as one ReplicatedMergeTree per replica that
    every shard holds whole (inserted once, replicated to all)."""
    db, on = _q(database), f" ON CLUSTER {_q(cluster)}" if cluster else ""
    out = [f"CREATE DATABASE IF NOT EXISTS {db}{on}"]
    for table, lay in layouts().items():
        tail = (f"\nPARTITION BY {lay['PARTITION BY']}" if "PARTITION BY" in lay else "") + f"\nORDER BY {lay['ORDER BY']}"
        if not cluster:
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{_q(table)} (\n{_body(table)}\n) ENGINE = MergeTree{tail}"
                       f"\nSETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}")
        elif lay["SHARD BY"] == "everywhere":
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{_q(table)}{on} (\n{_body(table)}\n) ENGINE = "
                       f"ReplicatedMergeTree('/clickhouse/tables/all/{database}/{table}', '{{replica}}'){tail}")
        else:
            local = _q(table + "_local")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{local}{on} (\n{_body(table)}\n) ENGINE = "
                       f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{table}', '{{replica}}'){tail}")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{_q(table)}{on} AS {db}.{local}\n"
                       f"ENGINE = Distributed({_q(cluster)}, {db}, {local}, {lay['SHARD BY']})")
    engine = (f"ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{SEGMENTS}', '{{replica}}')"
              if cluster else "ReplacingMergeTree")
    out.append(f"CREATE TABLE IF NOT EXISTS {db}.{SEGMENTS}{on} (\n    store_id String,\n    seq Int64,\n"
               f"    `table` String,\n    file String,\n    rows Int64,\n    sha256 String,\n"
               f"    exported_at DateTime64(9, 'UTC')\n) ENGINE = {engine}\nORDER BY (store_id, seq)")
    return out


# ---- targets -----------------------------------------------------------------------------------
class Target:
    """Where the store goes: four operations, the same on a server and on embedded ClickHouse."""
    database: str
    url: str

    def command(self, sql: str) -> None: ...
    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None: ...
    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table: ...
    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None: ...
    def close(self) -> None: ...


_chdb_lock = threading.Lock()
_chdb_session = None          # chdb runs one embedded server per process, at one path


def chdb_session(path: str | Path):
    """The process's embedded ClickHouse at ``path`` (created on first use)."""
    global _chdb_session
    path = str(Path(path).expanduser().resolve())
    with _chdb_lock:
        if _chdb_session is None:
            try:
                from chdb import session
            except ImportError as e:
                raise ClickHouseError(f"chdb is not installed ({e}); pip install chdb") from None
            Path(path).mkdir(parents=True, exist_ok=True)
            _chdb_session = (path, session.Session(path))
            threads = os.environ.get("KVLEDGER_CHDB_THREADS")      # e.g. 1 beside other work on a small machine
            if threads:
                _chdb_session[1].query(f"SET max_threads = {int(threads)}")
        elif _chdb_session[0] != path:
            raise ClickHouseError(f"embedded ClickHouse (chdb) is already open at {_chdb_session[0]} in this process; "
                                  f"it runs one data directory per process, so {path} cannot be opened beside it")
        return _chdb_session[1]


def _literal(v) -> str:
    """A query parameter's value as ClickHouse reads it (TSV-escaped text)."""
    if isinstance(v, dt.datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


class ChdbTarget(Target):
    def __init__(self, path: str | Path, database: str = "kvledger"):
        self.path, self.database = Path(path), database
        self.url = f"chdb:{self.path}/{database}"
        self.session = chdb_session(path)
        self.lock = threading.Lock()        # one statement at a time on the embedded server

    def _q(self, sql: str, fmt: str = "CSV", params: dict | None = None, settings: dict | None = None):
        if settings:
            sql = f"{sql}\nSETTINGS " + ", ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {int(v)}"
                                                  for k, v in settings.items())
        with self.lock:
            try:
                return self.session.query(sql, fmt, params={k: _literal(v) for k, v in (params or {}).items()})
            except Exception as e:          # chdb raises a bare RuntimeError with ClickHouse's message
                raise ClickHouseError(f"chdb: {str(e).strip()[:2000]}") from None

    def command(self, sql: str) -> None:
        self._q(sql)

    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None:
        self._q(sql, "CSV", params, settings)

    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table:
        return self._q(sql, "ArrowTable", params, settings)

    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None:
        rows = data      # noqa: F841 - chdb's Python() table function reads the local variable by name
        cols = ", ".join(_q(c) for c in data.column_names)
        self._q(f"INSERT INTO {_q(self.database)}.{_q(table)} ({cols}) SETTINGS insert_deduplication_token = "
                f"'{token}' SELECT {cols} FROM Python(rows)")

    def close(self) -> None:
        pass         # the embedded server lives as long as the process


class ServerTarget(Target):
    """A ClickHouse server over HTTP (clickhouse-connect, Arrow inserts)."""

    def __init__(self, host: str, port: int, database: str, username: str, password: str, secure: bool):
        import logging

        import clickhouse_connect
        logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)   # its errors reach the user as ours
        self.database = database
        self.url = f"clickhouse{'s' if secure else ''}://{host}:{port}/{database}"
        try:
            self.client = clickhouse_connect.get_client(host=host, port=port, username=username, password=password,
                                                        secure=secure, database="default")
        except Exception as e:
            raise ClickHouseError(f"cannot reach ClickHouse at {self.url}: {e}") from None

    def command(self, sql: str) -> None:
        self.command_params(sql, None, None)

    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None:
        try:
            self.client.command(sql, parameters={k: _literal(v) for k, v in (params or {}).items()} or None,
                                settings=settings)
        except Exception as e:
            raise ClickHouseError(f"{self.url}: {e}") from None

    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table:
        try:     # parameters as ClickHouse text (DateTime64(9) keeps its fraction); String columns as strings
            return self.client.query_arrow(sql, parameters={k: _literal(v) for k, v in (params or {}).items()},
                                           settings=settings, use_strings=True)
        except Exception as e:
            raise ClickHouseError(f"{self.url}: {e}") from None

    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None:
        self.client.insert_arrow(f"{self.database}.{table}", data, settings={"insert_deduplication_token": token})

    def close(self) -> None:
        self.client.close()


NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def connect(url: str) -> Target:
    """``clickhouse://[user[:password]@]host[:port]/database`` (HTTP, port 8123; ``clickhouses://``:
    HTTPS, 8443) or ``chdb:PATH[?db=NAME]`` - embedded ClickHouse keeping its data in PATH, database
    NAME (default ``kvledger``)."""
    u = urlparse(url)
    if u.scheme == "chdb":
        path = u.netloc + u.path if u.netloc else u.path
        db = parse_qs(u.query).get("db", ["kvledger"])[0]
        if not path:
            raise ClickHouseError(f"{url!r}: chdb needs a data directory, e.g. chdb:/var/lib/kvledger-chdb")
        if not NAME.match(db):
            raise ClickHouseError(f"{url!r}: database name {db!r} must be letters, digits and _ (at most 64)")
        return ChdbTarget(path, db)
    if u.scheme in ("clickhouse", "clickhouses"):
        db = u.path.strip("/") or "kvledger"
        if not u.hostname:
            raise ClickHouseError(f"{url!r}: no host (expected clickhouse://HOST:8123/DATABASE)")
        if not NAME.match(db):
            raise ClickHouseError(f"{url!r}: database name {db!r} must be letters, digits and _ (at most 64)")
        secure = u.scheme == "clickhouses"
        try:
            port = u.port or (8443 if secure else 8123)
        except ValueError:
            raise ClickHouseError(f"{url!r}: the port must be a number from 1 to 65535") from None
        return ServerTarget(u.hostname, port, db, unquote(u.username or "default"), unquote(u.password or ""), secure)
    raise ClickHouseError(f"{url!r}: expected clickhouse://HOST:8123/DATABASE, clickhouses://... or chdb:PATH")


# ---- export ------------------------------------------------------------------------------------
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
    t = target.query_arrow(f"SELECT seq, sha256 FROM {_q(target.database)}.{SEGMENTS} FINAL "
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
    links = [ln for ln in read_chain(store) if ln.seq <= v.seq and ln.table in arrow_schemas()]
    todo = []
    for ln in links:
        if ln.seq in done:
            if done[ln.seq] != ln.sha256:
                raise ClickHouseError(f"{target.url} holds segment {ln.seq} of store {v.store_id} with sha256 "
                                      f"{done[ln.seq][:16]}..., this store's is {ln.sha256[:16]}...: not the store "
                                      "that was exported; refusing to mix them")
            continue
        todo.append(ln)
    rows = 0
    for i, ln in enumerate(todo):
        data = segment_table(ln.table, pq.read_table(store / ln.file))
        target.insert_arrow(ln.table, data, token=f"{v.store_id}:{ln.seq}:{ln.sha256}")
        if after_insert:
            after_insert(ln.seq)
        rec = pa.table({"store_id": [v.store_id], "seq": pa.array([ln.seq], pa.int64()), "table": [ln.table],
                        "file": [ln.file], "rows": pa.array([ln.rows], pa.int64()), "sha256": [ln.sha256],
                        "exported_at": pa.array([time.time_ns()], pa.timestamp("ns", "UTC"))})
        target.insert_arrow(SEGMENTS, rec, token=f"record:{v.store_id}:{ln.seq}:{ln.sha256}")
        rows += ln.rows
        if progress:
            progress(i + 1, len(todo), rows)
    return ExportResult(store_id=v.store_id, segments=len(todo), rows=rows, skipped=len(links) - len(todo),
                        head=v.head, seq=v.seq)


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
