"""A foreign fleet's telemetry into the store: spans through the real OpenTelemetry SDK and its
OTLP/HTTP exporter (protobuf) and as OTLP/JSON (gzip too), KV cache events over real ZMQ sockets in
both of vLLM's encodings - with a sequence gap filled from the replay socket, one that stays lost,
and a salt collision - and `kvledger collect` itself, started, fed and stopped."""
from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from forensics.queries.duckdb import Forensics
from forensics.queries.fleet import query as fleet_query
from engine.commands.main import main
from telemetry.receivers.kv_events import KVEventSubscriber
from telemetry.receivers.otlp import MAX_BODY, build_app
from telemetry.store import SegmentWriter

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """The OTLP app under a real uvicorn on a loopback port, writing into ``writer``."""

    def __init__(self, writer, **kw):
        import uvicorn
        self.port = _port()
        self.app = build_app(writer, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_spans_from_the_real_sdk_exporter_land_with_vllm_names_mapped(tmp_path):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    w = SegmentWriter(tmp_path / "store")
    rx = Receiver(w)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "service.instance.id": "gpu-7"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.url + "/v1/traces")))
    tracer = provider.get_tracer("vllm.llm_engine")
    for i, (prompt, ttft) in enumerate([(120, 0.05), (900, 0.012), (300, 0.09)]):
        with tracer.start_as_current_span("llm_request") as sp:    # vLLM's older attribute names
            sp.set_attributes({"gen_ai.usage.prompt_tokens": prompt, "gen_ai.usage.completion_tokens": 16,
                               "gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.time_in_queue": 0.001,
                               "gen_ai.request.id": f"cmpl-{i}", "tenant.id": f"tenant-{i % 2}",
                               "gen_ai.response.model": "meta-llama/Llama-3.1-8B"})
    assert provider.force_flush(10_000)
    provider.shutdown()
    rx.stop()
    w.close()
    df = Forensics(tmp_path / "store").con.sql(
        "SELECT request_id, input_tokens, output_tokens, ttft_s, node, operation, tenant_h, "
        "SpanAttributes['gen_ai.latency.time_in_queue'] AS queue, SpanName FROM spans ORDER BY request_id").pl()
    assert df["request_id"].to_list() == ["cmpl-0", "cmpl-1", "cmpl-2"]
    assert df["input_tokens"].to_list() == [120, 900, 300] and df["output_tokens"].to_list() == [16] * 3
    assert df["ttft_s"].to_list() == [0.05, 0.012, 0.09] and set(df["node"]) == {"gpu-7"}
    assert set(df["operation"]) == {"request"} and df["queue"].to_list() == ["0.001"] * 3    # unknown attrs kept
    t = df["tenant_h"].to_list()
    assert t[0] == t[2] != t[1] and "tenant-0" not in t                                      # pseudonyms only


def _otlp_json(trace_id: str) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "sglang"}}]},
            "scopeSpans": [{"scope": {"name": "sglang"}, "spans": [{
                "traceId": trace_id, "spanId": "0011223344556677", "name": "llm_request", "kind": 2,
                "startTimeUnixNano": "1764547200000000000", "endTimeUnixNano": "1764547200500000000",
                "attributes": [{"key": "gen_ai.usage.input_tokens", "value": {"intValue": "777"}},
                               {"key": "gen_ai.response.id", "value": {"stringValue": "req-9"}}]}]}]}]}


def _bomb(inflated: int) -> bytes:
    """gzip of ``inflated`` zero bytes, built a MiB at a time (never held inflated here)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    mib = bytes(1 << 20)
    return b"".join(z.compress(mib) for _ in range(inflated >> 20)) + z.flush()


BAD_BODIES = [   # (content type, encoding, body, the status, what it says)
    ("application/json", "", b"{not json", 400, "not JSON"),
    ("application/x-protobuf", "", b"\xff\xff\xff\xff", 400, "not an OTLP protobuf"),
    ("application/json", "gzip", b"plain, not gzip", 400, "does not decompress"),
    ("application/json", "gzip", gzip.compress(b"{}" * 5000)[:-12], 400, "cut short"),
    ("text/plain", "", b"hello", 400, "Content-Type 'text/plain'"),
    ("application/json", "", json.dumps(_otlp_json("zz" * 16)).encode(), 400, "is not hex"),
    ("application/json", "br", b"{}", 400, "Content-Encoding 'br' is not supported"),
    ("application/json", "", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deep"),
    ("application/json", "gzip", _bomb(24 << 20), 413, "inflates past the"),
    ("application/x-protobuf", "", bytes(MAX_BODY + 1), 413, "over the"),
]


def test_otlp_json_and_gzip_are_received_and_bad_bodies_get_400(tmp_path):
    w = SegmentWriter(tmp_path / "store")
    rx = Receiver(w, tenant_attribute=None, tenant_header="x-tenant")
    try:
        body = json.dumps(_otlp_json("0123456789abcdef0123456789abcdef")).encode()
        for enc, data in (("", body), ("gzip", gzip.compress(body)), ("gzip", gzip.compress(body) + gzip.compress(b""))):
            r = httpx.post(rx.url + "/v1/traces", content=data, headers={
                "content-type": "application/json", "x-tenant": "acme", **({"content-encoding": enc} if enc else {})})
            assert r.status_code == 200, r.text
        for ctype, enc, data, status, why in BAD_BODIES:
            r = httpx.post(rx.url + "/v1/traces", content=data,
                           headers={"content-type": ctype, **({"content-encoding": enc} if enc else {})})
            assert r.status_code == status and why in r.json()["message"], (why, r.text)
        assert httpx.get(rx.url + "/health").json()["received"]["refused_bodies"] == len(BAD_BODIES)
    finally:
        rx.stop()
        w.close()
    df = Forensics(tmp_path / "store").con.sql("SELECT TraceId, request_id, input_tokens, tenant_h FROM spans").pl()
    assert df.height == 3 and set(df["TraceId"]) == {"0123456789abcdef0123456789abcdef"}   # plain, gzip, 2 members
    assert set(df["request_id"]) == {"req-9"} and set(df["input_tokens"]) == {777} and df["tenant_h"][0] is not None


# ---- KV events ---------------------------------------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher wire behaviour: PUB (topic, seq, msgpack) and a ROUTER replay socket."""

    def __init__(self, ctx, replay: bool):
        self.pub = ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replay = (f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}" if replay else None)
        self.sent: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True) if replay else None
        if self.thread:
            self.thread.start()

    def close(self) -> None:
        """Stop the replay thread before its socket goes (a ZMQ socket closed under a thread polling
        it aborts the process), then close both sockets."""
        self.stop.set()
        if self.thread:
            self.thread.join(5)
            self.router.close(linger=0)
        self.pub.close(linger=0)

    def send(self, seq: int, payload: bytes, drop: bool = False) -> None:
        self.sent[seq] = payload
        if not drop:
            self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(50):
                client, _, start = self.router.recv_multipart()
                for seq in sorted(s for s in self.sent if s >= int.from_bytes(start, "big")):
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), self.sent[seq]))
                self.router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))


