"""``ForensicsBackend``: what every engine that answers the named queries offers (DuckDB over the
local store: ``duckdb.Forensics``; embedded or server ClickHouse: ``clickhouse.ClickHouseForensics``).
The CLI, the report and the dashboard hold one of these and never ask which it is; the tests hold
the two to the same rows (tests/test_clickhouse.py)."""
from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import polars as pl

    from telemetry.store import Verdict


CLICKHOUSE_ONLY = ("chdb_path", "spans_table", "tenant_attribute", "progress")   # options DuckDB has no use for


class ForensicsBackend(Protocol):
    engine: str                     # "duckdb" | "chdb" | "clickhouse"
    source: str                     # where it reads, for the reader ("the local store", a DSN)
    verdict: "Verdict"              # the store's verification, done before the first answer
    phase: "Callable[[str], None] | None"   # told, when set, what is being built (a command's status line)

    def query(self, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None,
              **params) -> "pl.DataFrame":
        """One named query of the catalogue (``catalog.QUERIES``) over the window [start, end]."""

    def queries(self, names: list[str], start: dt.datetime | None = None, end: dt.datetime | None = None,
                workers: int = 1, unordered: "tuple[str, ...]" = (), **params) -> "dict[str, pl.DataFrame]":
        """Several named queries over one snapshot; those named in ``unordered`` without their
        closing ORDER BY (``without_order``: the same rows, in no set order - for a caller that
        orders only what it shows)."""

    def materialise(self) -> None:
        """Build the tables the queries share (requests, the as-of join, n-gram evidence) now."""

    @property
    def unverified_note(self) -> str | None:
        """What every output must say when the store did not verify (None when it did)."""

    def evidence_pending(self) -> bool:
        """Whether the n-gram evidence of this snapshot is still to be built from scratch (seconds at
        100 M+ rows): a dashboard then draws its banner from ``early_pairs`` first."""

    def early_pairs(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> "pl.DataFrame | None":
        """exposures' pairs (both tenants, blocked, nodes, first and last read) without the n-gram
        evidence, read before it is built; None where the engine cannot (the banner waits for exposures)."""

    def exposure_slots(self) -> "pl.DataFrame":
        """One row per failing slot read, with its donor (the as-of join: the ground truth)."""

    def exposures(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> "pl.DataFrame":
        """One row per (response, donor incarnation)."""

    def requests(self) -> "pl.DataFrame":
        """One row per request, from its spans."""

    def request_count(self) -> int:
        """How many requests ``requests()`` holds (without moving them out of the engine)."""

    def tenant_names(self) -> list[str]:
        """The tenant pseudonyms ``requests()`` names, each once, sorted (without moving the requests
        out of the engine: a dashboard's tenant picker on every refresh)."""

    def foreign_requests(self, start: dt.datetime | None = None, end: dt.datetime | None = None) -> bool:
        """Whether the window holds any foreign request span (``fleet_present.sql``: the rows the fleet
        twins of ttft, impact and tenants answer from), without running either twin."""

    def page_ledgers(self) -> "pl.DataFrame":
        """Per run (boot), oldest first: whether it recorded a page ledger (``runs``' page_ledger)."""

    def rows(self, table: str) -> int:
        """Rows of a store table in this snapshot."""

    def close(self) -> None: ...


def without_order(text: str) -> str:
    """A named query's text without its closing ORDER BY - a last line that starts with one at the
    margin (the query's own; one inside a subquery or window is indented) - or the text as it is.
    The same rows in no set order: sorting the dashboard's TTFT and transfer rows (391 K each at
    121 M read rows) was about half of each query's time, for a page that draws a sample of one
    and shows 100 rows of the other."""
    lines = text.rstrip().split("\n")
    return "\n".join(lines[:-1]) + "\n" if lines[-1].startswith("ORDER BY ") else text


def with_response_state(df: "pl.DataFrame", live: bool | None) -> "pl.DataFrame":
    """Name each response whose end is not in the store: ``in flight`` while the store has a live
    writer, ``cut off`` once it has none (a crash, or a writer that closed before the response
    ended), ``unfinished`` where the store is not at hand (a ClickHouse server); else ``finished``."""
    if "response_finished" not in df.columns:
        return df
    import polars as pl
    pending = "unfinished" if live is None else "in flight" if live else "cut off"
    return df.with_columns(pl.when(pl.col("response_finished")).then(pl.lit("finished"))
                           .otherwise(pl.lit(pending)).alias("response_state"))
