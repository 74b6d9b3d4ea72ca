"""kvledger telemetry: the engine's recorder, OpenTelemetry spans and metrics, the page ledger, the
store, receivers for foreign fleets, and the ClickHouse export.

Where things are:
- ``telemetry/recorder.py``  ``Telemetry``: the engine's recorder (``recording()``: its factory)
- ``telemetry/otel.py``      OpenTelemetry providers, exporters into the store, GenAI buckets
- ``telemetry/ledger.py``    page writes/reads, transfers, releases from the engine's step tensors
- ``telemetry/store/``       schema, keys, chain, columns, writer, reader (``open_store``, ``verify``)
- ``telemetry/receivers/``   OTLP, KV events, logs from vLLM/SGLang fleets (``kvledger collect``)
- ``telemetry/clickhouse/`` DDL from the schema (``ddl``), targets (``targets``), the idempotent export
- ``telemetry/commands/``    ``collect``, ``ingest-logs``, ``verify``, ``export``
"""
from telemetry.store import open_store, verify  # noqa: F401


def __getattr__(name: str):
    # Telemetry (the engine's recorder) pulls in the engine and torch; readers of a store
    # (forensics, the dashboard) do not need either, so it is imported on first use
    if name in ("Telemetry", "recording"):
        from telemetry import recorder
        return getattr(recorder, name)
    raise AttributeError(f"module 'telemetry' has no attribute {name!r}")
