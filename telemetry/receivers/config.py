"""``CollectConfig``: what ``kvledger collect`` receives and where it writes, typed and frozen (the
Collector's ``config.go``); and ``KVSource``, one KV event publisher as ``--kv-events`` names it."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InputError


@dataclass(frozen=True, slots=True)
class KVSource:
    endpoint: str
    replay: str | None = None
    name: str | None = None
    topic: str = ""


def parse_kv_source(text: str) -> KVSource:
    """``ENDPOINT[,replay=URL][,name=NAME][,topic=TOPIC]``, e.g. ``tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558``."""
    parts = [p.strip() for p in text.split(",")]
    endpoint, opts = parts[0], {}
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise InputError(f"--kv-events {text!r}: the endpoint must be a ZMQ address such as tcp://host:5557")
    for p in parts[1:]:
        key, eq, value = p.partition("=")
        if not eq or key not in ("replay", "name", "topic") or not value:
            raise InputError(f"--kv-events {text!r}: options are replay=URL, name=NAME, topic=TOPIC; got {p!r}")
        opts[key] = value
    return KVSource(endpoint, opts.get("replay"), opts.get("name"), opts.get("topic", ""))


@dataclass(frozen=True, slots=True)
class CollectConfig:
    store: str = "kvledger-store"
    otlp_host: str = "127.0.0.1"
    otlp_port: int = 4318
    kv_sources: tuple[KVSource, ...] = ()
    tenant_attribute: str = "tenant.id"
    tenant_header: str | None = None
    decode_workers: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.otlp_port <= 65535:
            raise InputError(f"--otlp-port must be in [0, 65535], got {self.otlp_port}")
        if not 0 <= self.decode_workers <= 64:
            raise InputError(f"--decode-workers must be in [0, 64], got {self.decode_workers}")
