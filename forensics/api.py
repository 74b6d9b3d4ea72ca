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
from functools import cache
from pathlib import Path

import polars as pl

from telemetry.store import open_store

SQL_DIR = Path(__file__).with_name("sql")
# views the queries build on; exposure_slots (the as-of join) is materialised once per connection,
# on first use, and the macros over it are created then
VIEWS = ["requests"]
MATERIALISED = ["exposure_slots"]
MACROS = ["exposures_in", "scores_in"]
QUERIES = ["exposures", "scores", "tenant_scores", "tenants", "ttft", "transfers", "preflight", "impact", "exploitation", "guards",
           "releases"]
EPOCH = dt.datetime(1970, 1, 1)
FAR = dt.datetime(2262, 1, 1)       # TIMESTAMP_NS ends in April 2262
DEFAULTS = {"bucket_s": 60, "min_tokens": 32, "slack": 0.5, "boundary": 0.02, "min_probes": 3, "share": 0.2}


@cache
def sql(name: str) -> str:
    path = SQL_DIR / f"{name}.sql"
    if not path.exists():
        raise KeyError(f"no query named {name!r} in {SQL_DIR}")
    return path.read_text()


def query_hashes() -> dict[str, str]:
    """SHA-256 of every SQL file (report provenance: which queries produced the numbers)."""
    return {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(SQL_DIR.glob("*.sql"))}


class Forensics:
    def __init__(self, store: str | Path):
        self.store = Path(store)
        self.con = open_store(self.store)
        for v in VIEWS:
            self.con.sql(sql(v)).create_view(v)
        self._materialised = False

    def materialise(self) -> None:
        """Run the as-of join once for this snapshot of the store; every query then reads its result."""
        if not self._materialised:
            for t in MATERIALISED:
                self.con.sql(sql(t)).to_table(t)
            for m in MACROS:
                self.con.execute(sql(m))
            self._materialised = True

    def query(self, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None,
              **params) -> pl.DataFrame:
        text = sql(name)
        if any(name in text for name in MATERIALISED + MACROS):
            self.materialise()
        values = {**DEFAULTS, **params, "from": start or EPOCH, "to": end or FAR}
        return self.con.sql(text, params={k: v for k, v in values.items() if f"${k}" in text}).pl()

    def exposure_slots(self) -> pl.DataFrame:
        self.materialise()
        return self.con.table("exposure_slots").pl()

    def exposures(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> pl.DataFrame:
        return self.query("exposures", start, end)

    def requests(self) -> pl.DataFrame:
        return self.con.table("requests").pl()

    def close(self) -> None:
        self.con.close()
