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


def bench_otlp(tmp: Path, posts: int, per: int, senders: int = 1, workers: int = 0) -> dict:
    """``senders`` instances post concurrently (each an httpx client on its own thread, as a fleet's
    exporters would); ``workers`` decoder processes (0: decode on the receiver's event loop). One
    warm-up post first, so a pool's spawn is not timed."""
    import httpx

    from tests.test_collect import Receiver
    from telemetry.store import SegmentWriter
    w = SegmentWriter(tmp / f"otlp-{senders}-{workers}")
    rx = Receiver(w, decode_workers=workers)
    bodies = [otlp_body(per, k * per) for k in range(4)]
    throttled = [0] * senders
    headers = {"content-type": "application/x-protobuf"}
    with httpx.Client() as c:
        assert c.post(rx.url + "/v1/traces", content=bodies[0], headers=headers, timeout=60).status_code == 200

    def send(k: int) -> None:
        with httpx.Client() as c:
            sent = 0
            while sent < posts // senders:
                r = c.post(rx.url + "/v1/traces", content=bodies[(k + sent) % 4], headers=headers, timeout=60)
                if r.status_code == 503:
                    throttled[k] += 1
                    time.sleep(float(r.headers.get("retry-after", "1")) / 20)
                    continue
                assert r.status_code == 200, r.text
                sent += 1
    w.flush()
    before = w.rows_written["spans"]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.flush()
    dt = time.perf_counter() - t0
    offloaded = rx.app.state.decoders.offloaded
    rx.stop()
    w.close()
    n = w.rows_written["spans"] - before
    return {"senders": senders, "decode_workers": workers, "spans": n, "seconds": dt, "spans_per_s": n / dt,
            "throttled_posts": sum(throttled),
            "posts_decoded_in_workers": offloaded}


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

    def payload(k: int) -> bytes:         # every block hash distinct, as in real traffic (none dictionary-encodes)
        evs = [{"type": "BlockStored", "block_hashes": [os.urandom(32) for _ in range(16)], "parent_block_hash": None,
                "token_ids": list(range(256)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": None} for _ in range(64)]
        return msgspec.msgpack.encode({"ts": time.time(), "events": evs, "data_parallel_rank": 0})
    pre = [payload(k) for k in range(batches + 1)]
    pub.send_multipart((b"kv", (0).to_bytes(8, "big"), pre[0]))       # warm-up: one batch, not timed
    while sub.batches < 1:
        time.sleep(0.01)
    first = sub.hashes
    t0 = time.perf_counter()
    for seq in range(1, batches + 1):
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), pre[seq]))
    while sub.batches < batches + 1 and time.perf_counter() - t0 < 300:
        time.sleep(0.01)
    sub.stop()                            # hands its last buffered rows to the writer
    w.flush()
    dt = time.perf_counter() - t0
    w.close()
    pub.close(linger=0)
    ctx.destroy(linger=0)
    return {"batches": sub.batches - 1, "hashes": sub.hashes - first, "seconds": dt,
            "block_hashes_per_s": (sub.hashes - first) / dt,
            "gaps": len(sub.gaps), "rows_written": w.rows_written["kv_events"]}


def _median(runs: list[dict], key: str) -> dict:
    """The run with the median rate, every run's rate beside it (this machine is shared: runs vary)."""
    run = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    return {**run, f"{key}_runs": [round(r[key]) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=120, help="OTLP requests of --spans-per-post spans (default 120)")
    ap.add_argument("--spans-per-post", type=int, default=1000, help="spans per OTLP request (default 1000)")
    ap.add_argument("--senders", type=int, default=4, help="concurrent OTLP senders in the fleet run (default 4)")
    ap.add_argument("--decode-workers", type=int, default=os.cpu_count() or 1,
                    help="decoder processes in the fleet run (default: the cores)")
    ap.add_argument("--batches", type=int, default=1000, help="KV event batches of 64 x 16 hashes (default 1000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is reported (default 3)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())

    def each(name: str, fn, key: str) -> dict:
        runs = []
        for i in range(args.repeats):
            (tmp / f"{name}-{i}").mkdir()
            runs.append(fn(tmp / f"{name}-{i}"))
        return _median(runs, key)
    one = each("otlp1", lambda d: bench_otlp(d, args.posts, args.spans_per_post, 1, 0), "spans_per_s")
    o = each("otlp", lambda d: bench_otlp(d, args.posts, args.spans_per_post, args.senders, args.decode_workers),
             "spans_per_s")
    for r in (one, o):
        print(f"OTLP, {r['senders']} sender(s), {r['decode_workers'] or 'no'} decoder process(es): {r['spans']} spans "
              f"per run -> {r['spans_per_s']:.0f} spans/s, median of {r['spans_per_s_runs']} ({r['throttled_posts']} "
              "posts answered 503 and retried)", flush=True)
    k = each("kv", lambda d: bench_kv(d, args.batches), "block_hashes_per_s")
    print(f"KV events: {k['hashes']} block hashes per run -> {k['block_hashes_per_s']:.0f} hashes/s, median of "
          f"{k['block_hashes_per_s_runs']}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = write("collect", {"otlp": o, "otlp_single_sender_inline": one, "kv_events": k, "max_rss_mib": rss,
                            "goals": {"spans_per_s": 50_000, "block_hashes_per_s": 1_000_000}})
    print(f"max RSS {rss:.0f} MiB; wrote {out}")


if __name__ == "__main__":
    main()
