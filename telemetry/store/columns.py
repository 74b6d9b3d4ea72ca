"""Columns on their way into a segment: the writer's batches as numpy arrays (``Columns``, with
``Coded`` strings and ``Ragged`` lists), made Arrow only on the writer thread, and the Parquet
options each table is written with. Hot paths hand over columns, never per-row objects."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class Coded(NamedTuple):
    """A string column as codes into a few distinct values; becomes Arrow on the writer thread."""
    codes: np.ndarray
    values: list


class Ragged(NamedTuple):
    """A list column of variable length: row i is values[offsets[i]:offsets[i + 1]]."""
    offsets: np.ndarray
    values: np.ndarray


Columns = dict[str, "np.ndarray | Coded | Ragged"]   # 1-D arrays, 2-D arrays (one list per row), Coded strings (2-D: lists), Ragged lists


def num_rows(data: "pa.Table | Columns") -> int:
    if isinstance(data, pa.Table):
        return data.num_rows
    first = next(iter(data.values()))
    if isinstance(first, Ragged):
        return len(first.offsets) - 1
    return len(first.codes if isinstance(first, Coded) else first)


def concat_columns(batches: list[Columns]) -> Columns:
    """Concatenate column batches (same keys) into one batch, all in numpy (string codes remapped)."""
    out: Columns = {}
    for name in batches[0]:
        parts = [b[name] for b in batches]
        if isinstance(parts[0], Coded):
            uniq: dict = {}
            codes = [np.array([uniq.setdefault(v, len(uniq)) for v in p.values], dtype=np.int32)[p.codes] for p in parts]
            out[name] = Coded(np.concatenate(codes), list(uniq))
        elif isinstance(parts[0], Ragged):
            sizes = [int(p.offsets[-1] - p.offsets[0]) for p in parts]
            base = np.cumsum([0] + sizes[:-1])
            offsets = np.concatenate([np.zeros(1, np.int64)] + [p.offsets[1:] - p.offsets[0] + b for p, b in zip(parts, base)])
            out[name] = Ragged(offsets, np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts]))
        else:
            out[name] = np.concatenate(parts)
    return out


def columns_to_arrow(batches: list[Columns]) -> pa.Table:
    """Concatenate column batches (same keys) into one Arrow table, all in numpy/C++."""
    cols = concat_columns(batches) if len(batches) > 1 else batches[0]
    out = {}
    for name, v in cols.items():
        if isinstance(v, Coded):
            codes = v.codes.astype(np.int32, copy=False).ravel()
            if None in v.values:        # NULL in the codes, not the dictionary (Parquet writes no NULL entry)
                nulls = np.isin(codes, [i for i, x in enumerate(v.values) if x is None])
                arr = pa.DictionaryArray.from_arrays(pa.array(codes, mask=nulls),
                                                     pa.array(["" if x is None else x for x in v.values], pa.string()))
            else:
                arr = pa.DictionaryArray.from_arrays(codes, pa.array(v.values, pa.string()))
            codes = v.codes
            if codes.ndim == 2:         # one list of strings per row (e.g. a scope per slot)
                arr = pa.ListArray.from_arrays(np.arange(codes.shape[0] + 1, dtype=np.int32) * codes.shape[1], arr)
            out[name] = arr
        elif isinstance(v, Ragged):
            out[name] = pa.ListArray.from_arrays(v.offsets.astype(np.int32), pa.array(v.values))
        elif (v := np.asarray(v)).ndim == 2:
            offsets = np.arange(v.shape[0] + 1, dtype=np.int32) * v.shape[1]
            out[name] = pa.ListArray.from_arrays(offsets, pa.array(v.ravel()))
        else:       # a float NaN is a value not measured: NULL in the store
            out[name] = pa.array(v, from_pandas=v.dtype.kind == "f")
    return pa.table(out)


HEX_HASHES = {"block_hashes", "parent_hash"}                      # a foreign engine's block hashes, in hex
NO_DICTIONARY = {"tag_h", "hash", *HEX_HASHES}   # content hashes: they do not repeat, a dictionary only costs
# the columns readers look rows up by value in, per table (the n-gram evidence: every ngrams row of a
# candidate hash, forensics/queries/evidence.py): a Bloom filter per row group, that DuckDB probes
# before it reads one, and row groups of LOOKUP_ROW_GROUP rows rather than Parquet's 1 Mi (its min and
# max then narrow a lookup by incarnation too). Measured on a 12.8 M-row ngrams segment of the
# forensics bench's store (one-off; README, the thirty-seventh session): the 181 candidate hashes' rows 0.057 -> 0.015 s, 3,575
# incarnations' 0.026 -> 0.010 s, a whole scan the same, the file 2.5 % bigger; a filter sized for a
# false positive rate of 5 % skipped nothing for 181 values (each row group passes if any of them does)
LOOKUPS = {"ngrams": ("hash",)}
LOOKUP_ROW_GROUP = 1 << 17
LOOKUP_FPP = 0.001
# the rows of a table a reader looks up apart, per table: (column, value) - a segment's rows holding
# that value come first, in row groups of their own (the rest follow, each part in its order as it came),
# so a reader filtering on the value reads only those row groups (their min and max are the value) and
# one filtering it out never meets them. ngrams: the responses' output n-grams, which the n-gram evidence
# reads by the exposed responses' incarnations (forensics/queries/evidence.py), where a prompt's
# n-grams - every other row - are read by hash. At 121 M read rows (the forensics bench's store, 282 M
# ngrams rows of which 190 K outputs) the outputs' lookup read 1,300 responses' row groups whole.
APART = {"ngrams": ("role", "output")}


def parts_apart(table: str, data: pa.Table) -> list[pa.Table]:
    """A segment's rows as the parts written each in its own row groups: ``data`` as it is, or the
    rows holding the table's APART value, then the others (both in their order in ``data``)."""
    col, value = APART.get(table, (None, None))
    if col is None or col not in data.column_names or data.num_rows == 0:
        return [data]
    first = pc.fill_null(pc.equal(data[col], pa.scalar(value)), False)
    n = pc.sum(first).as_py() or 0
    if n in (0, data.num_rows):
        return [data]
    return [data.filter(first), data.filter(pc.invert(first))]


