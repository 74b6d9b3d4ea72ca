"""The store's tables on ClickHouse, generated from ``schema.sql`` (its columns as DuckDB parses them,
its ``-- clickhouse:`` lines for the sorting key, partition and sharding key); see the package's
docstring for the type mapping and the cluster layout."""
from __future__ import annotations

import re
from functools import cache

import duckdb

from engine.errors import KvledgerError
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


def quote(name: str) -> str:
    return f"`{name}`"


def _body(table: str) -> str:
    return ",\n".join(f"    {quote(c)} {t}" for c, t in columns()[table])


def ddl(database: str = "kvledger", cluster: str | None = None) -> list[str]:
    """Every statement that creates the store's tables (idempotent: IF NOT EXISTS). Single node:
    one MergeTree per table. ``cluster``: ON CLUSTER statements - sharded tables as
    ``<table>_local`` (ReplicatedMergeTree per shard) behind a ``Distributed`` ``<table>`` that routes
    each row by the sharding key; ``everywhere`` tables as one ReplicatedMergeTree per replica that
    every shard holds whole (inserted once, replicated to all)."""
    db, on = quote(database), f" ON CLUSTER {quote(cluster)}" if cluster else ""
    out = [f"CREATE DATABASE IF NOT EXISTS {db}{on}"]
    for table, lay in layouts().items():
        tail = (f"\nPARTITION BY {lay['PARTITION BY']}" if "PARTITION BY" in lay else "") + f"\nORDER BY {lay['ORDER BY']}"
        if not cluster:
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{quote(table)} (\n{_body(table)}\n) ENGINE = MergeTree{tail}"
                       f"\nSETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}")
        elif lay["SHARD BY"] == "everywhere":
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{quote(table)}{on} (\n{_body(table)}\n) ENGINE = "
                       f"ReplicatedMergeTree('/clickhouse/tables/all/{database}/{table}', '{{replica}}'){tail}")
        else:
            local = quote(table + "_local")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{local}{on} (\n{_body(table)}\n) ENGINE = "
                       f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{table}', '{{replica}}'){tail}")
            out.append(f"CREATE TABLE IF NOT EXISTS {db}.{quote(table)}{on} AS {db}.{local}\n"
                       f"ENGINE = Distributed({quote(cluster)}, {db}, {local}, {lay['SHARD BY']})")
    engine = (f"ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{SEGMENTS}', '{{replica}}')"
              if cluster else "ReplacingMergeTree")
    out.append(f"CREATE TABLE IF NOT EXISTS {db}.{SEGMENTS}{on} (\n    store_id String,\n    seq Int64,\n"
               f"    `table` String,\n    file String,\n    rows Int64,\n    sha256 String,\n"
               f"    exported_at DateTime64(9, 'UTC')\n) ENGINE = {engine}\nORDER BY (store_id, seq)")
    return out
