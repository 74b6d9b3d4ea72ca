"""``kvledger forensics QUERY``: one named query of the catalogue (``forensics/queries/catalog.py``)
over the store, as a table (80 columns by default), CSV, JSON or Parquet. Exit 0, or 3 when a
page-level question is asked of runs that recorded no page ledger (the answer is unknown: each
such run is named on stderr)."""
from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.commands.options import add_store, check_window, timestamp
from engine.errors import InputError
from forensics.commands.options import EngineChoice, add_engine_options, add_verify_options, engine_choice
from forensics.queries.catalog import FOLDED, QUERIES, SOURCES


MAX_BUCKET = 10 * 365 * 86400
VERIFY_INDEX = "verify-index"
VERIFY_INDEX_HELP = ("recompute the exposure index from the ledger (the slot-level as-of join) and name every "
                     "difference: exit 0 when they agree, 1 when not, 3 when a run has no index")


@dataclass(frozen=True, slots=True)
class QueryConfig:
    query: str
    store: str
    format: str = "table"
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    bucket: int = 60
    wide: bool = False
    columns: str | None = None
    run: str | None = None
    source: str = "auto"
    allow_unverified: bool = False
    anchor: str | None = None
    engine: EngineChoice = EngineChoice()


def add_arguments(f) -> None:
    f.add_argument("query", choices=list(QUERIES) + [VERIFY_INDEX],
                   help="; ".join(f"{k}: {v}" for k, v in {**QUERIES, VERIFY_INDEX: VERIFY_INDEX_HELP}.items()))
    add_store(f, "the store to query")
    f.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                   help="table (default), csv, json (one array of objects on stdout) or parquet (binary on stdout: "
                        "redirect it)")
    f.add_argument("--from", dest="start", type=timestamp, default=None, help="window start: ISO 8601 (UTC), or relative such as now-15m, 2h, 7d (default: the store's beginning)")
    f.add_argument("--to", dest="end", type=timestamp, default=None, help="window end: ISO 8601 (UTC), or relative such as now-5m (default: now)")
    f.add_argument("--bucket", type=int, default=60, help="tenant_scores: window length in seconds (default 60)")
    f.add_argument("--wide", action="store_true",
                   help="table format: every column (default: the columns that fit 80 characters; csv/json/parquet "
                        "always carry every column)")
    f.add_argument("--columns", default=None, metavar="A,B,...", help="table format: these columns, in this order")
    f.add_argument("--run", metavar="BOOT", default=None,
                   help="answer for one run only: a boot id from `kvledger forensics runs`, or a unique prefix of one "
                        "(default: every run the store holds)")
    f.add_argument("--source", choices=SOURCES, default="auto",
                   help="ttft, impact, tenants: 'ledger' (kvledger's own requests and page ledger), 'spans' (a "
                        "foreign fleet's request spans: fleet_ttft, fleet_impact, fleet_tenants) or 'auto' (default: "
                        "the ledger when the store has kvledger requests, else the spans)")
    add_verify_options(f, "answer even when the store does not verify (every output then says so)")
    add_engine_options(f, spans=True)


def make_config(a) -> QueryConfig:
    if a.query == VERIFY_INDEX and a.engine != "duckdb":
        raise InputError(f"{VERIFY_INDEX} reads the local store's ledger with DuckDB (got --engine {a.engine}); run it "
                         "on the store that was exported (`kvledger export` copies its verified segments as they are)")
    if a.query not in FOLDED and a.source != "auto":
        raise InputError(f"--source applies to {', '.join(FOLDED)} only (their page-ledger and foreign-span views), "
                         f"not to {a.query}")
    if not 1 <= a.bucket <= MAX_BUCKET:
        raise InputError(f"--bucket must be in [1, {MAX_BUCKET}] seconds (ten years), got {a.bucket}")
    check_window(a.start, a.end)
    return QueryConfig(a.query, a.store, a.format, a.start, a.end, a.bucket, a.wide, a.columns, a.run, a.source,
                       a.allow_unverified, a.anchor, engine_choice(a))


def arrow_without_pandas() -> None:
    """pyarrow imports pandas the first time it builds an array from Python values (its pandas shim,
    in ``pa.array``, ``pa.table``...) - 0.25-0.45 s of a first command from the shell on this
    machine, for conversions a query command never makes. Told first that there is none, this
    process's pyarrow converts nothing to or from pandas; pandas itself stays importable. Nothing
    to do where pandas (or pyarrow's look for it) came first."""
    import importlib.abc

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "pandas":
                raise ImportError("pandas hidden from pyarrow's first look (forensics.commands.query)")
            return None

    if "pandas" in sys.modules:
        return
    hidden = Hidden()
    sys.meta_path.insert(0, hidden)
    try:
        import pyarrow as pa
        pa.array([0])
    finally:
        sys.meta_path.remove(hidden)


EXIT_AT_ONCE = True      # run from the shell, the process ends as soon as the answer is out (main.exit_at_once)


