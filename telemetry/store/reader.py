"""Reading the store: an in-memory DuckDB with one view per table over exactly the chained
segments (a reader never sees a half-written file), narrowed to one run on request."""
from __future__ import annotations

import os
from pathlib import Path

import duckdb

from telemetry.errors import StoreError
from telemetry.store.chain import file_columns, live_links, read_chain
from telemetry.store.schema import arrow_schemas, empty


def segment_files(root: str | Path, skip: "set[str] | frozenset[str]" = frozenset(),
                  chain: "list | None" = None) -> dict[str, list[str]]:
    """Each table's chained segment files (paths, in chain order) that exist and are not in ``skip``:
    the live ones - a segment a compaction replaced is read through the compaction's file.
    ``chain``: the links, read already (else read here)."""
    root = Path(root)
    if not (root / "chain").is_dir():
        raise StoreError(f"no kvledger store at {root} (expected {root}/chain); run `kvledger replay` with --store first")
    by_table: dict[str, list[str]] = {t: [] for t in arrow_schemas()}
    if chain is None:
        try:
            chain = read_chain(root)
        except ValueError as e:
            raise StoreError(str(e)) from None
    for link in live_links(chain):
        if link.table in by_table and link.file not in skip and (root / link.file).exists():
            by_table[link.table].append(str(root / link.file))
    return by_table


def segment_merges(root: str | Path, chain: "list | None" = None) -> list[tuple[str, tuple[str, ...]]]:
    """Every merge the writer made (chain order): its file's path and the paths of the segments it
    replaced - what lets a reader that kept a table over those segments keep it over the merge.
    ``chain``: the links, read already (else read here). (Paths as ``segment_files`` gives them.)"""
    base = str(Path(root))
    if chain is None:
        try:
            chain = read_chain(Path(root))
        except (OSError, ValueError):
            return []
    by_seq = {ln.seq: ln for ln in chain}
    return [(os.path.join(base, ln.file), tuple(os.path.join(base, by_seq[r].file) for r in ln.parts() if r in by_seq))
            for ln in chain if ln.replaces]


def carried(kept: dict[str, tuple], now: dict[str, tuple], merges: list[tuple[str, tuple[str, ...]]]) -> dict[str, tuple]:
    """``kept`` (segment path -> stat, the segments a kept table covers) said in today's files: a
    merge of segments it all covers stands for them (it holds exactly their rows, in one file). A
    merge of some it covers and some it does not leaves those it covers - no longer live - to
    show the kept table stale. (file -> stat as in ``now``; a merge not live now: a stat no file has.)"""
    out = dict(kept)
    for f, parts in merges:
        if f not in out and parts and all(p in out for p in parts):
            for p in parts:
                del out[p]
            out[f] = now.get(f, ("not live",))
    return out


def table_relation(con: duckdb.DuckDBPyConnection, table: str, files: list[str],
                   cache: dict | None = None) -> duckdb.DuckDBPyRelation:
    """One table over these segment files, in today's schema: segments written by an older schema
    lack the columns added since - read by name, every column of today's schema given (NULL where a
    segment did not have it), so an old store opens and every query runs on it.

    ``cache``: the reader's verification cache. Files whose column signature it holds
    (``chain.file_columns``) are bound a group per signature - one read_parquet each, DuckDB reading
    the first file's footer only - where ``union_by_name`` reads every file's footer at every bind
    (the view, each query over it): seconds at thousands of segments. The rest, as before, by name."""
    if not files:
        return con.from_arrow(empty(table))
    groups: dict[tuple | None, list[str]] = {}
    for f in files:
        groups.setdefault(file_columns(f, cache), []).append(f)
    rels = [_projected(con, table, con.read_parquet(fs, union_by_name=sig is None)) for sig, fs in groups.items()]
    out = rels[0]
    for rel in rels[1:]:
        out = out.union(rel)            # UNION ALL: each projected to today's schema, in its order
    return out


def _projected(con: duckdb.DuckDBPyConnection, table: str, rel: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    schema = arrow_schemas()[table]
    have = set(rel.columns)
    cols = [duckdb.ColumnExpression(f.name) if f.name in have else
            duckdb.ConstantExpression(None).cast(_duck_type(con, table, f.name)).alias(f.name)
            for f in schema]
    if "boot" in schema.names:      # rows written before runs had ids: one run, ''
        cols[schema.names.index("boot")] = duckdb.CoalesceOperator(
            duckdb.ColumnExpression("boot") if "boot" in have else duckdb.ConstantExpression(None).cast("VARCHAR"),
            duckdb.ConstantExpression("")).alias("boot")
    return rel.select(*cols)


def open_store(root: str | Path, run: str | None = None, skip: "set[str] | frozenset[str]" = frozenset(),
               files: dict[str, list[str]] | None = None, cache: dict | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table over the chained segments (read-only use).
    ``run``: a boot id, or a unique prefix of one: every table with a ``boot`` column shows that
    run's rows only (``ngrams`` is keyed by incarnation, unique across runs, and stays whole).
    ``skip``: segment files (as the chain names them) left out - the damaged ones, for a reader
    that answers on a store that does not verify. ``files``: ``segment_files``' lists, when the
    caller needs to know exactly which segments this snapshot holds (a live store grows meanwhile).
    ``cache``: the caller's verification cache (``table_relation``: segments bound by their known
    column signatures). Parquet footers are kept in the connection once read (DuckDB's
    ``parquet_metadata_cache``): a query does not read every segment's footer again."""
    by_table = segment_files(root, skip) if files is None else files
    # big joins spill to disk: keep that out of the caller's working directory
    import tempfile
    con = duckdb.connect(config={"temp_directory": str(Path(tempfile.gettempdir()) / "kvledger-duckdb-spill")})
    con.execute("SET parquet_metadata_cache = true")
    schemas = arrow_schemas()
    rels = {table: table_relation(con, table, f, cache) for table, f in by_table.items()}
    if run is not None:
        boot = resolve_run(rels["config_snapshots"], run)
        for table, rel in rels.items():
            if "boot" in schemas[table].names:
                rels[table] = rel.filter(duckdb.ColumnExpression("boot") == duckdb.ConstantExpression(boot))
    for table, rel in rels.items():
        rel.create_view(table)
    return con


def resolve_run(config_snapshots: duckdb.DuckDBPyRelation, run: str) -> str:
    """The boot id a user named by a unique prefix (as git names commits)."""
    return resolve_boot({r[0] for r in config_snapshots.select(duckdb.ColumnExpression("boot")).fetchall()}, run)


def resolve_boot(boots: "set[str] | list[str]", run: str) -> str:
    """The one boot id of ``boots`` that ``run`` names (a unique prefix; '' names the pre-boot run)."""
    boots = sorted(set(boots))
    hits = [b for b in boots if b.startswith(run)] if run else [b for b in boots if b == ""]
    if len(hits) == 1:
        return hits[0]
    listed = ", ".join(b or "''" for b in boots[:8]) + (" ..." if len(boots) > 8 else "")
    if not hits:
        raise StoreError(f"--run {run!r}: no run with that boot id in this store (it holds {len(boots)}: {listed}; "
                         "see `kvledger forensics runs`)")
    raise StoreError(f"--run {run!r} is ambiguous: it starts {len(hits)} boot ids ({', '.join(hits[:8])}); "
                     "give more characters")


def _duck_type(con: duckdb.DuckDBPyConnection, table: str, column: str) -> duckdb.typing.DuckDBPyType:
    """The DuckDB type of a schema column (from the empty Arrow table of that schema)."""
    return con.from_arrow(empty(table)).select(duckdb.ColumnExpression(column)).types[0]