def _old(events, ts=1.0) -> bytes:      # array_like encoding (older vLLM)
    return msgspec.msgpack.encode([ts, events])


def _new(events, ts=1.0) -> bytes:      # tagged maps (newer vLLM)
    return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": 0})


def _stored_new(hashes, parent=None, salt=None, tokens=32) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": list(range(tokens)),
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [[salt] if salt else None] + [None] * (len(hashes) - 1), "group_idx": 0}


def test_kv_events_in_both_encodings_with_gaps_replay_and_a_salt_collision(tmp_path):
    ctx = zmq.Context()
    w = SegmentWriter(tmp_path / "store")
    with_replay, without = Publisher(ctx, replay=True), Publisher(ctx, replay=False)
    subs = [KVEventSubscriber(w, with_replay.endpoint, with_replay.replay, instance="vllm-a", ctx=ctx).start(),
            KVEventSubscriber(w, without.endpoint, None, instance="sglang-b", ctx=ctx).start()]
    time.sleep(0.5)                                           # ZMQ's slow joiner: let the SUBs connect
    h = [bytes([i]) * 32 for i in range(8)]
    # publisher A, newer encoding: salt-x stores h0,h1; batch 1 is lost on the wire and replayed;
    # salt-y then stores h0 again (an engine that left the salt out of the hash) and h5
    with_replay.send(0, _new([_stored_new([h[0], h[1]], salt="salt-x")]))
    with_replay.send(1, _new([{"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU"}]), drop=True)
    with_replay.send(2, _new([_stored_new([h[0]], salt="salt-y"), _stored_new([h[5]], parent=h[0])]))
    # publisher B, older array_like encoding with int hashes; batch 1 lost and no replay socket
    without.send(0, _old([["BlockStored", [11, 12], None, list(range(32)), 16, None]]))
    without.send(1, _old([["AllBlocksCleared"]]), drop=True)
    without.send(2, _old([["BlockRemoved", [11]], ["AllBlocksCleared"]]))
    deadline = time.time() + 10
    while time.time() < deadline and (subs[0].batches < 3 or subs[1].batches < 2):
        time.sleep(0.05)
    for s in subs:
        s.stop()
    with_replay.close()
    without.close()
    w.close()
    assert (subs[0].batches, subs[1].batches) == (3, 2)
    assert subs[0].gaps == [(1, 1, True)] and subs[1].gaps == [(1, 1, False)]
    fx = Forensics(tmp_path / "store")
    ev = fx.con.sql("SELECT instance, seq, kind, block_hashes, parent_hash, token_count, medium, scope_h "
                    "FROM kv_events ORDER BY instance, seq, kind").pl()
    a = ev.filter(ev["instance"] == "vllm-a")
    assert a["seq"].to_list() == [0, 1, 2, 2] and a["kind"].to_list()[1] == "BlockRemoved"     # the replayed batch
    assert a["block_hashes"][0].to_list() == [h[0].hex(), h[1].hex()] and a["medium"][0] == "GPU"
    stored = a.filter(a["kind"] == "BlockStored")
    assert stored["scope_h"].n_unique() == 2 and None not in stored["scope_h"].to_list()
    b = ev.filter(ev["instance"] == "sglang-b")
    assert b["block_hashes"][0].to_list() == ["11", "12"] and b["token_count"][0] == 32      # the engine's own ints
    assert sorted(b["kind"].to_list()) == ["AllBlocksCleared", "BlockRemoved", "BlockStored"]
    scopes = fx.query("cache_scopes")
    assert scopes["block_hash"].to_list() == [h[0].hex()] and scopes["scopes"].to_list() == [2]
    gaps = fx.query("gaps")
    assert sorted(gaps.select("instance", "first_missing", "filled").rows()) == [("sglang-b", 1, False),
                                                                                ("vllm-a", 1, True)]
    raw = b"".join(f.read_bytes() for f in (tmp_path / "store").rglob("*") if f.is_file())
    assert b"salt-x" not in raw and b"salt-y" not in raw                                      # pseudonyms only
    ctx.destroy(linger=0)


def test_kvledger_collect_runs_receives_and_seals_on_sigterm(tmp_path):
    port = _port()
    ctx = zmq.Context()
    pub = Publisher(ctx, replay=False)
    proc = subprocess.Popen([sys.executable, "-m", "engine.commands", "collect", "--store", str(tmp_path / "store"),
                             "--otlp-port", str(port), "--otlp-grpc-port", "0", "--kv-events", pub.endpoint + ",name=gpu-1"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = json.dumps(_otlp_json("ab" * 16)).encode()
        assert httpx.post(f"http://127.0.0.1:{port}/v1/traces", content=body,
                          headers={"content-type": "application/json"}).status_code == 200
        for seq in range(20):          # until the SUB has joined
            pub.send(seq, _new([_stored_new([bytes([seq]) * 32])]))
            time.sleep(0.1)
        pub.send(25, _new([_stored_new([bytes([25]) * 32])]))      # batches 20..24 never sent: lost
        from prometheus_client.parser import text_string_to_metric_families
        own: dict = {}
        for _ in range(50):            # collect's own /metrics, as Prometheus scrapes it
            own = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text) for s in f.samples}
            if own.get(("kvledger_kv_event_batches_lost_total", (("source", "gpu-1"),))):
                break
            time.sleep(0.1)
        assert own[("kvledger_kv_event_batches_lost_total", (("source", "gpu-1"),))] == 5
        assert own[("kvledger_store_writer_up", ())] == 1
        assert own[("kvledger_collect_received_total", (("protocol", "http"), ("signal", "spans")))] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
        pub.close()
    assert proc.returncode == 0, err
    assert "gpu-1:" in err and "block hashes" in err
    fx = Forensics(tmp_path / "store")
    assert fx.verdict.ok and fx.verdict.sealed
    assert fx.con.sql("SELECT count(*) FROM spans").fetchall()[0][0] == 1
    assert fx.con.sql("SELECT count(*) FROM kv_events WHERE instance = 'gpu-1'").fetchall()[0][0] > 0
    ctx.destroy(linger=0)


