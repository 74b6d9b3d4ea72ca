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
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import duckdb
import polars as pl

from forensics.queries.base import with_response_state
from telemetry.store import StoreError, has_live_writer, open_store, verify
from telemetry.store.chain import HashCache, damaged_segments

SQL_DIR = Path(__file__).parent.parent / "sql"     # forensics/sql: the named queries
# tables the queries build on, materialised once per connection (a snapshot of the store) on first
# use: requests (one row per request, from its spans), exposure_slots (the as-of join) and
# exposure_ngrams (what of each donor's prompt each response's output repeats); the macros over
# them are created then
MATERIALISED = ["requests", "exposure_slots", "exposure_ngrams"]
MACROS = ["exposures_in", "scores_in"]
from forensics.queries.catalog import LEDGER_QUERIES as QUERIES  # noqa: E402,F401  (the ledger's own names)

EPOCH = dt.datetime(1970, 1, 1)
FAR = dt.datetime(2262, 1, 1)       # TIMESTAMP_NS ends in April 2262
DEFAULTS = {"bucket_s": 60, "min_tokens": 32, "slack": 0.5, "boundary": 0.02, "min_probes": 3, "share": 0.2}


@cache
def sql(name: str) -> str:
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


class Forensics:
    engine = "duckdb"
    source = "the local store"

    def __init__(self, store: str | Path, run: str | None = None, *, allow_unverified: bool = False,
                 anchor: str | Path | None = None, cache: dict | None = None):
        """Verify the store first (its signed chain, and its anchor when one is found) and refuse a
        store that does not verify, unless ``allow_unverified`` - then ``self.verdict`` says so and
        every output must (``unverified_note``). ``cache``: a long-lived reader's verification
        cache, so a growing store is verified incrementally."""
        self.store, self.run = Path(store), run
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
        self.con = open_store(self.store, run, skip=set(self.left_out))
        self.live = has_live_writer(self.store)     # a response with no end is "in flight", else "cut off"
        self._made: set[str] = set()

    def _ensure(self, name: str, con: "duckdb.DuckDBPyConnection | None" = None) -> None:
        if name not in self._made:
            (con or self.con).sql(sql(name)).to_table(name)
            self._made.add(name)

    def materialise(self) -> None:
        """Run the as-of join once for this snapshot of the store; every query then reads its result.
        requests and the as-of join do not depend on each other: they run side by side."""
        if "exposure_ngrams" not in self._made:
            with ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(self._ensure, t, self.con.cursor()) for t in MATERIALISED[:2]]:
                    f.result()
            self._ensure(MATERIALISED[2])
            for m in MACROS:
                self.con.execute(sql(m))

    def query(self, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None,
              **params) -> pl.DataFrame:
        text = sql(name)
        if any(m in text for m in MATERIALISED[1:] + MACROS):
            self.materialise()
        elif "requests" in text:
            self._ensure("requests")
        return with_response_state(self._run(self.con, text, start, end, params), self.live)

    @staticmethod
    def _run(con, text: str, start, end, params: dict) -> pl.DataFrame:
        values = {**DEFAULTS, **params, "from": start or EPOCH, "to": end or FAR}
        return con.sql(text, params={k: v for k, v in values.items() if f"${k}" in text}).pl()

    def queries(self, names: list[str], start: dt.datetime | None = None, end: dt.datetime | None = None,
                workers: int = 3, **params) -> dict[str, pl.DataFrame]:
        """Several named queries over this snapshot at once, each on its own cursor (same database,
        same snapshot): what a dashboard page needs, in the time of the slowest few instead of the sum."""
        texts = {n: sql(n) for n in names}
        if any(m in t for t in texts.values() for m in MATERIALISED[1:] + MACROS):
            self.materialise()
        elif any("requests" in t for t in texts.values()):
            self._ensure("requests")
        with ThreadPoolExecutor(workers) as pool:
            futs = {n: pool.submit(self._run, self.con.cursor(), t, start, end, params) for n, t in texts.items()}
            return {n: with_response_state(f.result(), self.live) for n, f in futs.items()}

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

    def rows(self, table: str) -> int:
        """Rows of one store table in this snapshot (e.g. whether the store has a page ledger at all)."""
        return self.con.table(table).count("*").fetchall()[0][0]

    def close(self) -> None:
        self.con.close()
