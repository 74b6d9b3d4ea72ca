"""kvledger telemetry: OpenTelemetry spans and metrics, the page ledger, and the segment store.

Where things are:
- ``telemetry/schema.sql``  every table of the store (the one source of truth)
- ``telemetry/ledger.py``   page writes/reads, transfers, releases from the engine's step tensors
- ``telemetry/otel.py``     ``Telemetry``: the engine's recorder; spans, metrics, config snapshots
- ``telemetry/store.py``    chained Parquet segments, ``open_store`` (DuckDB), ``verify``
"""
from telemetry.otel import Telemetry  # noqa: F401
from telemetry.store import open_store, verify  # noqa: F401