@pytest.mark.parametrize("argv,error", [
    (["collect", "--kv-events", "localhost:5557"], "a ZMQ address is tcp://HOST:PORT"),
    (["collect", "--kv-events", "tcp://127.0.0.1:5557,replay"], "options are bind, connect, replay=URL"),
    (["collect", "--kv-events", "tcp://127.0.0.1:70000"], "the port must be in [1, 65535]"),
    (["collect", "--kv-events", "tcp://*:5557,connect"], "a wildcard host can only be bound"),
    (["collect", "--kv-events", "tcp://h:1,bind,connect"], "give bind or connect once"),
    (["collect", "--kv-events", "tcp://h:1,replay=tcp://*:5558"], "a wildcard host can only be bound"),
    (["collect", "--kv-events", "tcp://h:1,replay=nowhere"], "a ZMQ address is"),
    (["collect", "--kv-events", "tcp://h:1", "--kv-events", "tcp://h:1"], "two publishers with the same name"),
    (["collect", "--scrape", "10.0.0.5:8000"], "give the engine's http(s) URL"),
    (["collect", "--scrape", "http://h:8000,job=x"], "the one option is name=NAME"),
    (["collect", "--scrape-interval", "0"], "--scrape-interval must be in [0.2, 3600]"),
    (["collect", "--otlp-port", "70000"], "--otlp-port must be in [0, 65535]"),
    (["collect", "--otlp-grpc-port", "-1"], "--otlp-grpc-port must be in [0, 65535]"),
    (["collect", "--otlp-grpc-port", "4400", "--otlp-port", "4400"], "give each its own port"),
    (["collect", "--decode-workers", "-1"], "--decode-workers must be in [0, 64]"),
    (["ingest-logs", "/nonexistent/vllm.log", "--engine", "vllm"], "/nonexistent/vllm.log: no such log file"),
])
def test_bad_collect_input_is_refused_before_the_store_is_taken(tmp_path, capsys, argv, error):
    assert main([*argv, "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and error in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


def test_a_foreign_incident_is_flagged_from_spans_and_logs_alone(tmp_path, capsys):
    """vLLM-named spans through the real SDK exporter: 40 healthy requests whose TTFT grows with the
    prompt, and 4 over-pool prompts answered at the short-prompt floor (the incident); the
    instance's start-up log gives its pool. fleet_impact and fleet_ttft flag exactly those 4; the
    log's KV canary and checksum lines are the engine's own detectors, the stats line is not."""
    import random

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    store = tmp_path / "store"
    log = tmp_path / "gpu-7.log"
    log.write_text("INFO 09-01 10:03:02 [kv_cache_utils.py:634] GPU KV cache size: 1,200 tokens\n"
                   "INFO 09-01 10:03:02 [kv_cache_utils.py:637] Maximum concurrency for 2,048 tokens per request: 0.59x\n")
    assert main(["ingest-logs", str(log), "--format", "vllm", "--store", str(store)]) == 0
    assert main(["ingest-logs", str(ROOT / "tests" / "fixtures" / "sglang_detectors.log"), "--engine", "sglang",
                 "--store", str(store), "--instance", "sglang-0"]) == 0
    w = SegmentWriter(store)
    rx = Receiver(w)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "service.instance.id": "gpu-7"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.url + "/v1/traces")))
    tracer, rnd = provider.get_tracer("vllm"), random.Random(7)
    incident = set()
    from telemetry.receivers.prometheus import Sample, metric_table
    def scrape() -> None:     # gpu-7's prefix-cache hit counter, as `collect --scrape` stores it: it never rises
        w.submit("metrics", metric_table([Sample("vllm:prefix_cache_hits", "counter", "vllm:prefix_cache_hits_total",
                                                 {"engine": "0"}, 0.0)], time.time_ns(), "gpu-7"))
    scrape()
    for i in range(44):
        n = rnd.randint(1300, 2000) if i % 11 == 5 else rnd.randint(40, 1100)
        ttft = 0.012 * rnd.uniform(0.9, 1.1) if n > 1200 else (0.01 + 1e-4 * n) * rnd.uniform(0.9, 1.1)
        if n > 1200:
            incident.add(f"cmpl-{i}")
        with tracer.start_as_current_span("llm_request") as sp:
            sp.set_attributes({"gen_ai.usage.prompt_tokens": n, "gen_ai.usage.completion_tokens": 8,
                               "gen_ai.latency.time_to_first_token": ttft, "gen_ai.request.id": f"cmpl-{i}"})
            if i < 22:      # an engine that also reports what it computed: the incident's one token
                sp.set_attribute("kvledger.prompt_tokens.prefilled", 1 if n > 1200 else n)
    assert provider.force_flush(10_000)
    provider.shutdown()
    time.sleep(0.3)           # past the synthetic TTFTs (up to 0.12 s after spans that start within milliseconds)
    scrape()
    rx.stop()
    w.close()
    fx = Forensics(store)
    assert len(incident) == 4
    impact = fx.query("fleet_impact")
    assert set(impact["request_id"]) == incident and set(impact["pool_tokens"]) == {1200}
    ttft = fx.query("fleet_ttft")
    assert set(ttft.filter(ttft["below_floor"])["request_id"]) == incident
    assert ttft["fitted_on"].max() == 44 and not ttft["cache_hit_possible"].any()
    reported = {f"cmpl-{i}" for i in range(22)}       # the rest: a skip, because the scraped hit counter never rose
    assert set(ttft.filter(ttft["cache_evidence"] == "reported")["request_id"]) == reported
    assert set(ttft.filter(ttft["cache_evidence"] == "no hits")["request_id"]) == {f"cmpl-{i}" for i in range(22, 44)}
    assert set(ttft.filter(ttft["usage_dishonest"])["request_id"]) == incident & reported
    assert set(ttft.filter(ttft["usage_dishonest"].is_null())["request_id"]) == {f"cmpl-{i}" for i in range(22, 44)}
    assert fx.query("canary").select("instance", "kind", "line_no").rows() == [("sglang-0", "kv_canary", 3),
                                                                             ("sglang-0", "kv_checksum", 5)]
    cap = fx.con.sql("SELECT instance, pool_tokens, context_length FROM capacity ORDER BY instance").fetchall()
    assert cap == [("gpu-7", 1200, 2048), ("sglang-0", 681280, 1048576)]
    from forensics.report import build
    rep = build(store)            # a store of foreign telemetry only: the report says what it can and cannot show
    c = rep["counts"]
    assert (c["fleet_over_pool_requests"], c["fleet_below_ttft_floor_requests"], c["fleet_detector_lines"]) == (4, 4, 2)
    assert "keep no page ledger" in rep["foreign_fleet"]["note"] and c["affected_responses"] == 0
    from dashboard.data import Panels
    flagged, lines, ledger = Panels(store).fleet()
    assert set(flagged["request_id"]) == incident and lines.height == 2 and not ledger
    per_tenant = Panels(store).fleet_tenants()          # no tenant attribute on these spans: one row, tenant NULL
    assert per_tenant.select("requests", "below_floor", "over_pool").rows() == [(44, 4, 4)]
    # ttft, impact and tenants under their own names: a store of foreign spans only answers from them
    capsys.readouterr()
    for name, source, rows, note in (("ttft", "auto", 44, "answers from the foreign fleet's request spans (fleet_ttft)"),
                                     ("impact", "auto", 4, "(fleet_impact)"), ("tenants", "auto", 1, "(fleet_tenants)"),
                                     ("ttft", "ledger", 0, None), ("tenants", "spans", 1, None)):
        assert main(["forensics", name, "--store", str(store), "--source", source, "--format", "json"]) == 0
        out, err = capsys.readouterr()
        got = json.loads(out)
        assert len(got) == rows, (name, source, got)
        assert (note in err) if note else "note:" not in err, err
        if name == "impact" or (name == "ttft" and rows):
            assert {r["request_id"] for r in got if name == "impact" or r["below_floor"]} == incident
        if name == "tenants":
            assert (got[0]["requests"], got[0]["below_floor"], got[0]["over_pool"]) == (44, 4, 4)
    assert main(["forensics", "runs", "--store", str(store), "--source", "spans"]) == 2
    assert "--source applies to ttft, impact, tenants only" in capsys.readouterr().err
    import os

    from tests.streamlit_app import app_test, charts, unknown_fields
    os.environ["KVLEDGER_STORE"] = str(store)
    try:
        at = app_test(str(ROOT / "dashboard" / "app.py"), 120)
        at.run()
    finally:
        del os.environ["KVLEDGER_STORE"]
    assert not at.exception, [e.message for e in at.exception]
    assert any("Theil-Sen" in c.value for c in at.caption)       # the foreign TTFT chart and its per-tenant table
    (spec, data), = charts(at)          # (no page ledger: the fleet's chart alone)
    assert unknown_fields(spec, data) == [] and data["pts"].height == 44, data


