"""The forensic Python API: named SQL files (``forensics/sql``) run by DuckDB over the store,
results as polars DataFrames. Python passes parameters; it never pastes values into SQL.

    fx = Forensics("./kvledger-store")
    fx.exposures()            # one row per (response, donor incarnation)
    fx.exposure_slots()       # one row per failing slot read, with its donor (the as-of join)
    fx.query("ttft", start=..., end=...)
"""
from __future__ import annotations

import datetime as dt
import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Callable, NamedTuple
from pathlib import Path

import duckdb
import polars as pl

from forensics.queries.grown import WHOLE, build as grow, enabled as grow_enabled
from forensics.queries.evidence import FOLD, PUSHED, build as build_evidence, kept as evidence_kept
from forensics.queries.answers import Answers, enabled as answers_enabled
from forensics.queries.base import with_response_state, without_order
from telemetry.store import (GENESIS, StoreError, has_live_writer, open_store, read_chain, segment_files, segment_merges,
                             verify)
from telemetry.store.chain import HashCache, damaged_segments

SQL_DIR = Path(__file__).parent.parent / "sql"     # forensics/sql: the named queries
# tables the queries build on, materialised once per connection (a snapshot of the store) on first
# use: requests (one row per request, from its spans), exposure_slots (the as-of join) and
# exposure_ngrams (what of each donor's prompt each response's output repeats); the macros over
# them are created then
MATERIALISED = ["requests", "exposure_slots", "exposure_ngrams"]
MACROS = ["exposure_pairs_of", "exposure_pairs_in", "exposures_in", "scores_in"]   # in this order
EVIDENCE_STEPS = ["pairs", "read_runs", "digest", "candidates", "requests_digest", "final"]   # forensics/sql/evidence: exposure_ngrams.sql in steps
from forensics.queries.catalog import LEDGER_QUERIES as QUERIES  # noqa: E402,F401  (the ledger's own names)

READS_REQUESTS = re.compile(r"\brequests\b")     # a query text that reads the requests table itself (comments aside)
EVIDENCE_READERS = re.compile(r"\b(exposure_ngrams|exposures_in|scores_in)\b")    # ... or the n-gram evidence
COMMENT = re.compile(r"--[^\n]*")
EPOCH = dt.datetime(1970, 1, 1)
FAR = dt.datetime(2262, 1, 1)       # TIMESTAMP_NS ends in April 2262
DEFAULTS = {"bucket_s": 60, "min_tokens": 32, "slack": 0.5, "boundary": 0.02, "min_probes": 3, "share": 0.2}


@cache
def sql(name: str) -> str:
    if name == "exposure_slots_index":      # the index's runs (what readers keep), each as its slot rows
        return f"WITH exposure_runs AS (\n{sql('exposure_runs_index')}\n)\n{sql('exposure_slots_of_runs')}"
    path = SQL_DIR / f"{name}.sql"
    if not path.exists():
        raise KeyError(f"no query named {name!r} in {SQL_DIR}")
    return path.read_text()


