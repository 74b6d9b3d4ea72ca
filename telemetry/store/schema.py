"""The store schema, read from ``schema.sql`` (the one source of truth) into Arrow schemas."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import duckdb
import pyarrow as pa

SCHEMA_SQL = Path(__file__).with_name("schema.sql")


@cache
def arrow_schemas() -> dict[str, pa.Schema]:
    """table name -> Arrow schema, as DuckDB itself maps the DDL."""
    con = duckdb.connect()
    con.execute(SCHEMA_SQL.read_text())
    names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
    out = {}
    for name in names:
        out[name] = con.table(name).limit(0).to_arrow_table().schema
    con.close()
    return out


@cache
def not_null() -> dict[str, frozenset[str]]:
    """table -> its NOT NULL columns (DuckDB's Arrow export marks every field nullable)."""
    con = duckdb.connect()
    con.execute(SCHEMA_SQL.read_text())
    rows = con.execute("SELECT table_name, column_name FROM information_schema.columns "
                       "WHERE is_nullable = 'NO'").fetchall()
    con.close()
    out: dict[str, set[str]] = {}
    for table, col in rows:
        out.setdefault(table, set()).add(col)
    return {t: frozenset(c) for t, c in out.items()}


def tables() -> list[str]:
    return list(arrow_schemas())


def empty(table: str) -> pa.Table:
    # (not Schema.empty_table(): that imports pandas, a third of a second of every reader's start)
    return pa.Table.from_batches([], arrow_schemas()[table])


def conform(table: str, data: pa.Table, fill: dict | None = None) -> pa.Table:
    """Cast to the schema's types and column order (dictionary -> string etc., done in C++).
    ``fill``: constants for columns the producer left out (the writer's ``boot``); a nullable column
    it left out is NULL; a NOT NULL one it left out is an error."""
    schema = arrow_schemas()[table]
    have = set(data.column_names)
    for name, value in (fill or {}).items():
        if name in schema.names and name not in have:
            data = data.append_column(name, pa.array([value] * data.num_rows, schema.field(name).type))
            have.add(name)
    required = not_null().get(table, frozenset())
    for f in schema:            # a nullable column the producer does not know (added later): NULL
        if f.name not in have and f.name not in required:
            data = data.append_column(f.name, pa.nulls(data.num_rows, f.type))
            have.add(f.name)
    missing = [f.name for f in schema if f.name not in have]
    if missing:
        raise ValueError(f"{table}: missing columns {missing}")
    return data.select(schema.names).cast(schema)


def collector_span_columns() -> tuple[str, ...]:
    """The ``spans`` columns of the Collector's ``otel_traces`` (``Timestamp`` .. ``Links.SpanId``), in order;
    the typed columns promoted from the attributes follow them in the schema."""
    names = arrow_schemas()["spans"].names
    return tuple(names[:names.index("Links.SpanId") + 1])


def span_columns() -> tuple[str, ...]:
    """Every ``spans`` column, in the schema's order."""
    return tuple(arrow_schemas()["spans"].names)