def test_the_ledger_s_tenants_name_a_foreign_fleet_s_spans_only_where_the_store_holds_some(tmp_path, capsys,
                                                                                         monkeypatch):
    """`tenants`, `ttft` and `impact` (--source auto) on a store with kvledger's requests answer from the
    page ledger; their fleet twin runs, for the note, only where the window holds a foreign request
    span (fleet_present.sql) - on a store of kvledger's requests alone it never runs, and once vLLM's
    spans (the real SDK exporter) land beside them the note counts the twin's rows."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    import forensics.queries.fleet as fleet
    from engine.replay.faults import run_fault
    from telemetry.recorder import recording
    store = tmp_path / "store"
    run_fault("late_write", "vulnerable", recorder=recording(str(store), flush_interval=0.2))
    twins: list[str] = []
    real = fleet.query
    monkeypatch.setattr(fleet, "query", lambda fx, name, *a, **k: (twins.append(name), real(fx, name, *a, **k))[1])

    def answer(name: str) -> tuple[list, str]:
        assert main(["forensics", name, "--store", str(store), "--format", "json"]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err

    own = {}
    for name in ("tenants", "ttft", "impact"):
        own[name], err = answer(name)
        assert "note:" not in err, err
    assert twins == ["tenants", "ttft", "impact"]          # never fleet_tenants, fleet_ttft, fleet_impact
    assert Forensics(store).foreign_requests() is False and own["ttft"]
    w = SegmentWriter(store)
    rx = Receiver(w)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "service.instance.id": "gpu-7"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.url + "/v1/traces")))
    tracer = provider.get_tracer("vllm.llm_engine")
    for i in range(3):
        with tracer.start_as_current_span("llm_request") as sp:
            sp.set_attributes({"gen_ai.usage.prompt_tokens": 100 * (i + 1), "gen_ai.usage.completion_tokens": 8,
                               "gen_ai.latency.time_to_first_token": 0.01 * (i + 1), "gen_ai.request.id": f"cmpl-{i}",
                               "tenant.id": f"tenant-{i % 2}"})
    assert provider.force_flush(10_000)
    provider.shutdown()
    rx.stop()
    w.close()
    fx = Forensics(store)
    assert fx.foreign_requests() is True
    early = dt.datetime(2000, 1, 1)
    assert fx.foreign_requests(early, early + dt.timedelta(days=1)) is False    # the window counts
    fx.close()
    twins.clear()
    for name, twin in (("tenants", "fleet_tenants"), ("ttft", "fleet_ttft")):
        got, err = answer(name)
        assert got == own[name], name                   # still the ledger's answer
        assert f"this store also holds a foreign fleet's request spans: `--source spans` shows them ({twin}, " in err
        rows = len(fleet.query(Forensics(store), twin))
        assert f"({twin}, {rows} row(s))" in err and rows > 0, err
    assert twins[:2] == ["tenants", "fleet_tenants"]


def test_a_sender_faster_than_the_store_gets_503_not_unbounded_memory(tmp_path):
    """The writer's queue is bounded: while it is full (here: the writer thread held on a batch) the
    receiver answers 503 with Retry-After - OTLP exporters back off and retry - and accepts again
    once the writer catches up. Nothing is buffered past the queue, and a 200 comes only once its
    rows are on disk (group commit): the posts queued wait for the writer, then get it."""
    w = SegmentWriter(tmp_path / "store", queue_size=3)
    rx = Receiver(w)
    hold = threading.Event()
    w.submit_lazy(lambda: hold.wait(30) and [])          # the writer thread is busy with this
    while w._q.qsize():                                   # ...once it has taken it off the queue
        time.sleep(0.01)
    body = json.dumps(_otlp_json("0123456789abcdef0123456789abcdef")).encode()
    post = lambda: httpx.post(rx.url + "/v1/traces", content=body, headers={"content-type": "application/json"})  # noqa: E731
    try:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(6) as pool:
            waiting = [pool.submit(post) for _ in range(6)]      # an acknowledgement waits for the disk...
            time.sleep(1.5)
            r = post()                                           # ...and the queue is bounded: 503 at once
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["code"] == 14
            hold.set()
            codes = [f.result().status_code for f in waiting]
        assert 200 in codes and 503 in codes, codes            # one batch and its ticket fit the queue, then 503
        deadline = time.time() + 10
        while w.saturated and time.time() < deadline:
            time.sleep(0.05)
        assert post().status_code == 200
        assert httpx.get(rx.url + "/health").json()["received"]["throttled"] >= 2
    finally:
        hold.set()
        rx.stop()
        w.close()
    # exactly what was acknowledged is in the store
    assert Forensics(tmp_path / "store").con.sql("SELECT count(*) FROM spans").fetchall()[0][0] == codes.count(200) + 1


def _rich_request(spans: int):
    """Spans that exercise every column path: kinds in and out of range, parents, statuses, events and
    links, a repeated key (a dict's way: first place, last value), a token count sent as a string,
    arrays, bytes, a span with no attributes, tenants from the span or else the resource."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in (("service.name", "vllm"), ("service.instance.id", "gpu-3"), ("tenant.id", "res-tenant")):
        rs.resource.attributes.append(KeyValue(key=k, value=AnyValue(string_value=v)))
    ss = rs.scope_spans.add()
    ss.scope.name = "vllm.llm_engine"
    for i in range(spans):
        j = i % 5
        sp = ss.spans.add(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"), name="llm_request",
                          kind=9 if j == 4 else j, start_time_unix_nano=10**18 + i,
                          end_time_unix_nano=10**18 + i + (-5 if j == 1 else 1000))
        if j == 2:
            sp.parent_span_id = b"\x01" * 8
            sp.status.code, sp.status.message = 2, "boom"
        if j == 3:
            sp.events.add(time_unix_nano=5, name="first_token")
            sp.links.add(trace_id=b"\x07" * 16, span_id=b"\x08" * 8)
        kv = [("gen_ai.usage.prompt_tokens", AnyValue(int_value=100 + i)),
              ("gen_ai.usage.input_tokens", AnyValue(string_value="7") if j == 4 else AnyValue(int_value=5 + i)),
              ("gen_ai.latency.time_to_first_token", AnyValue(double_value=0.25)),
              ("gen_ai.response.id", AnyValue(string_value=f"cmpl-{i}")), ("flag", AnyValue(bool_value=True)),
              ("arr", AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="x")]))),
              ("raw", AnyValue(bytes_value=b"\xff\x00"))]
        if j % 2:
            kv.append(("tenant.id", AnyValue(string_value=f"t{j}")))
        if j == 0:
            kv = kv[:2] + [("gen_ai.usage.prompt_tokens", AnyValue(int_value=999))]
        if j == 1:
            kv = []
        for k, v in kv:
            sp.attributes.append(KeyValue(key=k, value=v))
    return req


