"""``CollectConfig``: what ``kvledger collect`` receives and where it writes, typed and frozen (the
Collector's ``config.go``); ``KVSource``, one KV event publisher as ``--kv-events`` names it; and
``ScrapeTarget``, one engine ``/metrics`` endpoint as ``--scrape`` names it.

Which side binds (ZMQ lets either; exactly one must). vLLM's and SGLang's ``ZmqEventPublisher``
bind their PUB socket for a wildcard host (``tcp://*:N``, ``tcp://0.0.0.0:N``, ``tcp://[::]:N``),
``ipc://`` and ``inproc://``, and connect for a concrete host (``tcp://10.0.0.5:5557``). So:

    engine endpoint         the engine      kvledger collect --kv-events
    tcp://*:5557 (default)  binds           tcp://ENGINE-HOST:5557          (connects)
    ipc:///run/kv.sock      binds           ipc:///run/kv.sock              (connects)
    tcp://COLLECT-HOST:5557 connects        tcp://COLLECT-HOST:5557,bind    (or tcp://*:5557, which binds)

A wildcard host can only be bound, so collect binds it without being told; ``,bind`` and
``,connect`` override. The replay socket (ROUTER) is always bound by the engine: collect connects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.errors import InputError

WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
SCRAPE_MIN_INTERVAL, SCRAPE_MAX_INTERVAL = 0.2, 3600.0


@dataclass(frozen=True, slots=True)
class KVSource:
    endpoint: str
    replay: str | None = None
    name: str | None = None
    topic: str = ""
    bind: bool = False


def _zmq_address(text: str, what: str, *, bindable: bool) -> None:
    """A ZMQ address collect can use: tcp://HOST:PORT (PORT 1..65535), ipc://PATH or inproc://NAME."""
    if text.startswith(("ipc://", "inproc://")):
        if len(text.split("://", 1)[1]) == 0:
            raise InputError(f"{what} {text!r}: the address names no path")
        return
    m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):([0-9]{1,5})", text)
    if not m:
        raise InputError(f"{what} {text!r}: a ZMQ address is tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if not 1 <= int(m.group(2)) <= 65535:
        raise InputError(f"{what} {text!r}: the port must be in [1, 65535]")
    if not bindable and m.group(1) in WILDCARD_HOSTS:
        raise InputError(f"{what} {text!r}: a wildcard host can only be bound; name the engine's host")


def parse_kv_source(text: str) -> KVSource:
    """``ENDPOINT[,bind|,connect][,replay=URL][,name=NAME][,topic=TOPIC]``, e.g.
    ``tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558`` (connect) or ``tcp://0.0.0.0:5557,bind``."""
    parts = [p.strip() for p in text.split(",")]
    endpoint, opts, mode = parts[0], {}, None
    flag = f"--kv-events {text!r}"
    _zmq_address(endpoint, "--kv-events", bindable=True)
    for p in parts[1:]:
        if p in ("bind", "connect"):
            if mode is not None:
                raise InputError(f"{flag}: give bind or connect once")
            mode = p
            continue
        key, eq, value = p.partition("=")
        if not eq or key not in ("replay", "name", "topic") or not value or key in opts:
            raise InputError(f"{flag}: options are bind, connect, replay=URL, name=NAME, topic=TOPIC "
                             f"(each once); got {p!r}")
        opts[key] = value
    host = endpoint[6:].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else None
    wildcard = host in WILDCARD_HOSTS
    if mode == "connect" and wildcard:
        raise InputError(f"{flag}: a wildcard host can only be bound; connect to the engine's host instead")
    if "replay" in opts:
        _zmq_address(opts["replay"], "--kv-events replay=", bindable=False)
    return KVSource(endpoint, opts.get("replay"), opts.get("name"), opts.get("topic", ""),
                    bind=mode == "bind" or (mode is None and wildcard))


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    url: str                     # the full /metrics URL
    name: str | None = None      # the instance its rows carry (default: host:port)

    @property
    def instance(self) -> str:
        return self.name or urlsplit(self.url).netloc


def parse_scrape(text: str) -> ScrapeTarget:
    """``URL[,name=NAME]``: an engine's Prometheus endpoint; a URL with no path gets ``/metrics``."""
    url, *opts = [p.strip() for p in text.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"--scrape {text!r}: give the engine's http(s) URL, e.g. http://10.0.0.5:8000/metrics")
    name = None
    for p in opts:
        key, eq, value = p.partition("=")
        if key != "name" or not eq or not value or name is not None:
            raise InputError(f"--scrape {text!r}: the one option is name=NAME; got {p!r}")
        name = value
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/metrics"
    return ScrapeTarget(url, name)


@dataclass(frozen=True, slots=True)
class CollectConfig:
    store: str = "kvledger-store"
    otlp_host: str = "127.0.0.1"
    otlp_port: int = 4318
    kv_sources: tuple[KVSource, ...] = ()
    tenant_attribute: str = "tenant.id"
    tenant_header: str | None = None
    decode_workers: int = 0
    otlp_grpc_port: int | None = 4317           # None: no gRPC receiver
    scrapes: tuple[ScrapeTarget, ...] = ()
    scrape_interval: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.otlp_port <= 65535:
            raise InputError(f"--otlp-port must be in [0, 65535], got {self.otlp_port}")
        if self.otlp_grpc_port is not None and not 0 <= self.otlp_grpc_port <= 65535:
            raise InputError(f"--otlp-grpc-port must be in [0, 65535] (0: off), got {self.otlp_grpc_port}")
        if self.otlp_grpc_port is not None and self.otlp_grpc_port == self.otlp_port != 0:
            raise InputError(f"--otlp-grpc-port and --otlp-port are both {self.otlp_port}: give each its own port")
        if not 0 <= self.decode_workers <= 64:
            raise InputError(f"--decode-workers must be in [0, 64], got {self.decode_workers}")
        if not SCRAPE_MIN_INTERVAL <= self.scrape_interval <= SCRAPE_MAX_INTERVAL:
            raise InputError(f"--scrape-interval must be in [{SCRAPE_MIN_INTERVAL}, {SCRAPE_MAX_INTERVAL:g}] seconds, "
                             f"got {self.scrape_interval}")
        names = [s.name or s.endpoint for s in self.kv_sources]
        if len(set(names)) != len(names):
            raise InputError("--kv-events: two publishers with the same name; give each its own name=")
