"""The store schema, read from ``schema.sql`` (the one source of truth) into Arrow schemas."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import cache
from pathlib import Path

import duckdb
import numpy as np
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


def conform(table: str, data: pa.Table, fill: dict | None = None, dictionaries: bool = False) -> pa.Table:
    """Cast to the schema's types and column order (dictionary -> string etc., done in C++).
    ``fill``: constants for columns the producer left out (the writer's ``boot``); a nullable column
    it left out is NULL; a NOT NULL one it left out is an error. ``dictionaries``: to
    ``writing_schema`` instead (string columns as Arrow dictionaries: what a segment is encoded from)."""
    schema = arrow_schemas()[table]
    target = writing_schema(table) if dictionaries else schema
    have = set(data.column_names)
    for name, value in (fill or {}).items():
        if name in schema.names and name not in have:
            data = data.append_column(name, _constant(value, data.num_rows, target.field(name).type))
            have.add(name)
    required = not_null().get(table, frozenset())
    for f in target:            # a nullable column the producer does not know (added later): NULL
        if f.name not in have and f.name not in required:
            data = data.append_column(f.name, pa.nulls(data.num_rows, f.type))
            have.add(f.name)
    missing = [f.name for f in schema if f.name not in have]
    if missing:
        raise ValueError(f"{table}: missing columns {missing}")
    return data.select(schema.names).cast(target)


@cache
def writing_schema(table: str) -> pa.Schema:
    """The table's schema as the store's writer encodes a segment from it: each string column that
    Parquet dictionary-encodes (all but ``columns.NO_DICTIONARY``), and each list of strings, as an
    Arrow dictionary of strings. The producers' string columns are mostly dictionaries already
    (``columns.Coded``: a node, a scope, a request's trace id per row); Parquet writes an Arrow
    dictionary as its own, where a string column it hashes value by value again - cast to strings
    and encoded, a 9,300-row page_writes segment took 2.7 ms, kept as dictionaries 1.9 (one-off, an
    AMD EPYC). The file reads back as the schema: no Arrow schema is stored with it
    (``columns.parquet_options``), so its columns are what Parquet's own types make them."""
    from telemetry.store.columns import NO_DICTIONARY
    words = pa.dictionary(pa.int32(), pa.string())
    fields = []
    for f in arrow_schemas()[table]:
        if pa.types.is_string(f.type) and f.name not in NO_DICTIONARY:
            f = f.with_type(words)
        elif pa.types.is_list(f.type) and pa.types.is_string(f.type.value_type) and f.name not in NO_DICTIONARY:
            f = f.with_type(pa.list_(f.type.value_field.with_type(words)))
        fields.append(f)
    return pa.schema(fields, metadata=arrow_schemas()[table].metadata)


def _constant(value, n: int, typ: pa.DataType) -> pa.Array:
    """``n`` rows of ``value`` (in C++: a Python list of them cost ~3 ms at 22,000 rows)."""
    if pa.types.is_dictionary(typ):
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value], typ.value_type))
    return pa.repeat(pa.scalar(value, typ), n)


def collector_span_columns() -> tuple[str, ...]:
    """The ``spans`` columns of the Collector's ``otel_traces`` (``Timestamp`` .. ``Links.SpanId``), in order;
    the typed columns promoted from the attributes follow them in the schema."""
    names = arrow_schemas()["spans"].names
    return tuple(names[:names.index("Links.SpanId") + 1])


def span_columns() -> tuple[str, ...]:
    """Every ``spans`` column, in the schema's order."""
    return tuple(arrow_schemas()["spans"].names)
