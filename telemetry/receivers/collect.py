"""``kvledger collect``: the OTLP/HTTP receiver and the KV event subscribers, into one store, until
SIGTERM/SIGINT; then the subscribers stop, the store is flushed and sealed, exit 0."""
from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass

from engine.errors import InputError


@dataclass(frozen=True)
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


def collect(args) -> int:
    import uvicorn

    from telemetry.receivers.kv_events import KVEventSubscriber
    from telemetry.receivers.otlp import build_app
    from telemetry.store import SegmentWriter
    sources = [parse_kv_source(s) for s in args.kv_events or []]
    if not 0 <= args.otlp_port <= 65535:
        raise InputError(f"--otlp-port must be in [0, 65535], got {args.otlp_port}")
    if not 0 <= args.decode_workers <= 64:
        raise InputError(f"--decode-workers must be in [0, 64], got {args.decode_workers}")
    writer = SegmentWriter(args.store)
    subs = []
    try:
        subs = [KVEventSubscriber(writer, s.endpoint, s.replay, s.topic, s.name).start() for s in sources]
        app = build_app(writer, args.tenant_attribute, args.tenant_header, args.decode_workers)
        server = uvicorn.Server(uvicorn.Config(app, host=args.otlp_host, port=args.otlp_port, log_level="warning",
                                               access_log=False))

        def on_signal(signum, frame) -> None:
            server.force_exit = server.should_exit
            server.should_exit = True
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        print(f"kvledger collect: OTLP/HTTP on http://{args.otlp_host}:{args.otlp_port} (/v1/traces, /v1/metrics); "
              f"KV events from {', '.join(s.endpoint for s in sources) or 'no publisher'}; store {args.store} "
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
            print(f"kvledger: error: the OTLP receiver could not listen on {args.otlp_host}:{args.otlp_port} "
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