def test_span_rows_map_every_column_path():
    from telemetry.receivers.otlp import span_rows
    t = span_rows(_rich_request(5), "boot-1", lambda s: "h:" + s, "tenant.id", None).to_pylist()
    assert [r["SpanKind"] for r in t] == ["SPAN_KIND_UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "9"]
    assert [r["Duration"] for r in t] == [1000, 0, 1000, 1000, 1000]          # an end before its start: 0
    assert t[0]["TraceId"] == "0" * 32 and t[2]["ParentSpanId"] == "01" * 8 and t[0]["ParentSpanId"] == ""
    assert (t[2]["StatusCode"], t[2]["StatusMessage"], t[0]["StatusCode"]) == ("ERROR", "boom", "UNSET")
    assert t[3]["Events.Name"] == ["first_token"] and t[3]["Links.SpanId"] == ["08" * 8] and t[0]["Events.Name"] == []
    assert t[0]["SpanAttributes"] == [("gen_ai.usage.prompt_tokens", "999"), ("gen_ai.usage.input_tokens", "5")]
    assert t[1]["SpanAttributes"] == [] and t[1]["input_tokens"] is None and t[1]["operation"] is None
    assert dict(t[2]["SpanAttributes"])["arr"] == "1,x" and dict(t[2]["SpanAttributes"])["raw"] == "ff00"
    assert dict(t[2]["SpanAttributes"])["flag"] == "True"
    # the current name wins over vLLM's older one; a count sent as a string is still a count
    assert [r["input_tokens"] for r in t] == [5, None, 7, 8, 7]
    assert [r["ttft_s"] for r in t] == [None, None, 0.25, 0.25, 0.25]
    assert [r["request_id"] for r in t] == [None, None, "cmpl-2", "cmpl-3", "cmpl-4"]
    assert [r["tenant_h"] for r in t] == ["h:res-tenant", "h:res-tenant", "h:res-tenant", "h:t3", "h:res-tenant"]
    assert {r["node"] for r in t} == {"gpu-3"} and {r["ServiceName"] for r in t} == {"vllm"}
    assert dict(t[0]["ResourceAttributes"])["service.instance.id"] == "gpu-3"


def test_big_bodies_decode_in_a_worker_process_to_the_same_rows(tmp_path):
    """A body over 64 KiB goes to the decoder process; a small one stays on the event loop; the
    store gets the same rows either way, tenants pseudonymised by the parent (the key never
    leaves it)."""
    from telemetry.receivers.otlp import span_rows
    w = SegmentWriter(tmp_path / "store")
    rx = Receiver(w, decode_workers=1)
    big, small = _rich_request(700), _rich_request(5)
    assert len(big.SerializeToString()) >= 64 << 10 > len(small.SerializeToString())
    with httpx.Client() as c:
        for req in (big, small):
            r = c.post(rx.url + "/v1/traces", content=req.SerializeToString(),
                       headers={"content-type": "application/x-protobuf"}, timeout=60)
            assert r.status_code == 200, r.text
        health = c.get(rx.url + "/health").json()
    rx.stop()
    w.close()
    assert health["decoded_in_workers"] == 1
    got = Forensics(tmp_path / "store").con.sql(
        'SELECT "SpanId", input_tokens, tenant_h, request_id FROM spans ORDER BY "SpanId", input_tokens').fetchall()
    want = [span_rows(req, w.boot, w.keys.pseudonym, "tenant.id", None) for req in (big, small)]
    want = sorted((r["SpanId"], r["input_tokens"], r["tenant_h"], r["request_id"])
                  for t in want for r in t.to_pylist())
    key = lambda r: (r[0], -1 if r[1] is None else r[1])  # noqa: E731
    assert sorted(got, key=key) == sorted(want, key=key) and len(got) == 705
    assert not any(r[2] and "tenant" in r[2] for r in got)


_H = bytes(range(32))


@pytest.mark.parametrize("payload,bad,check", [
    ({"ts": 1.5, "events": [{"type": "BlockStored", "block_hashes": [_H], "parent_block_hash": None,
                             "token_ids": list(range(300)), "block_size": 16, "medium": "GPU"}]}, 0,
     [{"kind": "BlockStored", "block_hashes": [_H.hex()], "token_count": 300, "medium": "GPU", "block_size": 16}]),
    ([2.0, [["BlockStored", [7, 2**63 + 1], 5, [1, 2], 16, None], ["BlockRemoved", [7]], ["AllBlocksCleared"]], 3], 0,
     [{"kind": "AllBlocksCleared", "block_hashes": []},
      {"kind": "BlockRemoved", "block_hashes": ["7"], "dp_rank": 3},
      {"kind": "BlockStored", "block_hashes": ["7", str(2**63 + 1)], "parent_hash": "5", "token_count": 2}]),
    # a field vLLM does not send, of a shape the typed path does not know: the generic reader takes the batch
    ({"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": [_H], "group_idx": 2, "extra": {"x": 1}}]}, 0,
     [{"kind": "BlockRemoved", "group_idx": 2, "token_count": None}]),
    ({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [_H], "token_ids": 5}]}, 1, []),
    (b"\xc1 not msgpack", 1, []),
    ({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": ["not-a-hash"]}]}, 1, []),
    # an event type this reader does not know: skipped and counted by itself, the rest of the batch lands
    ({"ts": 1, "events": [{"type": "BlockEvicted", "block_hashes": [_H]}, {"type": "BlockRemoved", "block_hashes": [_H]}]},
     0, [{"kind": "BlockRemoved", "block_hashes": [_H.hex()]}]),
    ({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [_H], "block_size": "sixteen"}]}, 1, []),
    # hostile shapes: each is one unreadable batch (or lands without its odd field), never a dead subscriber
    ({"ts": 1, "events": [{"type": ["BlockStored"], "block_hashes": [_H]}]}, 1, []),
    ({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [_H], "extra_keys": {"salt": "s"}}]}, 0,
     [{"kind": "BlockStored", "scope_h": None}]),
    ({"ts": 1e300, "events": [{"type": "BlockRemoved", "block_hashes": [_H]}]}, 1, []),
    ({"ts": float("nan"), "events": [{"type": "BlockRemoved", "block_hashes": [_H]}]}, 1, []),
    ({"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": [_H]}], "data_parallel_rank": -5}, 1, []),
    ({"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [True]}]}, 1, []),
    # SGLang's shape: [ts, events, attn_dp_rank], tagged events with cache_salt; signed int64 hashes as sent
    ([3.0, [{"type": "BlockStored", "block_hashes": [-(2**63), 2**63 - 1], "parent_block_hash": -7, "token_ids": [1],
             "block_size": 1, "lora_id": None, "cache_salt": "tenant-a-salt", "session_id": "sess-1"}], 0], 0,
     [{"kind": "BlockStored", "block_hashes": [str(-(2**63)), str(2**63 - 1)], "parent_hash": "-7", "lora": None}]),
    # positional, SGLang's field order: the seventh field is its cache_salt, never the lora column
    ([3.0, [["BlockStored", [5], None, [1], 1, None, "GPU", "tenant-b-salt", "sess-2"]], 0], 0,
     [{"kind": "BlockStored", "block_hashes": ["5"], "lora": None, "medium": "GPU"}]),
], ids=["tagged-map", "array-like-int-hashes", "unknown-field", "token-ids-not-a-list", "not-msgpack",
        "str-hash", "unknown-event", "size-as-text", "type-is-a-list", "extra-keys-a-map", "ts-1e300", "ts-nan",
        "negative-dp-rank", "bool-hash", "sglang-map", "sglang-positional"])
