"""Which SQL engine answers (``--engine duckdb|chdb|clickhouse``, ``--dsn``, ``--chdb-path``,
``--spans-table``): the options every reader of a store shares, and the frozen selection they make."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from engine.errors import InputError

ENGINES = ["duckdb", "chdb", "clickhouse"]


@dataclass(frozen=True, slots=True)
class EngineChoice:
    engine: str = "duckdb"
    dsn: str | None = None
    chdb_path: str | None = None
    spans_table: str | None = None
    tenant_attribute: str = "tenant.id"

    def kwargs(self, spans: bool = False) -> dict:
        """The keyword arguments ``open_forensics`` takes for this choice."""
        kw: dict = {"engine": self.engine}
        if self.engine == "clickhouse":
            kw["dsn"] = self.dsn
        if self.engine == "chdb" and self.chdb_path:
            kw["chdb_path"] = self.chdb_path
        if spans and self.engine != "duckdb":
            kw["spans_table"], kw["tenant_attribute"] = self.spans_table, self.tenant_attribute
        return kw


def add_verify_options(p: argparse.ArgumentParser, allow_help: str) -> None:
    """--allow-unverified and --anchor: how a reader treats a store that does not verify."""
    p.add_argument("--allow-unverified", action="store_true", help=allow_help)
    p.add_argument("--anchor", default=None, metavar="PATH", help="the anchor to verify against (see kvledger verify)")


def add_engine_options(p: argparse.ArgumentParser, spans: bool = False) -> None:
    """--engine, --dsn, --chdb-path (and --spans-table, --tenant-attribute): which SQL engine answers."""
    p.add_argument("--engine", choices=ENGINES, default="duckdb",
                   help="SQL engine: duckdb over the local store (default); chdb: embedded ClickHouse over the local "
                        "store (nothing to start); clickhouse: a server `kvledger export` filled (--dsn)")
    p.add_argument("--dsn", default=None, metavar="URL",
                   help="--engine clickhouse: clickhouse://[USER[:PASSWORD]@]HOST[:8123]/DATABASE (clickhouses:// "
                        "for HTTPS)")
    p.add_argument("--chdb-path", default=None, metavar="DIR",
                   help="--engine chdb: where embedded ClickHouse keeps its copy of the store (default "
                        "$KVLEDGER_CHDB_PATH or ~/.cache/kvledger/chdb)")
    if spans:
        p.add_argument("--spans-table", default=None, metavar="[DB.]TABLE",
                       help="ClickHouse engines: read spans from an OpenTelemetry Collector `otel_traces` table in "
                            "place (TTFT, usage honesty, impact, fleet queries)")
        p.add_argument("--tenant-attribute", default="tenant.id",
                       help="--spans-table: the span or resource attribute naming the tenant (default tenant.id)")


def engine_choice(a) -> EngineChoice:
    """The engine options, checked against each other before anything is opened."""
    c = EngineChoice(a.engine, getattr(a, "dsn", None), getattr(a, "chdb_path", None),
                     getattr(a, "spans_table", None), getattr(a, "tenant_attribute", "tenant.id"))
    if c.engine == "clickhouse" and not c.dsn:
        raise InputError("--engine clickhouse needs --dsn clickhouse://HOST:8123/DATABASE (the server `kvledger "
                         "export` fills)")
    if c.dsn and c.engine != "clickhouse":
        raise InputError(f"--dsn is for --engine clickhouse (got --engine {c.engine})")
    if c.spans_table and c.engine == "duckdb":
        raise InputError("--spans-table reads a ClickHouse table: use it with --engine chdb or --engine clickhouse")
    if c.spans_table and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", c.spans_table):
        raise InputError(f"--spans-table {c.spans_table!r}: expected TABLE or DATABASE.TABLE (letters, digits, _)")
    if c.chdb_path and c.engine != "chdb":
        raise InputError(f"--chdb-path is for --engine chdb (got --engine {c.engine})")
    return c
