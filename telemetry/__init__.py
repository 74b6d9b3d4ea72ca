"""kvledger telemetry: OpenTelemetry spans and metrics, the page ledger, and the segment store.

Where things are:
- ``telemetry/schema.sql``  every table of the store (the one source of truth)
- ``telemetry/ledger.py``   page writes/reads, transfers, releases from the engine's step tensors
- ``telemetry/otel.py``     ``Telemetry``: the engine's recorder; spans, metrics, config snapshots
- ``telemetry/store.py``    chained Parquet segments, ``open_store`` (DuckDB), ``verify``
"""
from telemetry.store import open_store, verify  # noqa: F401


def __getattr__(name: str):
    # Telemetry (the engine's recorder) pulls in the engine and torch; readers of a store
    # (forensics, the dashboard) do not need either, so it is imported on first use
    if name == "Telemetry":
        from telemetry.otel import Telemetry
        return Telemetry
    raise AttributeError(f"module 'telemetry' has no attribute {name!r}")