def query_hashes(directory: Path = SQL_DIR) -> dict[str, str]:
    """SHA-256 of every SQL file (report provenance: which queries produced the numbers); the
    ClickHouse engines' files are in SQL_DIR / "clickhouse"."""
    return {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.sql"))}


def unverified_note(verdict, left_out: "list[str] | tuple[str, ...]" = ()) -> str | None:
    """What every output must say when it was computed on a store that did not verify (and which
    damaged segments it left out)."""
    if verdict.ok:
        return None
    skipped = ""
    if left_out:
        named = ", ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
        skipped = f"; {len(left_out)} damaged segment(s) left out ({named})"
    return f"UNVERIFIED STORE - {verdict.broken}{skipped}; these answers may be wrong or incomplete"


def indexed(con: "duckdb.DuckDBPyConnection") -> bool:
    """Whether every run of this snapshot that records a page ledger wrote the exposure index beside it."""
    cols = {r[0] for r in con.sql("DESCRIBE config_snapshots").fetchall()}
    if "exposure_index" not in cols:
        return False
    return con.sql("SELECT count(*) FROM config_snapshots WHERE page_ledger IS NOT FALSE "
                   "AND exposure_index IS NOT TRUE").fetchall()[0][0] == 0


# exposure_slots' columns, compared as they are (attention mass: to 1e-9 relative; sums in another order)
INDEX_KEY = ["node", "boot", "response", "donor", "page", "generation", "block_index", "slot", "position", "donor_position",
             "kind", "write_generation", "write_path", "written_at", "n_reads", "step_first", "step_last", "lclock_first",
             "ts_first", "ts_last", "trace_id", "span_id"]


class IndexCheck(NamedTuple):
    join_rows: int              # slot rows of the as-of join
    index_rows: int             # ... and of the index
    only_join: "pl.DataFrame"   # rows the index misses (or has otherwise)
    only_index: "pl.DataFrame"  # rows the join does not have
    mass_differs: "pl.DataFrame"   # same row, attention mass differs beyond rounding

    @property
    def ok(self) -> bool:
        return not (self.only_join.height or self.only_index.height or self.mass_differs.height)


def check_index(con: "duckdb.DuckDBPyConnection") -> IndexCheck:
    """Both answers materialised side by side on one snapshot, compared in SQL (rows in one and not
    the other, both ways, and attention mass beyond rounding)."""
    con.sql(sql("exposure_slots")).to_table("_check_join")
    con.sql(sql("exposure_slots_index")).to_table("_check_index")
    cols = ", ".join(f'"{c}"' for c in INDEX_KEY)
    # each side's rows not in the other, as many times as they are more there (EXCEPT ALL's answer, both
    # ways): one grouping of both sides together, not two EXCEPT ALLs (121 M read rows: 2.9 -> 0.65 s)
    con.sql(f"CREATE OR REPLACE TEMP TABLE _check_diff AS SELECT {cols}, count(*) FILTER (WHERE s = 0) AS nj, "
            f"count(*) FILTER (WHERE s = 1) AS ni FROM (SELECT {cols}, 0 AS s FROM _check_join UNION ALL "
            f"SELECT {cols}, 1 AS s FROM _check_index) GROUP BY ALL HAVING nj <> ni")
    only = lambda a, b: con.sql(f"SELECT {cols} FROM _check_diff, range({a} - {b}) WHERE {a} > {b} "  # noqa: E731
                                f"ORDER BY ALL").pl()
    on = " AND ".join(f'j."{c}" IS NOT DISTINCT FROM i."{c}"' for c in INDEX_KEY)
    mass = con.sql(f"SELECT j.response, j.donor, j.node, j.page, j.slot, j.attention_mass AS join_mass, "
                   f"i.attention_mass AS index_mass FROM _check_join j JOIN _check_index i ON {on} "
                   f"WHERE (j.attention_mass IS NULL) <> (i.attention_mass IS NULL) "
                   f"OR abs(j.attention_mass - i.attention_mass) > 1e-9 * greatest(1, abs(j.attention_mass))").pl()
    n = lambda t: con.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0]  # noqa: E731
    out = IndexCheck(n("_check_join"), n("_check_index"), only("nj", "ni"), only("ni", "nj"), mass)
    con.sql("DROP TABLE _check_join; DROP TABLE _check_index; DROP TABLE _check_diff")
    return out


def _runs_of_slots(con: "duckdb.DuckDBPyConnection", kind: str) -> None:
    """``exposure_runs`` (what exposure_pairs_of.sql and the n-gram evidence read) over slot rows made
    without runs - the as-of join's (a ``TABLE``: read several times) or a kept answers entry's."""
    con.execute(f"CREATE OR REPLACE {kind} exposure_runs AS {sql('exposure_runs_of_slots')}")


