"""Start Streamlit on the dashboard with its libraries already imported.

Streamlit runs the app script inside the server process, on the first page load; importing
polars, DuckDB and the forensic layer there, and DuckDB's first Parquet read in a process, cost
about a second on this machine. ``kvledger dashboard`` runs ``python -m dashboard.serve APP
[streamlit options]``, which does both while the server starts, so the first page load does not
pay for them. It also verifies the store once (every segment hashed) into the dashboard's
verification cache, so the first page load only checks what was written since.
"""
from __future__ import annotations

import importlib
import sys

# (pandas' Styler: the tables' red rows, ~0.03 s; the ClickHouse backend's errors, which every page
# load's opening names: ~0.025 s - each on the first page load otherwise)
PRELOAD = ("polars", "dashboard.data", "pandas.io.formats.style", "forensics.queries.clickhouse")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    import tempfile
    from pathlib import Path

    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    from telemetry.store.schema import arrow_schemas
    arrow_schemas()
    with tempfile.TemporaryDirectory() as d:      # DuckDB's first Parquet read sets up its reader
        pq.write_table(pa.table({"x": [1]}), Path(d) / "warm.parquet")
        duckdb.connect().read_parquet([str(Path(d) / "warm.parquet")], union_by_name=True).fetchall()
    import os

    from dashboard.data import verified
    from telemetry.store import verify
    store = os.environ.get("KVLEDGER_STORE")
    if store and (Path(store) / "chain").is_dir():  # hash the store's segments now, not on the first page load
        cache = verified(store)
        verify(store, cache=cache)
        cache.save()


def main(argv: list[str]) -> None:
    preload()
    from streamlit.web import cli
    sys.argv = ["streamlit", "run", *argv]
    sys.exit(cli.main())


if __name__ == "__main__":
    main(sys.argv[1:])
