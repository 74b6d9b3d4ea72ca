"""The store schema, read from ``schema.sql`` (the one source of truth) into Arrow schemas."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import cache
from pathlib import Path

import duckdb
import pyarrow as pa

SCHEMA_SQL = Path(__file__).with_name("schema.sql")


Mapping = tuple[dict[str, pa.Schema], dict[str, frozenset[str]]]     # (Arrow schemas, NOT NULL columns) by table


def _mapped(ddl: str) -> Mapping:
    """DuckDB's own reading of the DDL: each table's Arrow schema (its export of the table, empty)
    and its NOT NULL columns (DuckDB's Arrow export marks every field nullable)."""
    con = duckdb.connect()
    try:
        con.execute(ddl)
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
        schemas = {name: con.table(name).limit(0).to_arrow_table().schema for name in names}
        required: dict[str, set[str]] = {name: set() for name in names}
        for table, col in con.execute("SELECT table_name, column_name FROM information_schema.columns "
                                      "WHERE is_nullable = 'NO'").fetchall():
            required.setdefault(table, set()).add(col)
    finally:
        con.close()
    return schemas, {t: frozenset(c) for t, c in required.items()}


def _kept_path(ddl: str) -> Path:
    from telemetry.store.keys import state_dir
    key = hashlib.sha256(json.dumps([ddl, duckdb.__version__, pa.__version__]).encode()).hexdigest()[:32]
    return state_dir() / "schemas" / f"{key}.arrow"


@cache
def _store_schema() -> Mapping:
    """The DDL's mapping (``_mapped``), made once per DDL, DuckDB and pyarrow and kept in the state
    directory (per table: its name, serialized Arrow schema and NOT NULL columns): the mapping - a
    DuckDB database made for it, the DDL run, every table exported empty, the columns' nullability
    read - is 50-70 ms of every reader's and writer's start (one-off, an AMD EPYC), the kept file's
    read about 5 ms. An unreadable kept file, or one written before it held the NOT NULL columns, is
    mapped again; one that cannot be written changes nothing."""
    ddl = SCHEMA_SQL.read_text()
    path = _kept_path(ddl)
    try:
        with pa.OSFile(str(path)) as f:
            kept = pa.ipc.open_file(f).read_all()
        names = kept["name"].to_pylist()
        schemas = {n: pa.ipc.read_schema(pa.py_buffer(b)) for n, b in zip(names, kept["schema"].to_pylist())}
        required = {n: frozenset(c) for n, c in zip(names, kept["not_null"].to_pylist())}
        if schemas:
            return schemas, required
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        pass
    schemas, required = _mapped(ddl)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"name": list(schemas), "schema": [s.serialize().to_pybytes() for s in schemas.values()],
                          "not_null": pa.array([sorted(required.get(n, ())) for n in schemas], pa.list_(pa.string()))})
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)         # (a write cut short, e.g. by a full disk, leaves nothing)
    except (OSError, pa.ArrowException):
        pass
    return schemas, required


def arrow_schemas() -> dict[str, pa.Schema]:
    """table name -> Arrow schema, as DuckDB itself maps the DDL (kept: ``_store_schema``)."""
    return _store_schema()[0]


def not_null() -> dict[str, frozenset[str]]:
    """table -> its NOT NULL columns (kept with the schemas: a writer's first segment no longer makes
    a DuckDB database and runs the DDL for them: 46-48 ms of its first flush, one-off, an AMD EPYC)."""
    return _store_schema()[1]


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
