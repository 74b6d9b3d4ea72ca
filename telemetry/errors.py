"""Errors the telemetry layer raises (under ``KvledgerError``, the one root)."""
from engine.errors import KvledgerError


class StoreError(KvledgerError):
    """A store that cannot be written or read as asked: missing, damaged, locked, not verifying."""