def run(c: QueryConfig) -> int:
    import engine.commands.main as entry
    if c.engine.engine == "duckdb" and entry.OWN_PROCESS:    # (a caller's process may want pyarrow's pandas)
        arrow_without_pandas()
    from forensics.output import emit, pick_columns
    from forensics.queries import open_forensics
    from forensics.queries.coverage import PAGE_LEVEL, coverage
    from forensics.queries.fleet import folded

    with status() as say:
        fx = open_forensics(c.store, c.run, allow_unverified=c.allow_unverified, anchor=c.anchor,
                            **c.engine.kwargs(spans=True))
        if c.query == VERIFY_INDEX:
            from forensics.queries.duckdb import indexed
            say("recomputing the exposure index from the ledger (the as-of join) and comparing the two")
            chk = fx.verify_index() if indexed(fx.con) else None
        else:
            fx.phase = say
            df, answered, fold_note = folded(fx, c.query, c.source, c.start, c.end, bucket_s=c.bucket)
            cover = coverage(df if answered == "runs" else fx.page_ledgers()) if answered in PAGE_LEVEL else None
    if c.query == VERIFY_INDEX:
        return verify_index(fx, c, chk)
    note = fx.unverified_note
    if note:
        print(f"kvledger: warning: {note}", file=sys.stderr)
    if fold_note:
        print(f"kvledger: note: {fold_note}", file=sys.stderr)
    for sentence in cover.sentences() if cover else []:
        print(f"kvledger: warning: {sentence}", file=sys.stderr)
    title = f"kvledger forensics {answered} ({c.store})"
    width = None
    if c.format == "table":
        df = pick_columns(df, answered, c.wide, c.columns)
        if c.wide:                          # every column, as wide as it needs (a pager with -S reads it)
            width = 0
    rc = emit(df, c.format, title=f"{note} - {title}" if note else title, width=width)
    # no run in scope recorded a page ledger: the (empty) answer is unknown, not "none" (exit 3)
    return 3 if cover is not None and cover.none and answered != "runs" else rc


@contextmanager
def status(stream=None) -> "Iterator[Callable[[str], None]]":
    """A status line on stderr while the store is verified and the snapshot's shared tables are
    built (a first command on a 100 M-row store with nothing kept: seconds), where stderr is a
    terminal - gone once the answer is ready; elsewhere (a pipe, a script) nothing. Yields what to
    call with each new phase."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        yield lambda text: None
        return
    from rich.console import Console
    with Console(file=stream).status("kvledger: verifying the store", spinner="dots") as line:
        # (naming the spinner again makes rich draw the phase now: a bare text update - and the line's start -
        # wait for its next timed refresh, and a phase shorter than that (a small store's exposure slots) was
        # never shown)
        def say(text: str) -> None:
            line.update(f"kvledger: {text}", spinner="dots")
        say("verifying the store")
        yield say


def verify_index(fx, c: QueryConfig, chk) -> int:
    """The exposure index against the as-of join, slot row for slot row (``chk``: fx.verify_index()'s
    answer, None where a run has no index): every difference named."""
    import json

    import polars as pl

    from forensics.output import emit
    note = fx.unverified_note
    if note:
        print(f"kvledger: warning: {note}", file=sys.stderr)
    if chk is None:
        missing = fx.con.sql("SELECT DISTINCT boot FROM config_snapshots WHERE page_ledger IS NOT FALSE "
                             "AND exposure_index IS NOT TRUE ORDER BY boot").fetchall()
        print(f"kvledger: warning: {len(missing)} run(s) recorded a page ledger without the exposure index (written "
              f"before it): {', '.join(repr(r[0]) for r in missing[:5])}; readers answer them from the as-of join, "
              "and there is no index to verify", file=sys.stderr)
        return 3
    diff = pl.concat([chk.only_join.with_columns(side=pl.lit("join only")),
                      chk.only_index.with_columns(side=pl.lit("index only"))], how="diagonal_relaxed")
    summary = (f"exposure index {'==' if chk.ok else '!='} as-of join: {chk.join_rows} slot row(s) from the join, "
               f"{chk.index_rows} from the index; {chk.only_join.height} only in the join, {chk.only_index.height} only "
               f"in the index, {chk.mass_differs.height} with another attention mass")
    if c.format == "json":
        from forensics.output import json_rows
        print(json.dumps({"ok": chk.ok, "join_rows": chk.join_rows, "index_rows": chk.index_rows,
                          "differences": json.loads(json_rows(diff)),
                          "mass_differs": json.loads(json_rows(chk.mass_differs))}))
    else:
        if not chk.ok:
            if c.format == "table" and not c.wide:      # 80 columns: one line per (side, response, donor, page)
                diff = (diff.group_by("side", "response", "donor", "node", "page", maintain_order=True)
                        .agg(slots=pl.len())
                        .select("side", "response", "donor", pl.format("{}:{}", "node", "page").alias("page"), "slots"))
            emit(diff, c.format, title=f"kvledger forensics {VERIFY_INDEX} ({c.store}): differences")
            if chk.mass_differs.height:
                emit(chk.mass_differs, c.format, title="attention mass differs")
        print(summary, file=sys.stdout if c.format == "table" else sys.stderr)
    return 0 if chk.ok else 1
