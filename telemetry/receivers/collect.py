"""``kvledger collect``'s lifecycle: the OTLP receivers (HTTP and gRPC), the KV event subscribers and
the ``/metrics`` scrapers, into one store, until SIGTERM/SIGINT; then everything stops, the store is
flushed and sealed, exit 0. What each source delivered (and lost) is summarised on stderr."""
from __future__ import annotations

import signal
import sys
import threading

from engine.errors import KvledgerError
from telemetry.receivers.config import CollectConfig


def collect(c: CollectConfig) -> int:
    import uvicorn

    from telemetry.receivers.kv_events import KVEventSubscriber
    from telemetry.receivers.otlp import build_app
    from telemetry.receivers.prometheus import Scraper
    from telemetry.store import SegmentWriter
    writer = SegmentWriter(c.store)
    subs, scrapers, grpc_server, grpc_counts = [], [], None, None
    try:
        subs = [KVEventSubscriber(writer, s.endpoint, s.replay, s.topic, s.name, bind=s.bind).start()
                for s in c.kv_sources]
        if c.otlp_grpc_port is not None:
            from telemetry.receivers.otlp_grpc import serve_grpc
            try:
                grpc_server, grpc_port, grpc_counts = serve_grpc(writer, c.otlp_host, c.otlp_grpc_port,
                                                                 c.tenant_attribute, c.tenant_header)
            except OSError as e:
                raise KvledgerError(f"{e}; give --otlp-grpc-port another port, or 0 to turn it off") from None
        scrapers = [Scraper(writer, t.url, t.instance, c.scrape_interval).start() for t in c.scrapes]
        from telemetry.receivers.health import CollectHealth, registry
        health = CollectHealth(writer, {}, subs, scrapers, grpc_counts)
        app = build_app(writer, c.tenant_attribute, c.tenant_header, c.decode_workers, own_metrics_registry=registry(health))
        health.received = app.state.received
        server = uvicorn.Server(uvicorn.Config(app, host=c.otlp_host, port=c.otlp_port, log_level="warning",
                                               access_log=False))

        def on_signal(signum, frame) -> None:
            server.force_exit = server.should_exit
            server.should_exit = True
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        kv = ", ".join(f"{s.endpoint} ({'bound' if s.bind else 'connected'})" for s in c.kv_sources) or "no publisher"
        print(f"kvledger collect: OTLP/HTTP on http://{c.otlp_host}:{c.otlp_port} (/v1/traces, /v1/metrics; "
              "its own health at /metrics)"
              + (f", OTLP/gRPC on {c.otlp_host}:{grpc_port}" if grpc_server is not None else "")
              + f"; KV events from {kv}; scraping {', '.join(t.url for t in c.scrapes) or 'nothing'}; "
              f"store {c.store} (run {writer.boot})", file=sys.stderr, flush=True)
        http = threading.Thread(target=server.run, name="kvledger-otlp")
        http.start()
        try:
            while http.is_alive():
                http.join(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if not server.started:
            print(f"kvledger: error: the OTLP receiver could not listen on {c.otlp_host}:{c.otlp_port} "
                  "(see above)", file=sys.stderr)
            return 1
        return 0
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=2).wait()
        for s in scrapers:
            s.stop()
        for s in subs:
            s.stop()
        store_error = None
        try:
            writer.close()
        except KvledgerError as e:            # a full disk, a failed writer: said once, after the summaries
            store_error = e
        if grpc_counts is not None:
            print(f"kvledger collect: OTLP/gRPC: {grpc_counts['spans']} spans, {grpc_counts['points']} metric points, "
                  f"{grpc_counts['throttled']} refused while the store was behind", file=sys.stderr)
        for s in subs:
            print(f"kvledger collect: {s.summary()}", file=sys.stderr)
        for s in scrapers:
            print(f"kvledger collect: {s.summary()}", file=sys.stderr)
        if store_error is not None:
            raise store_error
