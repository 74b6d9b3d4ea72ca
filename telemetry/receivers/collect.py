"""``kvledger collect``'s lifecycle: the OTLP/HTTP receiver and the KV event subscribers, into one
store, until SIGTERM/SIGINT; then the subscribers stop, the store is flushed and sealed, exit 0."""
from __future__ import annotations

import signal
import sys
import threading

from telemetry.receivers.config import CollectConfig


def collect(c: CollectConfig) -> int:
    import uvicorn

    from telemetry.receivers.kv_events import KVEventSubscriber
    from telemetry.receivers.otlp import build_app
    from telemetry.store import SegmentWriter
    writer = SegmentWriter(c.store)
    subs = []
    try:
        subs = [KVEventSubscriber(writer, s.endpoint, s.replay, s.topic, s.name).start() for s in c.kv_sources]
        app = build_app(writer, c.tenant_attribute, c.tenant_header, c.decode_workers)
        server = uvicorn.Server(uvicorn.Config(app, host=c.otlp_host, port=c.otlp_port, log_level="warning",
                                               access_log=False))

        def on_signal(signum, frame) -> None:
            server.force_exit = server.should_exit
            server.should_exit = True
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        print(f"kvledger collect: OTLP/HTTP on http://{c.otlp_host}:{c.otlp_port} (/v1/traces, /v1/metrics); "
              f"KV events from {', '.join(s.endpoint for s in c.kv_sources) or 'no publisher'}; store {c.store} "
              f"(run {writer.boot})", file=sys.stderr, flush=True)
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
        for s in subs:
            s.stop()
        writer.close()
        for s in subs:
            print(f"kvledger collect: {s.instance}: {s.batches} batches, {s.events} events, {s.hashes} block hashes, "
                  f"{len(s.gaps)} gap(s), {s.bad} undecodable", file=sys.stderr)
