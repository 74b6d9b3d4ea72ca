"""``kvledger collect``: a vLLM/SGLang fleet's telemetry (OTLP spans and metrics over HTTP and gRPC,
ZMQ KV cache events, scraped Prometheus ``/metrics``) into a store until SIGTERM/SIGINT."""
from __future__ import annotations

import os

from engine.commands.options import add_store, check_listen, check_writable_store
from telemetry.receivers.config import CollectConfig, parse_kv_source, parse_scrape


def add_arguments(co) -> None:
    add_store(co, "the store to write")
    co.add_argument("--otlp-host", default="127.0.0.1",
                    help="address the OTLP receivers (HTTP and gRPC) bind (default 127.0.0.1)")
    co.add_argument("--otlp-port", type=int, default=4318, help="OTLP/HTTP port (default 4318, the OTLP standard)")
    co.add_argument("--otlp-grpc-port", type=int, default=4317,
                    help="OTLP/gRPC port (default 4317, the OTLP standard; vLLM's --otlp-traces-endpoint speaks "
                         "gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); 0 turns it off")
    co.add_argument("--kv-events", action="append", metavar="ENDPOINT[,bind|,connect][,replay=URL][,name=N][,topic=T]",
                    help="a KV event publisher (repeat for several). vLLM/SGLang bind tcp://*:N and ipc:// "
                         "themselves: give tcp://ENGINE-HOST:N (collect connects); an engine configured with a "
                         "concrete host connects: give that address with ,bind. replay= its replay socket, to fill "
                         "sequence gaps; name= the instance its rows carry (default: the endpoint)")
    co.add_argument("--scrape", action="append", metavar="URL[,name=N]",
                    help="an engine's Prometheus endpoint to poll into the store (repeat for several), e.g. "
                         "http://10.0.0.5:8000/metrics: vLLM's vllm:* and SGLang's sglang:* families")
    co.add_argument("--scrape-interval", type=float, default=5.0,
                    help="seconds between scrapes of each --scrape target (default 5, in [0.2, 3600])")
    co.add_argument("--tenant-attribute", default="tenant.id",
                    help="span or resource attribute naming the tenant (default tenant.id; stored pseudonymised)")
    co.add_argument("--tenant-header", default=None,
                    help="HTTP header on the OTLP request naming the tenant of all its spans (default: none)")
    co.add_argument("--decode-workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="processes decoding OTLP bodies of 64 KiB or more, started on the first one (default: "
                         "the cores, at most 4; 0 decodes everything in the receiver's own process)")


def make_config(a) -> CollectConfig:
    c = CollectConfig(a.store, a.otlp_host, a.otlp_port, tuple(parse_kv_source(s) for s in a.kv_events or []),
                      a.tenant_attribute, a.tenant_header, a.decode_workers,
                      None if a.otlp_grpc_port == 0 else a.otlp_grpc_port,
                      tuple(parse_scrape(s) for s in a.scrape or []), a.scrape_interval)
    check_listen(c.otlp_host, ("--otlp-port", c.otlp_port), ("--otlp-grpc-port", c.otlp_grpc_port or 0),
                 host_flag="--otlp-host")
    check_writable_store(a.store)
    return c


def run(c: CollectConfig) -> int:
    from telemetry.receivers.collect import collect
    return collect(c)