def test_kv_event_batches_decode_or_count_as_bad(tmp_path, payload, bad, check):
    """The typed fast path, the generic fallback, and what neither reads (counted, never a crash)."""
    w = SegmentWriter(tmp_path / "store")
    sub = KVEventSubscriber(w, "tcp://127.0.0.1:1", instance="gpu-0")
    sub._ingest("kv", 0, payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload))
    sub.stop()
    w.close()
    got = Forensics(tmp_path / "store").con.sql("SELECT * FROM kv_events ORDER BY kind").pl().to_dicts()
    assert (len(got), sub.bad, sub.batches) == (len(check), bad, 1 - bad), (got, sub.bad, sub.errors)
    for row, want in zip(got, check):
        assert {k: row[k] for k in want} == want
    assert sub.unknown == ({"BlockEvicted": 1} if "BlockEvicted" in str(payload) else {})
    if "-salt" in str(payload):             # a salt is a scope, in every shape, and never stored in clear
        assert got[0]["scope_h"] is not None
        raw = b"".join(f.read_bytes() for f in (tmp_path / "store").rglob("*") if f.is_file())
        assert b"tenant-a-salt" not in raw and b"tenant-b-salt" not in raw and b"sess-" not in raw
    if check:       # hex hashes: zstd (LZ4 cannot shrink hex), no dictionary (they do not repeat); the rest LZ4
        import pyarrow.parquet as pq
        rg = pq.ParquetFile(next((tmp_path / "store" / "segments" / "kv_events").glob("*.parquet"))).metadata.row_group(0)
        cols = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
        assert cols["block_hashes.list.element"].compression == "ZSTD" == cols["parent_hash"].compression
        assert "RLE_DICTIONARY" not in cols["block_hashes.list.element"].encodings
        assert cols["kind"].compression == "LZ4"


