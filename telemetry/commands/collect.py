"""``kvledger collect``: a vLLM/SGLang fleet's telemetry (OTLP spans and metrics, ZMQ KV cache
events) into a store until SIGTERM/SIGINT."""
from __future__ import annotations

import os

from engine.commands.options import check_writable_store
from telemetry.receivers.config import CollectConfig, parse_kv_source


def add_arguments(co) -> None:
    co.add_argument("--store", default="kvledger-store", help="the store to write (default: kvledger-store)")
    co.add_argument("--otlp-host", default="127.0.0.1", help="address the OTLP/HTTP receiver binds (default 127.0.0.1)")
    co.add_argument("--otlp-port", type=int, default=4318, help="OTLP/HTTP port (default 4318, the OTLP standard)")
    co.add_argument("--kv-events", action="append", metavar="ENDPOINT[,replay=URL][,name=NAME][,topic=T]",
                    help="a KV event publisher to subscribe to (repeat for several), e.g. tcp://10.0.0.5:5557 "
                         "(vLLM --kv-events-config endpoint); replay= its replay socket, to fill sequence gaps")
    co.add_argument("--tenant-attribute", default="tenant.id",
                    help="span or resource attribute naming the tenant (default tenant.id; stored pseudonymised)")
    co.add_argument("--tenant-header", default=None,
                    help="HTTP header on the OTLP request naming the tenant of all its spans (default: none)")
    co.add_argument("--decode-workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="processes decoding OTLP bodies of 64 KiB or more, started on the first one (default: "
                         "the cores, at most 4; 0 decodes everything in the receiver's own process)")


def make_config(a) -> CollectConfig:
    check_writable_store(a.store)
    return CollectConfig(a.store, a.otlp_host, a.otlp_port, tuple(parse_kv_source(s) for s in a.kv_events or []),
                         a.tenant_attribute, a.tenant_header, a.decode_workers)


def run(c: CollectConfig) -> int:
    from telemetry.receivers.collect import collect
    return collect(c)
