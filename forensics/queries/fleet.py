"""The foreign fleet's views under the page ledger's names.

``ttft``, ``impact`` and ``tenants`` read kvledger's own requests and page ledger; a store filled
by ``kvledger collect`` holds only a foreign engine's request spans, whose twins are
``fleet_ttft``, ``fleet_impact`` and ``fleet_tenants``. ``folded`` answers a name from either:
``source="ledger"`` or ``"spans"`` picks one; ``"auto"`` gives the ledger's answer when the store
has kvledger requests and the fleet's otherwise, with a note saying which it gave and what the
other holds, so that a store of foreign telemetry is never answered with an empty table.
"""
from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

from forensics.queries.catalog import FOLDED, SOURCES  # noqa: F401


def fleet_requests(ttft: pl.DataFrame, impact: pl.DataFrame) -> pl.DataFrame:
    """Every foreign request span (fleet_ttft's rows) with ``over_pool`` from fleet_impact."""
    import polars as pl
    return ttft.with_columns(over_pool=pl.col("request_id").is_in(impact["request_id"].to_list()))


def fleet_tenants(ttft: pl.DataFrame, impact: pl.DataFrame) -> pl.DataFrame:
    """Per tenant of the foreign fleet: instances, requests, and how many were answered under the
    TTFT floor of their length or billed over their instance's pool - the incident's two signals
    at tenant level, as ``tenants`` is for the page ledger (and the fast answers a prefix-cache hit
    could explain, counted apart)."""
    import polars as pl
    counts = {"instances": pl.UInt32, "requests": pl.UInt32, "below_floor": pl.UInt32, "over_pool": pl.UInt32,
              "cache_hit_possible": pl.UInt32}
    r = fleet_requests(ttft, impact)
    if r.is_empty():
        return pl.DataFrame(schema={"tenant_h": pl.String, **counts})
    return (r.group_by("tenant_h").agg(instances=pl.col("instance").n_unique(), requests=pl.len(),
                                       below_floor=pl.col("below_floor").sum(), over_pool=pl.col("over_pool").sum(),
                                       cache_hit_possible=pl.col("cache_hit_possible").sum())
            .cast(counts)
            .sort(["over_pool", "below_floor", "tenant_h"], descending=[True, True, False], nulls_last=True))


def query(fx, name: str, start: dt.datetime | None = None, end: dt.datetime | None = None, **params) -> pl.DataFrame:
    """A named query, ``fleet_tenants`` included (computed from its two fleet queries)."""
    if name == "fleet_tenants":
        q = fx.queries(["fleet_ttft", "fleet_impact"], start, end, **params)
        return fleet_tenants(q["fleet_ttft"], q["fleet_impact"])
    return fx.query(name, start, end, **params)


def folded(fx, name: str, source: str = "auto", start: dt.datetime | None = None, end: dt.datetime | None = None,
           **params) -> tuple[pl.DataFrame, str, str | None]:
    """(rows, the query that answered, a note for the reader or None)."""
    if name not in FOLDED or source == "ledger":
        return query(fx, name, start, end, **params), name, None
    twin = FOLDED[name]
    if source == "spans":
        return query(fx, twin, start, end, **params), twin, None
    own = query(fx, name, start, end, **params)
    if fx.request_count():
        if not fx.foreign_requests(start, end):     # (the twin's rows are foreign request spans: none)
            return own, name, None
        foreign = query(fx, twin, start, end, **params)
        note = (f"this store also holds a foreign fleet's request spans: `--source spans` shows them ({twin}, "
                f"{foreign.height} row(s))") if foreign.height else None
        return own, name, note
    fleet = query(fx, twin, start, end, **params)
    if fleet.height:
        return fleet, twin, (f"no kvledger requests in this store: {name} answers from the foreign fleet's request "
                             f"spans ({twin}); `--source ledger` for the page ledger's view")
    return own, name, None