def test_a_restarted_or_renumbered_publisher_is_a_new_epoch_and_nothing_is_dropped(tmp_path):
    """vLLM and SGLang count batches from 0 in each process: a restart on the same endpoint (and an
    absurd jump) starts an epoch, recorded; the new engine's batches land; a real gap is still a gap.
    (The real publishers' restart runs in the interop tier: tests/interop/test_sglang.py.)"""
    w = SegmentWriter(tmp_path / "store")
    sub = KVEventSubscriber(w, "tcp://127.0.0.1:1", instance="gpu-0")
    batch = lambda i: _new([{"type": "BlockRemoved", "block_hashes": [bytes([i]) * 32]}])  # noqa: E731
    for seq in (0, 1, 2, 0, 1, 2**63 - 1, 5, 7):
        sub._frame([b"kv", seq.to_bytes(8, "big"), batch(seq % 256)])
    sub._frame([b"kv", (-3).to_bytes(8, "big", signed=True), batch(1)])       # negative: unreadable, not an epoch
    sub._frame([b"kv", b"\x00" * 8])                                           # two frames: unreadable
    sub.stop()
    w.close()
    assert (sub.batches, sub.bad, sub.epoch) == (8, 2, 3)
    assert [e[1:] for e in sub.epochs] == [(2, 0), (1, 2**63 - 1), (2**63 - 1, 5)]
    assert sub.gaps == [(6, 6, False)]                                         # 5 -> 7 lost one batch
    fx = Forensics(tmp_path / "store")
    rows = fx.con.sql("SELECT epoch, seq FROM kv_events ORDER BY epoch, seq").fetchall()
    assert rows == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 2**63 - 1), (3, 5), (3, 7)]
    gaps = fx.con.sql("SELECT items, filled, note FROM telemetry_gaps ORDER BY detected_at").fetchall()
    assert [(g[0], g[1]) for g in gaps] == [(0, True), (0, True), (0, True), (1, False)]
    assert "went back, from 2 to 0" in gaps[0][2] and "a renumbering" in gaps[1][2]
    assert "3 restart(s)" in sub.summary() and "2 unreadable" in sub.summary()