class Forensics:
    engine = "duckdb"
    source = "the local store"

    def __init__(self, store: str | Path, run: str | None = None, *, allow_unverified: bool = False,
                 anchor: str | Path | None = None, cache: dict | None = None, use_index: bool = True,
                 answer_cache: bool = True):
        """Verify the store first (its signed chain, and its anchor when one is found) and refuse a
        store that does not verify, unless ``allow_unverified`` - then ``self.verdict`` says so and
        every output must (``unverified_note``). ``cache``: a long-lived reader's verification
        cache, so a growing store is verified incrementally."""
        self.store, self.run = Path(store), run
        self.phase: "Callable[[str], None] | None" = None    # told what is being built (a command's status line)
        if cache is None:                   # a command: the segment hashes of earlier commands, outside the store
            cache = HashCache(self.store)
        self.verdict = verify(self.store, anchor, cache=cache)
        if isinstance(cache, HashCache):
            cache.save()
        if not self.verdict.ok and not allow_unverified:
            raise StoreError(f"store {self.store} does not verify: {self.verdict.broken}; refusing to answer "
                             "(--allow-unverified answers anyway, and says so in every output)")
        # a damaged segment is never opened: it can crash the Parquet reader or read as garbage
        self.left_out = damaged_segments(self.store, cache) if not self.verdict.ok else []
        # exactly the segments this snapshot holds (a live store grows meanwhile): the n-gram evidence
        # reads only the ones an earlier snapshot of this process had not (evidence.py)
        try:
            chain = read_chain(self.store)
        except ValueError as e:
            raise StoreError(str(e)) from None
        self.files = segment_files(self.store, set(self.left_out), chain)
        self.merges = segment_merges(self.store, chain)     # what the writer merged: kept tables carry over (grown.py)
        self.con = open_store(self.store, run, files=self.files, cache=cache)
        if isinstance(cache, HashCache):
            cache.save()                    # the segments' column signatures open_store read (chain.file_columns)
        # the run's boot id, when ``run`` named one (a prefix): the views hold that run's rows only
        self.boot = None if run is None else self.con.sql("SELECT any_value(boot) FROM config_snapshots").fetchall()[0][0]
        self._grown: dict[str, object] = {}     # the Arrow tables under grown views (alive as long as con)
        # each request's queue time, computed where it is read (ttft.sql); a grown snapshot replaces it
        self.con.execute(f"CREATE VIEW queues AS {sql('queues')}")
        self.con.execute(f"CREATE VIEW page_ledgers AS {sql('page_ledgers')}")     # (runs.sql reads it)
        self.live = has_live_writer(self.store)     # a response with no end is "in flight", else "cut off"
        self._made: set[str] = set()
        # materialise's two stages, each made once: requests, the slot rows and the pair macros; the
        # n-gram evidence and the macros over it
        self._base_made = self._macros_made = False
        # the incarnations whose rows the table requests holds while it holds only the rows the
        # exposure questions read (materialise(narrow=True)); None: the whole table or none yet
        self.narrowed: set[int] | None = None
        # the slot-level answers come from the exposure index where every run with a page ledger wrote
        # one beside it (else, or asked to, from the as-of join over the whole ledger)
        self.indexed = use_index and indexed(self.con)
        # the shared tables of this snapshot, kept between commands (a store that verified, that no
        # writer holds, whose chain is still the one verified: nothing can have been added since)
        self.answers: Answers | None = None
        self.keep_answers = answer_cache        # (the n-gram evidence's kept rows follow the same switch)
        self.from_cache: set[str] = set()      # the shared tables read back rather than built
        if (answer_cache and answers_enabled() and self.verdict.ok and not self.live
                and self._chain_head() == self.verdict.head):
            self.answers = Answers(self.store, self.verdict, run, {t: self._text(t) for t in MATERIALISED})

    def _chain_head(self) -> str | None:
        try:
            links = read_chain(self.store)
        except (OSError, ValueError):
            return None
        return links[-1].link if links else GENESIS

    def _text(self, name: str) -> str:
        if name == "exposure_ngrams":       # built in steps (evidence.py): the steps' SQL (and fold) is its text
            return "\n".join([*(sql(f"evidence/{step}") for step in EVIDENCE_STEPS), f"-- {FOLD}"])
        return sql("exposure_slots_index" if name == "exposure_slots" and self.indexed else name)

    def _ensure(self, name: str, con: "duckdb.DuckDBPyConnection | None" = None, cached: bool = True) -> None:
        if name not in self._made:
            c = con or self.con
            if name == "requests" and self.narrowed is not None:     # a query reads every request now
                c.execute("DROP TABLE requests")
                self.narrowed = None
            if cached and self.answers is not None and self.answers.load(c, [name]):
                self.from_cache.add(name)
                if name == "exposure_slots":
                    _runs_of_slots(c, "VIEW")
            elif grow_enabled() and name == "requests":
                self._grown |= grow(c, name, self.store, self.run, self.boot, self.files,
                                    self._text(name), sql("queues"), disk=self.keep_answers and self.verdict.ok,
                                    merges=self.merges)
            elif grow_enabled() and name == "exposure_slots" and self.indexed:
                self._grown |= grow(c, name, self.store, self.run, self.boot, self.files,
                                    sql("exposure_runs_index"), sql("exposure_pairs_of"),
                                    disk=self.keep_answers and self.verdict.ok, merges=self.merges,
                                    view_sql=sql("exposure_slots_of_runs"))
            elif name == "exposure_slots" and self.indexed:     # the runs a table, their slots a view over it
                c.sql(sql("exposure_runs_index")).to_table("exposure_runs")
                c.execute(f"CREATE VIEW exposure_slots AS {sql('exposure_slots_of_runs')}")
            elif name == "exposure_ngrams":
                build_evidence(c, self.store, self.files["ngrams"], sql, disk=self.keep_answers,
                               merges=self.merges, cover=None if self.narrowed is None else self._requests_of)
            else:
                c.sql(self._text(name)).to_table(name)
                if name == "exposure_slots":        # the as-of join's slot rows
                    _runs_of_slots(c, "TABLE")
            self._made.add(name)

    def _say(self, text: str) -> None:
        if self.phase is not None:
            self.phase(text)

    def all_kept(self) -> bool:
        """Whether every shared table of this snapshot is kept in the state directory already:
        requests and exposure_slots grown (grown.py keeps them, with the segments they cover) and the
        n-gram evidence (evidence.py keeps its rows and last answer). An answers entry would copy
        them - seconds at 100 M+ rows, that a command's process waits for at its exit (364 M read rows:
        3.5 s) to save a later, different query on the same snapshot about 0.2 s - so none is written;
        the next process starts from those entries instead (the whole-store answers are kept either way)."""
        return "requests" in self._grown and "exposure_runs" in self._grown

    def evidence_pending(self) -> bool:
        """Whether this snapshot's n-gram evidence is still to be built from every ngrams segment: not
        made, no kept answers entry, no rows an earlier build kept (in this process or the state
        directory). Seconds at 100 M+ read rows, where all else a dashboard's banner needs takes a
        fraction of one."""
        if "exposure_ngrams" in self._made or (self.answers is not None and self.answers.path.is_file()):
            return False
        return not evidence_kept(self.store, disk=self.keep_answers)

    def early_pairs(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> pl.DataFrame | None:
        """The window's (response, donor) pairs with both tenants, blocked, nodes, first and last read -
        exposures' rows without the n-gram evidence (or the slot rows), from the exposure index
        (``early_pairs.sql``); None where the store has no index (the pairs are then the as-of join's)."""
        if not self.indexed:
            return None
        self._ensure("requests")
        return self._run(self.con, sql("early_pairs"), start, end, {})

    def verify_index(self) -> "IndexCheck":
        """The exposure index against the as-of join over the ledger, slot row for slot row."""
        return check_index(self.con)

    def _requests_of(self, incarnations: set[int]) -> None:
        """Add to the narrow table ``requests`` the rows of these incarnations it does not hold yet:
        requests.sql itself, on a cursor whose ``spans`` and ``arrivals`` are the store's rows of those
        incarnations only (temporary views over the store's, a semi join DuckDB pushes into the scan
        as a filter, as the n-gram evidence's lookups do: evidence._rows) - each request's row is
        made from its own incarnation's rows alone, so it is the whole table's row."""
        new = incarnations - self.narrowed
        if not new:
            return
        import pyarrow as pa
        cur = self.con.cursor()
        try:
            cur.register("_want", pa.table({"v": pa.array(sorted(new), pa.int64())}))
            (db,), = cur.sql("SELECT current_database()").fetchall()
            for table in ("spans", "arrivals"):     # (the temporary catalog has a schema main too)
                cur.execute(f'CREATE TEMP VIEW {table} AS SELECT * FROM "{db}".main.{table} SEMI JOIN _want ON incarnation = v')
            cur.execute(f"SET dynamic_or_filter_threshold = {min(max(len(new), 50), PUSHED)}")
            try:
                rows = cur.sql(self._text("requests")).to_arrow_table()
            finally:
                cur.execute("RESET dynamic_or_filter_threshold")
        finally:
            cur.close()
        self.con.register("_narrow", rows)
        try:
            self.con.execute("INSERT INTO requests SELECT * FROM _narrow")
        finally:
            self.con.unregister("_narrow")
        self.narrowed |= new

    def materialise(self, narrow: bool = False, evidence: bool = True) -> None:
        """Run the as-of join once for this snapshot of the store; every query then reads its result.
        requests and the as-of join do not depend on each other: they run side by side.

        ``narrow``: the queries asked read requests only through the exposure macros (exposures_in,
        scores_in...), which join it on a pair's response and donor, and the n-gram evidence, on the
        incarnations whose n-grams it counts: then, unless requests is kept, only those rows of it are
        made (``_requests_of``; at 121 M read rows 3,575 of 520 K requests, 0.07 s against 0.2-0.3 s
        and ~90 MB), and a later query that reads requests itself makes the whole table
        (``_ensure``). Only where the slot rows and the evidence are kept by grown.py and evidence.py
        (the default): no answers entry is written from a narrow table, and without them
        (KVLEDGER_GROW=0) that entry is what a next command reads back.

        ``evidence``: False stops before the n-gram evidence (requests, the slot rows and the pair
        macros only): what a query that reads none of it needs (EVIDENCE_READERS) - ``ttft`` at 121 M
        read rows then skips the ~1 s the evidence takes to build with nothing kept."""
        if not self._base_made:
            todo = [t for t in MATERIALISED if t not in self._made]
            if self.answers is not None and self.answers.load(self.con, todo):
                self.from_cache.update(todo)
                self._made.update(todo)
                if "exposure_slots" in todo:
                    _runs_of_slots(self.con, "VIEW")
            elif narrow and "requests" in todo and grow_enabled():
                self._say("building the exposure slots and the requests they name")
                self._ensure("exposure_slots", cached=False)
                self.narrowed = set()
                self.con.execute(f"CREATE TABLE requests AS SELECT * FROM ({self._text('requests')}) LIMIT 0")
                self._requests_of({i for (i,) in self.con.sql(
                    "SELECT response FROM exposure_runs UNION SELECT donor FROM exposure_runs WHERE donor <> -1"
                ).fetchall()})
            else:
                self._say("building requests and the exposure slots")
                with ThreadPoolExecutor(2) as pool:
                    for f in [pool.submit(self._ensure, t, self.con.cursor(), False) for t in MATERIALISED[:2]]:
                        f.result()
            for m in MACROS[:2]:
                self.con.execute(sql(m))
                if m == "exposure_pairs_of" and "exposure_pairs" not in self._grown:
                    # the whole store's pairs, computed where they are read (a grown snapshot keeps them)
                    self.con.execute(f"CREATE VIEW exposure_pairs AS SELECT * FROM exposure_pairs_of({WHOLE}, false)")
            self._base_made = True
        if not evidence:
            return
        if "exposure_ngrams" not in self._made:
            if evidence_kept(self.store, disk=self.keep_answers):
                self._say("building the n-gram evidence from the rows an earlier reader kept")
            else:
                self._say("building the n-gram evidence: every ngrams segment is read (nothing kept yet)")
            self._ensure(MATERIALISED[2], cached=False)
            if (self.answers is not None and self.narrowed is None and len(self.from_cache) < len(MATERIALISED)
                    and not self.all_kept()):
                self.answers.save_later(self.con)       # written while the query runs
        if not self._macros_made:
            for m in MACROS[2:]:
                self.con.execute(sql(m))
            self._macros_made = True

    def query(self, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None,
              **params) -> pl.DataFrame:
        return self.queries([name], start, end, workers=1, **params)[name]

    def _kept(self, name: str, text: str, start, end, params: dict) -> pl.DataFrame | None:
        """A whole-store answer kept for this snapshot (answers.py), or None."""
        if self.answers is None or start is not None or end is not None:
            return None
        return self.answers.result(name, text, params)

    @staticmethod
    def _run(con, text: str, start, end, params: dict) -> pl.DataFrame:
        values = {**DEFAULTS, **params, "from": start or EPOCH, "to": end or FAR}
        return con.sql(text, params={k: v for k, v in values.items() if f"${k}" in text}).pl()

    def queries(self, names: list[str], start: dt.datetime | None = None, end: dt.datetime | None = None,
                workers: int = 3, unordered: tuple[str, ...] = (), **params) -> dict[str, pl.DataFrame]:
        """Several named queries over this snapshot at once, each on its own cursor (same database,
        same snapshot): what a dashboard page needs, in the time of the slowest few instead of the sum.
        A whole-store answer kept for this snapshot is read back instead of run (answers.py).
        ``unordered``: these without their closing ORDER BY (``base.without_order``)."""
        texts = {n: without_order(sql(n)) if n in unordered else sql(n) for n in names}
        out = {n: df for n, t in texts.items() if (df := self._kept(n, t, start, end, params)) is not None}
        todo = {n: t for n, t in texts.items() if n not in out}
        reads_requests = any(READS_REQUESTS.search(COMMENT.sub("", t)) for t in todo.values())
        evidence = {n for n, t in todo.items() if EVIDENCE_READERS.search(COMMENT.sub("", t))}
        if any(m in t for t in todo.values() for m in MATERIALISED[1:] + MACROS):
            self.materialise(narrow=not reads_requests, evidence=False)
        if reads_requests:
            self._ensure("requests")
        # where the n-gram evidence is still to be built, the queries that read none of it run while it
        # is (on cursors of their own) - unless requests is the narrow table, which the build adds rows to
        meanwhile = len(todo) > 1 and bool(evidence) and self.narrowed is None and "exposure_ngrams" not in self._made
        if evidence and not meanwhile:
            self.materialise(narrow=not reads_requests)
        if len(todo) == 1:
            (n, t), = todo.items()
            out[n] = self._run(self.con, t, start, end, params)
        elif todo:
            with ThreadPoolExecutor(workers) as pool:
                futs = {n: pool.submit(self._run, self.con.cursor(), t, start, end, params)
                        for n, t in todo.items() if not (meanwhile and n in evidence)}
                if meanwhile:
                    self.materialise(narrow=not reads_requests)     # the evidence, on this connection
                    futs |= {n: pool.submit(self._run, self.con.cursor(), todo[n], start, end, params) for n in evidence}
                out |= {n: f.result() for n, f in futs.items()}
        if self.answers is not None and start is None and end is None:
            for n in todo:
                self.answers.keep_result(n, todo[n], params, out[n])
        return {n: with_response_state(out[n], self.live) for n in names}

    @property
    def unverified_note(self) -> str | None:
        return unverified_note(self.verdict, self.left_out)

    def exposure_slots(self) -> pl.DataFrame:
        self.materialise()
        return self.con.table("exposure_slots").pl()

    def exposures(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> pl.DataFrame:
        return self.query("exposures", start, end)

    def requests(self) -> pl.DataFrame:
        self._ensure("requests")
        return self.con.table("requests").pl()

    def request_count(self) -> int:
        if self.narrowed is not None:       # requests.sql's rows: one an incarnation of a request span or an arrival
            return self.con.sql("SELECT count(*) FROM (SELECT incarnation FROM spans WHERE operation = 'request' AND "
                                "incarnation IS NOT NULL UNION SELECT incarnation FROM arrivals)").fetchall()[0][0]
        self._ensure("requests")
        return self.con.table("requests").count("*").fetchall()[0][0]

    def foreign_requests(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> bool:
        return bool(self._run(self.con, sql("fleet_present"), start, end, {})["present"][0])

    def tenant_names(self) -> list[str]:
        self._ensure("requests")
        return [t for (t,) in self.con.sql("SELECT DISTINCT tenant_h FROM requests WHERE tenant_h IS NOT NULL "
                                           "ORDER BY tenant_h").fetchall()]

    def page_ledgers(self) -> pl.DataFrame:
        """Per run (boot), oldest first: whether it recorded a page ledger (``runs``' page_ledger
        column alone: page_ledgers.sql - no requests or slot rows made for it)."""
        return self.con.sql("SELECT boot, page_ledger FROM page_ledgers ORDER BY started_at, boot").pl()

    def rows(self, table: str) -> int:
        """Rows of one store table in this snapshot (e.g. whether the store has a page ledger at all)."""
        return self.con.table(table).count("*").fetchall()[0][0]

    def close(self) -> None:
        if self.answers is not None:
            self.answers.wait()             # the entry being written reads this connection's tables
        self.con.close()
