"""What the report says is computed from: every named query the report needs, run once over the
window, and the splits every section uses (exposed vs blocked, another customer's KV vs the
tenant's own, surfaced cross-tenant vs own). The sections never query the store themselves."""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

import polars as pl

from forensics.output import json_rows
from forensics.queries.coverage import Coverage, coverage

QUERIES = ("runs", "exposures", "scores", "tenants", "preflight", "guards", "impact", "ttft", "transfers", "releases",
           "probes", "fleet_impact", "fleet_ttft", "canary", "cache_scopes", "gaps")
UNWINDOWED = {"runs", "preflight", "guards", "probes", "canary", "cache_scopes", "gaps"}


def rows(df: pl.DataFrame) -> list[dict]:
    """A frame as JSON-ready rows (ids as strings, times as ISO 8601 with Z)."""
    return json.loads(json_rows(df))


@dataclass(frozen=True)
class Evidence:
    q: dict[str, pl.DataFrame]          # query name -> rows over the window
    requests: pl.DataFrame
    coverage: Coverage
    start: dt.datetime | None
    end: dt.datetime | None

    def __getitem__(self, name: str) -> pl.DataFrame:
        return self.q[name]

    # ---- the splits -------------------------------------------------------------------------
    @property
    def exposed(self) -> pl.DataFrame:
        """(response, donor) rows that are exposures: blocked reads returned nothing computed from them."""
        return self.q["exposures"].filter(pl.col("evidence") != "blocked")

    @property
    def blocked(self) -> pl.DataFrame:
        return self.q["exposures"].filter(pl.col("evidence") == "blocked")

    @property
    def real(self) -> pl.DataFrame:
        """Exposures of KV some request wrote (unwritten slots carry nobody's data)."""
        return self.exposed.filter(pl.col("donor") != -1)

    @property
    def cross(self) -> pl.DataFrame:
        """Another customer's KV."""
        return self.real.filter(~pl.col("same_tenant"))

    @property
    def own(self) -> pl.DataFrame:
        """The tenant's own other requests' KV."""
        return self.real.filter(pl.col("same_tenant"))

    def responses(self, df: pl.DataFrame) -> set[int]:
        return set(df["response"].to_list())

    @property
    def own_only(self) -> set[int]:
        return self.responses(self.own) - self.responses(self.cross)

    @property
    def surfaced_cross(self) -> set[int]:
        """Responses whose output repeats another customer's text."""
        return self.responses(self.cross.filter(pl.col("evidence") == "surfaced"))

    @property
    def surfaced_own(self) -> set[int]:
        """Responses whose output repeats only the tenant's own other requests' text."""
        return self.responses(self.own.filter(pl.col("evidence") == "surfaced")) - self.surfaced_cross

    @property
    def any_exposure(self) -> bool:
        return self.exposed.height > 0

    @property
    def first_read(self):
        return self.exposed["first_read"].min() if self.exposed.height else None

    @property
    def last_read(self):
        return self.exposed["last_read"].max() if self.exposed.height else None

    def scopes(self, ids) -> int:
        """Distinct cache scopes (customer accounts) of these request incarnations."""
        ids = list(ids)
        if not ids:
            return 0
        return self.requests.filter(pl.col("incarnation").is_in(ids))["scope_h"].drop_nulls().n_unique()

    def blocked_output_tokens(self) -> tuple[int, int] | None:
        """The fewest and most tokens a blocked response had returned before the read check stopped it."""
        ids = list(self.responses(self.blocked))
        toks = self.requests.filter(pl.col("incarnation").is_in(ids))["output_tokens"].drop_nulls()
        return (int(toks.min()), int(toks.max())) if toks.len() else None


def gather(fx, start: dt.datetime | None, end: dt.datetime | None) -> Evidence:
    windowed = [n for n in QUERIES if n not in UNWINDOWED]
    q = fx.queries(windowed, start, end)
    q.update({n: fx.query(n) for n in UNWINDOWED})
    return Evidence(q, fx.requests(), coverage(q["runs"]), start, end)
