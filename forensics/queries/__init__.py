"""The named forensic queries and the engines that answer them.

- ``catalog.py``    the one query catalogue: every name, what it answers, which fold to the fleet view
- ``base.py``       ``ForensicsBackend``: what every engine offers (the Protocol both implement)
- ``duckdb.py``     ``Forensics``: DuckDB over the local store (``forensics/sql/*.sql``)
- ``clickhouse.py`` ``ClickHouseForensics``: chdb or a ClickHouse server (``forensics/sql/clickhouse``)
- ``fleet.py``      the ledger/spans fold (``--source``)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forensics.queries.base import ForensicsBackend


def open_forensics(store, run=None, *, engine: str = "duckdb", dsn: str | None = None, **kw) -> "ForensicsBackend":
    """The backend for ``engine`` (duckdb, chdb, clickhouse), the store verified first. DuckDB over
    the local store does not import the ClickHouse client at all (a reader's start)."""
    if engine == "duckdb" and not dsn:
        from forensics.queries.base import CLICKHOUSE_ONLY
        from forensics.queries.duckdb import Forensics
        return Forensics(store, run, **{k: v for k, v in kw.items() if k not in CLICKHOUSE_ONLY})
    from forensics.queries.clickhouse import open_forensics as open_
    return open_(store, run, engine=engine, dsn=dsn, **kw)