def test_a_fast_answer_is_a_possible_cache_hit_unless_ruled_out_and_the_tenant_comes_through_the_trace(tmp_path):
    """vLLM's spans carry neither a cached-token count nor a tenant: a fast answer is "cache hit
    possible" (not a skipped prefill) where no count and no scrape rule a hit out, or where the
    scraped counter rose; a gateway span's tenant reaches the engine's span through the trace."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from telemetry.receivers.prometheus import Sample, metric_table
    store = tmp_path / "store"
    w = SegmentWriter(store)
    rx = Receiver(w)
    exporters = []

    def tracer(service: str, instance: str):
        p = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}))
        p.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=rx.url + "/v1/traces")))
        exporters.append(p)
        return p.get_tracer(service)
    gateway, engines = tracer("gateway", "gw-0"), {n: tracer("vllm", n) for n in ("quiet", "scraped")}
    hits = {"scraped": 0.0}

    def scrape() -> None:
        w.submit("metrics", metric_table([Sample("vllm:prefix_cache_hits", "counter", "vllm:prefix_cache_hits_total",
                                                 {"engine": "0"}, hits["scraped"])], time.time_ns(), "scraped"))
    scrape()
    rnd = random.Random(3)
    for name, engine in engines.items():
        for i in range(30):
            n = rnd.randint(100, 1000)
            fast = i in (7, 19)                       # answered at the floor: a cache hit, or a skipped prefill?
            with gateway.start_as_current_span("POST /v1/completions") as g:
                g.set_attribute("tenant.id", "tenant-b" if fast else "tenant-a")
                with engine.start_as_current_span("llm_request", context=trace.set_span_in_context(g)) as sp:
                    sp.set_attributes({"gen_ai.usage.prompt_tokens": n, "gen_ai.request.id": f"{name}-{i}",
                                       "gen_ai.latency.time_to_first_token": 0.01 if fast else 0.01 + 1e-4 * n})
            if name == "scraped" and fast:
                hits["scraped"] += n                  # the counter rose across this request
                time.sleep(0.01)
                scrape()
                time.sleep(0.01)
    scrape()
    for p in exporters:
        p.shutdown()
    rx.stop()
    w.close()
    fx = Forensics(store)
    ttft = fx.query("fleet_ttft")
    assert not ttft["below_floor"].any()
    possible = ttft.filter(ttft["cache_hit_possible"])
    assert sorted(possible["request_id"]) == ["quiet-19", "quiet-7", "scraped-19", "scraped-7"]
    assert set(possible.filter(possible["instance"] == "quiet")["cache_evidence"]) == {"unknown"}
    assert set(possible.filter(possible["instance"] == "scraped")["cache_evidence"]) == {"hits rose"}
    b = w.keys.pseudonym("tenant-b")
    assert set(possible["tenant_h"]) == {b} and ttft["tenant_h"].null_count() == 0     # through the trace
    tenants = fleet_query(fx, "fleet_tenants")
    assert sorted(tenants.select("tenant_h", "requests").rows()) == sorted([(b, 4), (w.keys.pseudonym("tenant-a"), 56)])


def _hwm_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_the_receivers_memory_stays_bounded_under_a_bomb_and_a_100_mb_body(tmp_path):
    """`kvledger collect` as run: a 160 MiB gzip bomb (160 KB on the wire), a 100 MB body declared
    up front and one streamed without a length: 413 each, and the receiver's peak RSS grows by less
    than 64 MiB over its idle peak; it then still takes a good body."""
    from tests.interop.peers import Collect       # kvledger collect as run (no peer needed)
    collect = Collect(tmp_path / "store", [], tmp_path / "collect.log")
    proc, url = collect.proc, f"http://127.0.0.1:{collect.http_port}/v1/traces"
    try:
        good = json.dumps(_otlp_json("0123456789abcdef0123456789abcdef")).encode()
        assert httpx.post(url, content=good, headers={"content-type": "application/json"}).status_code == 200
        idle = _hwm_mib(proc.pid)
        bomb = _bomb(160 << 20)
        r = httpx.post(url, content=bomb, headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 413 and "inflates past" in r.text, r.text
        big = bytes(100 << 20)

        def stream():
            for i in range(0, len(big), 1 << 20):
                yield big[i:i + (1 << 20)]
        for content, why in ((big, "is over the"), (stream(), "over the")):
            try:
                r = httpx.post(url, content=content, headers={"content-type": "application/x-protobuf"}, timeout=60)
                assert r.status_code == 413 and why in r.text, r.text
            except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
                pass                  # refused before the client finished sending: the server closed on it
        grown = _hwm_mib(proc.pid) - idle
        assert grown < 64, f"peak RSS grew by {grown:.0f} MiB"
        assert httpx.post(url, content=good, headers={"content-type": "application/json"}).status_code == 200
    finally:
        log = collect.stop()
    assert proc.returncode == 0, log


def test_a_full_disk_is_never_acknowledged_and_health_says_why(tmp_path, monkeypatch):
    """The store's disk fills (fsync raises ENOSPC): the post whose write fails is a 503, not a 200
    whose spans are then lost (issue 32: 11 such posts got 200); from then on OTLP posts over HTTP and gRPC get
    503 / UNAVAILABLE naming it (senders retry; nothing more is acknowledged), /health answers 503
    with the reason, and closing reports the failure as one StoreError - never a 500 or a traceback."""
    import errno

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    from telemetry.errors import StoreError
    from telemetry.receivers.otlp_grpc import serve_grpc
    w = SegmentWriter(tmp_path / "store")
    rx = Receiver(w)
    gsrv, gport, counts = serve_grpc(w, "127.0.0.1", 0)
    body = json.dumps(_otlp_json("0123456789abcdef0123456789abcdef")).encode()
    post = lambda: httpx.post(rx.url + "/v1/traces", content=body, headers={"content-type": "application/json"})  # noqa: E731
    try:
        assert post().status_code == 200
        w.flush()                                          # that one is durable

        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", full)
        lost = post()                                      # its write fails: never acknowledged (group commit)
        assert lost.status_code == 503 and "No space left" in lost.json()["message"]
        with pytest.raises(StoreError, match="No space left"):
            w.flush()
        r = post()
        assert r.status_code == 503 and "cannot be written" in r.json()["message"] and r.headers["retry-after"]
        h = httpx.get(rx.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "failing" and "No space left" in h.json()["store_error"]
        with grpc.insecure_channel(f"127.0.0.1:{gport}") as ch:
            stub = trace_service_pb2_grpc.TraceServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "cannot be written" in e.value.details()
        assert rx.app.state.received["store_failed"] == 2 and counts["store_failed"] == 1
    finally:
        gsrv.stop(0)
        rx.stop()
        monkeypatch.undo()
        with pytest.raises(StoreError):
            w.close()


def test_spans_from_the_real_sdk_grpc_exporter_land_with_the_tenant_from_metadata(tmp_path):
    """OTLP over gRPC, as vLLM exports by default: the OpenTelemetry SDK's own gRPC exporter into the
    receiver on a loopback port; the tenant from a metadata key (--tenant-header), pseudonymised."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from telemetry.receivers.otlp_grpc import serve_grpc
    w = SegmentWriter(tmp_path / "store")
    server, port, counts = serve_grpc(w, "127.0.0.1", 0, tenant_attribute=None, tenant_header="x-tenant")
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "service.instance.id": "gpu-9"}))
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=f"http://127.0.0.1:{port}", insecure=True, headers={"x-tenant": "acme"})))
        tracer = provider.get_tracer("vllm")
        for i in range(3):
            with tracer.start_as_current_span("llm_request") as sp:
                sp.set_attributes({"gen_ai.usage.prompt_tokens": 100 + i, "gen_ai.request.id": f"cmpl-g{i}",
                                   "gen_ai.latency.time_to_first_token": 0.01})
        provider.shutdown()
    finally:
        server.stop(0)
        w.close()
    assert counts["spans"] == 3
    df = Forensics(tmp_path / "store").con.sql("SELECT request_id, input_tokens, node, tenant_h FROM spans "
                                               "ORDER BY request_id").pl()
    assert df["request_id"].to_list() == ["cmpl-g0", "cmpl-g1", "cmpl-g2"] and df["input_tokens"].to_list() == [100, 101, 102]
    assert set(df["node"]) == {"gpu-9"} and df["tenant_h"].n_unique() == 1 and "acme" not in df["tenant_h"].to_list()