def parquet_options(schema: pa.Schema, table: str | None = None) -> dict:
    """Statistics on scalar columns only (what a reader prunes on: times, clocks, ids; not lists
    of slots), no dictionary for the keyed hashes: every flush writes a segment per table, so its CPU counts.
    LZ4 everywhere but on hex hashes, which it cannot shrink and zstd halves in the same time.
    A table with lookup columns (LOOKUPS) gets smaller row groups and a Bloom filter on each, sized by
    ``sized_for`` for the rows a segment holds."""
    if not any(f.name in HEX_HASHES for f in schema):
        compression: str | dict = "lz4"
    else:
        compression = {_leaf_path(f): "zstd" if f.name in HEX_HASHES else "lz4" for f in schema}
    out = {"write_statistics": [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_map(f.type)],
           "use_dictionary": [_leaf_path(f) for f in schema if f.name not in NO_DICTIONARY], "compression": compression,
           # no Arrow schema in the file: its columns read back as Parquet's types make them - the store's
           # schema (tests/test_store.py), never the Arrow dictionaries a segment is encoded from
           "store_schema": False}
    lookups = [c for c in LOOKUPS.get(table, ()) if c in schema.names]
    if lookups:
        out |= {"row_group_size": LOOKUP_ROW_GROUP, "bloom_filter_options": {c: {"fpp": LOOKUP_FPP} for c in lookups}}
    return out


def sized_for(options: dict, rows: int) -> dict:
    """The options with each Bloom filter sized for the distinct values of one row group of a
    segment of ``rows`` rows (at most the row group's rows): a small flush's filter stays small."""
    if "bloom_filter_options" not in options:
        return options
    ndv = max(1, min(rows, options.get("row_group_size", rows)))
    return options | {"bloom_filter_options": {c: o | {"ndv": ndv} for c, o in options["bloom_filter_options"].items()}}


def _leaf_path(f: pa.Field) -> str:
    """The Parquet column path of a field's values ("found_writers.list.element" for a list)."""
    return f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name
