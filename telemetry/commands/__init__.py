"""Telemetry's commands: ``collect``, ``ingest-logs`` (a foreign fleet into the store), ``verify``
(the signed chain), ``export`` (the store into ClickHouse). Registered in ``engine/commands/main.py``."""
