"""`kvledger collect` ingest rates, end to end, on loopback (rows written and linked in the store).

1. OTLP/HTTP: batches of 1,000 vLLM-named request spans (protobuf, as the SDK's exporter sends
   them) posted back to back to the receiver under uvicorn; spans/s from the first POST until the
   store writer has flushed everything. Goal >= 50 k spans/s.
2. KV events: a PUB socket sends batches of 64 BlockStored events x 16 block hashes (32-byte
   hashes, the newer tagged-map encoding) to the subscriber; block hashes/s until all are written.
   Goal >= 1 M block hashes/s.
3. Back-pressure: the writer's queue bounds memory; a sender faster than the store gets 503s.
Writes bench/results/collect.json; README figures come from it (bench/readme_figures.py).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import write  # noqa: E402


def otlp_body(n: int, base: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.instance.id", value=AnyValue(string_value="gpu-0")))
    ss = rs.scope_spans.add()
    for i in range(n):
        sp = ss.spans.add(trace_id=(base + i).to_bytes(16, "big"), span_id=(base + i).to_bytes(8, "big"),
                          name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000 + i,
                          end_time_unix_nano=1_700_000_000_500_000_000 + i)
        for k, v in (("gen_ai.usage.prompt_tokens", AnyValue(int_value=100 + i % 900)),
                     ("gen_ai.usage.completion_tokens", AnyValue(int_value=16)),
                     ("gen_ai.latency.time_to_first_token", AnyValue(double_value=0.05)),
                     ("gen_ai.request.id", AnyValue(string_value=f"cmpl-{base + i}"))):
            sp.attributes.append(KeyValue(key=k, value=v))
    return req.SerializeToString()


def bench_otlp(tmp: Path, posts: int, per: int) -> dict:
    import httpx

    from tests.test_collect import Receiver
    from telemetry.store import SegmentWriter
    w = SegmentWriter(tmp / "otlp")
    rx = Receiver(w)
    bodies = [otlp_body(per, k * per) for k in range(4)]
    throttled = 0
    with httpx.Client() as c:
        t0 = time.perf_counter()
        sent = 0
        while sent < posts:
            r = c.post(rx.url + "/v1/traces", content=bodies[sent % 4], headers={"content-type": "application/x-protobuf"})
            if r.status_code == 503:
                throttled += 1
                time.sleep(float(r.headers.get("retry-after", "1")) / 20)
                continue
            assert r.status_code == 200, r.text
            sent += 1
        w.flush()
        dt = time.perf_counter() - t0
    rx.stop()
    w.close()
    return {"spans": posts * per, "seconds": dt, "spans_per_s": posts * per / dt, "throttled_posts": throttled,
            "rows_written": w.rows_written["spans"]}


def bench_kv(tmp: Path, batches: int) -> dict:
    import msgspec
    import zmq

    from telemetry.receivers.kv_events import KVEventSubscriber
    from telemetry.store import SegmentWriter
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(0)
    ep = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    w = SegmentWriter(tmp / "kv")
    sub = KVEventSubscriber(w, ep, instance="gpu-0", ctx=ctx).start()
    time.sleep(0.5)

    def payload(k: int) -> bytes:
        evs = [{"type": "BlockStored", "block_hashes": [os.urandom(32) for _ in range(16)], "parent_block_hash": None,
                "token_ids": list(range(256)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": None} for _ in range(64)]
        return msgspec.msgpack.encode({"ts": time.time(), "events": evs, "data_parallel_rank": 0})
    pre = [payload(k) for k in range(8)]
    t0 = time.perf_counter()
    for seq in range(batches):
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), pre[seq % 8]))
    while sub.batches < batches and time.perf_counter() - t0 < 300:
        time.sleep(0.01)
    w.flush()
    dt = time.perf_counter() - t0
    sub.stop()
    w.close()
    pub.close(linger=0)
    ctx.destroy(linger=0)
    return {"batches": sub.batches, "hashes": sub.hashes, "seconds": dt, "block_hashes_per_s": sub.hashes / dt,
            "gaps": len(sub.gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=60, help="OTLP requests of --spans-per-post spans (default 60)")
    ap.add_argument("--spans-per-post", type=int, default=1000, help="spans per OTLP request (default 1000)")
    ap.add_argument("--batches", type=int, default=400, help="KV event batches of 64 x 16 hashes (default 400)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    o = bench_otlp(tmp, args.posts, args.spans_per_post)
    print(f"OTLP: {o['spans']} spans in {o['seconds']:.2f} s -> {o['spans_per_s']:.0f} spans/s "
          f"({o['throttled_posts']} posts answered 503 and retried)", flush=True)
    k = bench_kv(tmp, args.batches)
    print(f"KV events: {k['hashes']} block hashes in {k['seconds']:.2f} s -> {k['block_hashes_per_s']:.0f} hashes/s",
          flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = write("collect", {"otlp": o, "kv_events": k, "max_rss_mib": rss,
                            "goals": {"spans_per_s": 50_000, "block_hashes_per_s": 1_000_000}})
    print(f"max RSS {rss:.0f} MiB; wrote {out}")


if __name__ == "__main__":
    main()
