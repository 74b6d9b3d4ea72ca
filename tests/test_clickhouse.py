"""The store and every forensic query on ClickHouse (issue 22), through embedded ClickHouse (chdb):
the same stores the DuckDB tests use, the same answers row for row; the DDL generated from
schema.sql; the export idempotent and resumable; a two-shard split whose union is the whole; spans
read in place from a Collector-shaped ``otel_traces`` table."""
from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import shutil

import pytest
from polars.testing import assert_frame_equal

from forensics.queries.duckdb import Forensics, QUERIES
from telemetry.recorder import recording
from engine.commands.main import main
from forensics.queries.catalog import QUERIES as FORENSIC_QUERIES
from forensics.queries.fleet import query as named_query
from forensics.queries.clickhouse import ClickHouseForensics
from dashboard.data import UNORDERED
from telemetry.store.chain import read_chain
from telemetry.clickhouse import ClickHouseError, columns, connect, ddl, export, follow, layouts
from telemetry.store.schema import arrow_schemas
from telemetry.store import SegmentWriter, open_store
from tests.conftest import rewrite_store

CHDB = os.environ["KVLEDGER_CHDB_PATH"]          # this test process's embedded ClickHouse (conftest)
ALL = list(FORENSIC_QUERIES)
assert set(QUERIES) <= set(ALL)


def kind(t: pl.DataType) -> str:
    """A column type up to width: ClickHouse counts in UInt64 where DuckDB uses BIGINT, etc."""
    if t == pl.Boolean:
        return "bool"
    if t.is_integer():
        return "int"
    if t.is_float():
        return "float"
    if t == pl.Datetime:
        return f"datetime[{t.time_unit}]"
    if t == pl.List:
        return f"list[{kind(t.inner)}]"
    return str(t.base_type())


def same(a: pl.DataFrame, b: pl.DataFrame, what: str, ordered: bool = True) -> None:
    assert a.columns == b.columns, f"{what}: columns differ"
    assert [kind(t) for t in a.dtypes] == [kind(t) for t in b.dtypes], f"{what}: {a.dtypes} vs {b.dtypes}"
    if not ordered:
        a, b = a.sort(a.columns, nulls_last=True), b.sort(a.columns, nulls_last=True)
    assert_frame_equal(a, b, check_dtypes=False, rel_tol=1e-9, abs_tol=1e-12)


def assert_engines_agree(store: Path, run: str | None = None) -> dict[str, int]:
    """Every named query, and the two materialised tables, on DuckDB and on chdb: equal, row for row."""
    d = Forensics(store, run)
    c = ClickHouseForensics(store, run)
    try:
        rows, answers = {}, {}
        for name in ALL:
            a, b = named_query(d, name), named_query(c, name)     # fleet_tenants: from two queries
            same(a, b, name)
            rows[name], answers[name] = a.height, a
        # the dashboard's queries without their closing ORDER BY (dashboard.data.UNORDERED): the same rows
        for name in UNORDERED:
            for fx in (d, c):
                same(fx.queries([name], unordered=(name,))[name], answers[name], f"{name} unordered on {fx.engine}",
                     ordered=False)
        # the dashboard banner's count of served requests (not a command): ttft's rows, on both engines
        same(d.query("served"), c.query("served"), "served")
        assert d.query("served")["served"][0] == rows["ttft"]
        same(d.exposure_slots(), c.exposure_slots(), "exposure_slots", ordered=False)
        same(d.requests(), c.requests(), "requests", ordered=False)
        same(d.page_ledgers(), c.page_ledgers(), "page_ledgers")        # a command's coverage warning
        # whether a ledger command's note runs the fleet twin: a foreign request span in the window
        assert d.foreign_requests() is c.foreign_requests() is (rows["fleet_ttft"] > 0)
        far = dt.datetime(2200, 1, 1)
        assert d.foreign_requests(far, far) is c.foreign_requests(far, far) is False
        assert d.indexed and c.indexed          # both answered from the exposure index; the join agrees on both
        j = ClickHouseForensics(store, run, use_index=False)
        try:
            same(Forensics(store, run, use_index=False).exposure_slots(), j.exposure_slots(), "exposure_slots (join)",
                 ordered=False)
            same(d.exposure_slots(), j.exposure_slots(), "exposure_slots (index vs join)", ordered=False)
        finally:
            j.close()
        return rows
    finally:
        c.close()


@pytest.mark.xdist_group("glm53")
@pytest.mark.parametrize("which", ["glm53_vulnerable", "glm53_hardened"])     # unified: offload_race (mixed store)
def test_clickhouse_answers_every_query_as_duckdb_does_on_the_incident(which, request):
    res, store = request.getfixturevalue(which)
    rows = assert_engines_agree(store)
    assert rows["ttft"] > 0 and rows["preflight"] > 0
    if which == "glm53_vulnerable":
        assert rows["exposures"] > 0 and rows["impact"] > 0, "the comparison covers real findings"
        # the window rule (a read run overlapping the window) is the same in both dialects
        slots = Forensics(store).exposure_slots()
        run = slots.sort(pl.col("ts_last") - pl.col("ts_first"), descending=True).row(0, named=True)
        t0 = run["ts_first"] + (run["ts_last"] - run["ts_first"]) / 3
        c = ClickHouseForensics(store)
        try:
            for name in ("exposures", "scores", "tenants"):
                a, b = Forensics(store).query(name, t0, t0), c.query(name, t0, t0)
                same(a, b, f"{name} in a window inside one read run")
                assert a.height > 0
            half = slots["ts_first"].min() + (slots["ts_last"].max() - slots["ts_first"].min()) / 2
            a, b = Forensics(store).query("served", None, half), c.query("served", None, half)
            same(a, b, "served in a window")
            assert a["served"][0] == Forensics(store).query("ttft", None, half).height > 0
        finally:
            c.close()
        # ttft's floor leaves out the window's exposed responses - read from exposure_slots on both
        # engines, so a chdb session asked for ttft alone builds no n-gram evidence
        c = ClickHouseForensics(store)
        try:
            for start, end in ((None, None), (None, half), (half, None)):
                same(Forensics(store).query("ttft", start, end), c.query("ttft", start, end), f"ttft in [{start}, {end}]")
            assert "exposure_slots" in c._made and "exposure_ngrams" not in c._made, c._made
        finally:
            c.close()


@pytest.mark.xdist_group("runs")
def test_clickhouse_answers_as_duckdb_on_a_store_of_many_runs_and_on_each_run(mixed):
    store, results = mixed
    rows = assert_engines_agree(store)
    assert rows["runs"] == len(results) and rows["exposures"] > 0
    boots = Forensics(store).query("runs")["boot"].to_list()
    assert_engines_agree(store, run=boots[1][:10])      # --run with a prefix, as a person types it


@pytest.fixture(scope="session")
def other_faults(tmp_path_factory):
    """The bug family's faults the mixed store does not hold, both policies, in one store."""
    from engine.replay.faults import FAULTS, run_fault
    from tests.conftest import MIXED
    store = tmp_path_factory.mktemp("other-faults")
    names = [n for n in FAULTS if n not in {m for m, _ in MIXED}]
    for name in names:
        for policy in ("vulnerable", "hardened"):
            run_fault(name, policy, recorder=recording(str(store), flush_interval=0.2))
    return store, names


@pytest.mark.xdist_group("runs")
def test_clickhouse_answers_as_duckdb_on_the_rest_of_the_bug_family(other_faults):
    store, names = other_faults
    rows = assert_engines_agree(store)
    assert len(names) == 3 and rows["runs"] == 6 and rows["exposures"] > 0


# ---- a foreign fleet: spans, KV events, logs, gaps, probes ---------------------------------------
def _otlp_request(n: int = 44):
    """vLLM-named request spans as an OTLP export request: healthy TTFT growing with the prompt,
    and every 11th an over-pool prompt answered at the floor (the incident)."""
    import random

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    def kv(k, v):
        val = AnyValue(int_value=v) if isinstance(v, int) else AnyValue(double_value=v) if isinstance(v, float) \
            else AnyValue(string_value=v)
        return KeyValue(key=k, value=val)

    rnd, spans, incident = random.Random(7), [], set()
    t0 = 1_790_000_000_000_000_000
    for i in range(n):
        tokens = rnd.randint(1300, 2000) if i % 11 == 5 else rnd.randint(40, 1100)
        ttft = 0.012 * rnd.uniform(0.9, 1.1) if tokens > 1200 else (0.01 + 1e-4 * tokens) * rnd.uniform(0.9, 1.1)
        if tokens > 1200:
            incident.add(f"cmpl-{i}")
        start = t0 + i * 50_000_000
        spans.append(Span(trace_id=i.to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"), name="llm_request",
                          kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=start, end_time_unix_nano=start + 90_000_000,
                          attributes=[kv("gen_ai.usage.prompt_tokens", tokens), kv("gen_ai.usage.completion_tokens", 8),
                                      kv("gen_ai.latency.time_to_first_token", ttft),
                                      kv("gen_ai.request.id", f"cmpl-{i}")]))
        if i in (3, 16):       # a gateway's span in the same trace names the tenant the engine's span lacks
            spans.append(Span(trace_id=i.to_bytes(16, "big"), span_id=(1000 + i).to_bytes(8, "big"), name="gateway",
                              kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=start - 1000,
                              end_time_unix_nano=start + 95_000_000, attributes=[kv("tenant.id", f"tenant-{i}")]))
    res = [kv("service.name", "vllm"), kv("service.instance.id", "gpu-7")]
    req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource={"attributes": res}, scope_spans=[ScopeSpans(scope={"name": "vllm"}, spans=spans)])])
    return req, incident


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from telemetry.receivers.otlp import span_rows
    store = tmp_path_factory.mktemp("fleet") / "store"
    log = store.parent / "gpu-7.log"
    log.write_text("INFO 09-01 10:03:02 [kv_cache_utils.py:634] GPU KV cache size: 1,200 tokens\n"
                   "INFO 09-01 10:03:02 [kv_cache_utils.py:637] Maximum concurrency for 2,048 tokens per request: 0.59x\n")
    assert main(["ingest-logs", str(log), "--engine", "vllm", "--store", str(store)]) == 0
    root = Path(__file__).resolve().parent
    assert main(["ingest-logs", str(root / "fixtures" / "sglang_detectors.log"), "--engine", "sglang",
                 "--store", str(store), "--instance", "sglang-0"]) == 0
    req, incident = _otlp_request()
    w = SegmentWriter(store)
    w.submit("spans", span_rows(req, w.boot, w.keys.pseudonym, "tenant.id", None))
    from telemetry.receivers.prometheus import Sample, metric_table
    for at, hits in ((-1.0, 0.0), (1.0, 100.0), (10.0, 100.0)):     # gpu-7's scraped hit counter: rose, then not
        w.submit("metrics", metric_table([Sample("vllm:prefix_cache_hits", "counter", "vllm:prefix_cache_hits_total",
                                                 {"engine": "0"}, hits)], 1_790_000_000_000_000_000 + int(at * 1e9),
                                         "gpu-7"))
    ts = pa.array([1_790_000_000_000_000_000 + i for i in range(4)], pa.timestamp("ns"))
    w.submit("kv_events", pa.table({
        "instance": ["gpu-7"] * 4, "topic": ["kv"] * 4, "epoch": pa.array([0] * 4, pa.int32()), "seq": pa.array([1, 2, 3, 5], pa.int64()), "ts": ts,
        "dp_rank": pa.array([0] * 4, pa.int32()), "kind": ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"],
        "block_hashes": [["aa", "bb"], ["aa"], ["bb"], ["cc"]], "parent_hash": [None, None, None, "aa"],
        "token_count": pa.array([32, 16, None, 16], pa.int32()), "block_size": pa.array([16] * 4, pa.int32()),
        "lora": [None] * 4, "medium": ["GPU"] * 4, "group_idx": pa.array([0] * 4, pa.int32()),
        "scope_h": ["s1", "s2", None, "s1"]}))
    w.submit("telemetry_gaps", pa.table({
        "instance": ["gpu-7"], "source": ["kv_events"], "first_missing": pa.array([4], pa.int64()),
        "last_missing": pa.array([4], pa.int64()), "items": pa.array([1], pa.int64()), "filled": [False],
        "detected_at": ts[:1], "note": ["no replay socket"]}))
    w.submit("probe_runs", pa.table({
        "boot": ["p1", "p1"], "ts": ts[:2], "base_url": ["http://x/v1"] * 2, "model": ["m"] * 2,
        "tenant_a_h": ["a"] * 2, "tenant_b_h": ["b"] * 2, "pool_tokens": pa.array([1200] * 2, pa.int64()),
        "context_length": pa.array([2048] * 2, pa.int64()), "discovered_from": ["server_info"] * 2,
        "check_name": ["limits", "canary"], "verdict": ["finding", "pass"], "detail": ["over pool", "none"],
        "requests": pa.array([9, 9], pa.int32())}))
    w.submit("probe_findings", pa.table({
        "boot": ["p1"], "check_name": ["limits"], "response_id": ["cmpl-1"], "prompt_tokens": pa.array([1900], pa.int64()),
        "canary_h": [None], "why": ["accepted over pool"], "evidence": ["{}"]}))
    w.close()
    return store, req, incident


def test_clickhouse_answers_as_duckdb_on_a_foreign_fleet_store(fleet):
    store, _, incident = fleet
    rows = assert_engines_agree(store)
    for name in ("fleet_ttft", "fleet_impact", "canary", "cache_scopes", "gaps", "probes"):
        assert rows[name] > 0, f"{name}: the comparison covers rows"
    assert rows["fleet_impact"] == len(incident) == 4
    ttft = Forensics(store).query("fleet_ttft")      # every kind of cache evidence is in the comparison
    assert set(ttft["cache_evidence"]) == {"hits rose", "no hits"} and ttft["tenant_h"].null_count() == 42


def test_span_queries_read_a_collector_otel_traces_table_in_place(fleet):
    """--spans-table: the same spans as the Collector's ClickHouse exporter stores them (its DDL's
    columns; attribute values as strings) answer fleet_ttft and fleet_impact exactly as the store's
    own spans do."""
    store, req, incident = fleet
    target = connect(f"chdb:{CHDB}?db=otel")
    target.command("CREATE DATABASE IF NOT EXISTS otel")
    target.command("""CREATE TABLE IF NOT EXISTS otel.otel_traces (
        Timestamp DateTime64(9), TraceId String, SpanId String, ParentSpanId String, TraceState String,
        SpanName LowCardinality(String), SpanKind LowCardinality(String), ServiceName LowCardinality(String),
        ResourceAttributes Map(LowCardinality(String), String), ScopeName String, ScopeVersion String,
        SpanAttributes Map(LowCardinality(String), String), Duration UInt64, StatusCode LowCardinality(String),
        StatusMessage String,
        Events Nested (Timestamp DateTime64(9), Name LowCardinality(String), Attributes Map(LowCardinality(String), String)),
        Links Nested (TraceId String, SpanId String, TraceState String, Attributes Map(LowCardinality(String), String))
    ) ENGINE = MergeTree PARTITION BY toDate(Timestamp) ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))""")
    rs = req.resource_spans[0]
    res = {a.key: a.value.string_value for a in rs.resource.attributes}
    rows = []
    for sp in rs.scope_spans[0].spans:
        attrs = {a.key: str(getattr(a.value, a.value.WhichOneof("value"))) for a in sp.attributes}
        rows.append({"Timestamp": sp.start_time_unix_nano, "TraceId": sp.trace_id.hex(), "SpanId": sp.span_id.hex(),
                     "ParentSpanId": "", "TraceState": "", "SpanName": sp.name, "SpanKind": "Server",
                     "ServiceName": res["service.name"], "ResourceAttributes": list(res.items()), "ScopeName": "vllm",
                     "ScopeVersion": "", "SpanAttributes": list(attrs.items()),
                     "Duration": sp.end_time_unix_nano - sp.start_time_unix_nano, "StatusCode": "Unset",
                     "StatusMessage": ""})
    m = pa.map_(pa.string(), pa.string())
    t = pa.Table.from_pylist(rows, schema=pa.schema([
        ("Timestamp", pa.timestamp("ns")), ("TraceId", pa.string()), ("SpanId", pa.string()), ("ParentSpanId", pa.string()),
        ("TraceState", pa.string()), ("SpanName", pa.string()), ("SpanKind", pa.string()), ("ServiceName", pa.string()),
        ("ResourceAttributes", m), ("ScopeName", pa.string()), ("ScopeVersion", pa.string()), ("SpanAttributes", m),
        ("Duration", pa.uint64()), ("StatusCode", pa.string()), ("StatusMessage", pa.string())]))
    target.insert_arrow("otel_traces", t, token="otel-fixture")
    d = Forensics(store)
    c = ClickHouseForensics(store, spans_table="otel.otel_traces")
    try:
        for name in ("fleet_ttft", "fleet_impact"):
            a, b = named_query(d, name), named_query(c, name)     # fleet_tenants: from two queries
            same(a.drop("tenant_h"), b.drop("tenant_h"), name)     # the Collector keeps no tenant here: NULL both
        assert set(b["request_id"]) == incident
        assert d.foreign_requests() is c.foreign_requests() is True      # the Collector's table, bound as spans
    finally:
        c.close()


# ---- the DDL -----------------------------------------------------------------------------------
def test_the_ddl_is_generated_from_schema_sql_and_parses_as_clickhouse():
    assert set(layouts()) == set(arrow_schemas())
    for table, cols in columns().items():
        assert [c for c, _ in cols] == arrow_schemas()[table].names
        types = dict(cols)
        key = layouts()[table]["ORDER BY"]
        for col in (c for c in types if f"{c}," in key + "," or f"({c}," in key or f" {c})" in key):
            assert not types[col].startswith("Nullable"), f"{table}.{col} is in the sorting key and nullable"
    # a page's reads and writes land on one shard: the exposure join never crosses shards
    assert layouts()["page_reads"]["SHARD BY"] == layouts()["page_writes"]["SHARD BY"] == "cityHash64(node, boot, page)"
    single, cluster = ddl("kv"), ddl("kv", cluster="prod")
    assert all("ON CLUSTER" not in s for s in single) and all("ON CLUSTER `prod`" in s for s in cluster)
    assert "ENGINE = Distributed(`prod`, `kv`, `page_reads_local`, cityHash64(node, boot, page))" in "\n".join(cluster)
    assert "'/clickhouse/tables/all/kv/config_snapshots'" in "\n".join(cluster)     # whole on every shard
    t = connect(f"chdb:{CHDB}?db=ddl_check")
    for stmt in cluster:            # the cluster variant needs a cluster to run; ClickHouse's parser checks it
        t.query_arrow("SELECT formatQuery({q:String})", params={"q": stmt})
    for stmt in single:
        t.command(stmt.replace("`kv`", "`ddl_check`"))
    got = t.query_arrow("SELECT name, engine FROM system.tables WHERE database = 'ddl_check'").to_pylist()
    assert {r["name"] for r in got} == set(arrow_schemas()) | {"kvledger_segments"}
    assert {r["engine"] for r in got} == {"MergeTree", "ReplacingMergeTree"}


# ---- export ------------------------------------------------------------------------------------
def _counts(target, tables) -> dict[str, int]:
    return {t: target.query_arrow(f"SELECT count() AS n FROM `{target.database}`.`{t}`").column(0)[0].as_py()
            for t in tables}


@pytest.mark.xdist_group("glm53")
def test_export_is_idempotent_resumes_after_a_crash_and_refuses_another_store(glm53_hardened):
    _, store = glm53_hardened
    fx = Forensics(store)
    want = {t: fx.rows(t) for t in arrow_schemas()}
    chain = read_chain(store)
    target = connect(f"chdb:{CHDB}?db=exp_resume")

    class Crash(Exception):
        pass

    def crash_at_fifth(seq: int) -> None:
        if seq == chain[4].seq:
            raise Crash()
    with pytest.raises(Crash):
        export(store, target, after_insert=crash_at_fifth)      # the 5th segment's rows are in, its record is not
    res = export(store, target)                                  # the re-run inserts it again: ClickHouse drops it
    assert res["segments"] == len(chain) - 4 and res["skipped"] == 4
    assert _counts(target, want) == want
    again = export(store, target)
    assert again["segments"] == 0 and again["skipped"] == len(chain)
    assert _counts(target, want) == want
    # a record of this store's segment 0 with another digest: a different store under the same id
    target.insert_arrow("kvledger_segments", pa.table({
        "store_id": [res["store_id"]], "seq": pa.array([chain[0].seq], pa.int64()), "table": [chain[0].table],
        "file": [chain[0].file], "rows": pa.array([1], pa.int64()), "sha256": ["0" * 64],
        "exported_at": pa.array([time.time_ns()], pa.timestamp("ns", "UTC"))}), token="forged")
    with pytest.raises(ClickHouseError, match="not the store that was exported"):
        export(store, target)


def test_export_follow_copies_a_live_store_as_it_grows(tmp_path):
    store = tmp_path / "live"
    w = SegmentWriter(store, flush_interval=0.05)
    target = connect(f"chdb:{CHDB}?db=exp_follow")
    stop, passes = threading.Event(), []
    th = threading.Thread(target=follow, args=(store, target, 0.05, stop), kwargs={"on_batch": passes.append})
    w.submit("ngrams", pa.table({"incarnation": pa.array([1] * 10, pa.int64()), "role": ["prompt"] * 10,
                                 "n": pa.array([4] * 10, pa.int16()), "hash": pa.array(range(10), pa.int64())}))
    w.flush()
    th.start()
    deadline = time.monotonic() + 60
    for i in range(1, 4):              # the store grows between passes of the running export
        seen = len(passes)
        while len(passes) == seen and time.monotonic() < deadline:
            time.sleep(0.02)
        w.submit("ngrams", pa.table({"incarnation": pa.array([i + 1] * 5, pa.int64()), "role": ["output"] * 5,
                                     "n": pa.array([4] * 5, pa.int16()), "hash": pa.array(range(5), pa.int64())}))
        w.flush()
    w.close()
    while (not passes or _counts(target, ["ngrams"])["ngrams"] < 25) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    th.join(10)
    assert not th.is_alive() and _counts(target, ["ngrams"]) == {"ngrams": 25}
    assert sum(p["segments"] for p in passes) == len(read_chain(store)) and len(passes) >= 4
    assert passes[0]["segments"] >= 1 and sum(p["segments"] for p in passes[1:]) >= 3     # copied as it grew


# ---- shards ------------------------------------------------------------------------------------
@pytest.mark.xdist_group("glm53")
def test_two_shards_split_by_the_sharding_key_answer_the_whole_as_a_union(glm53_vulnerable):
    """The store's rows split into two databases by each table's sharding key (as the cluster
    variant's Distributed tables route them; `everywhere` tables whole in both): the exposure join
    and the per-request table, run on each shard alone, together equal the whole store's answer."""
    _, store = glm53_vulnerable
    whole = ClickHouseForensics(store)
    src = whole.db
    shards = []
    for k in (0, 1):
        t = connect(f"chdb:{CHDB}?db=shard{k}")
        for stmt in ddl(t.database):
            t.command(stmt)
        for table, lay in layouts().items():
            cond = "1" if lay["SHARD BY"] == "everywhere" else f"{lay['SHARD BY']} % 2 = {k}"
            t.command(f"INSERT INTO shard{k}.`{table}` SELECT * FROM `{src}`.`{table}` WHERE {cond}")
        shards.append(ClickHouseForensics(engine="clickhouse", dsn=f"chdb:{CHDB}?db=shard{k}"))
    try:
        for what in ("exposure_slots", "requests"):
            parts = [getattr(s, what)() for s in shards]
            assert all(p.height for p in parts), f"{what}: both shards hold some of it"
            same(getattr(whole, what)(), pl.concat(parts), what, ordered=False)
        reads = [s.rows("page_reads") for s in shards]
        assert sum(reads) == whole.rows("page_reads") and min(reads) > 0
    finally:
        for s in shards + [whole]:
            s.close()


# ---- the command line --------------------------------------------------------------------------
@pytest.mark.xdist_group("glm53")
def test_cli_export_and_forensics_on_chdb_print_what_duckdb_prints(glm53_vulnerable, capsys):
    _, store = glm53_vulnerable
    assert main(["export", "--to", f"chdb:{CHDB}?db=cli_export", "--store", str(store)]) == 0
    err = capsys.readouterr().err
    assert "segment(s)" in err and "0 already there" in err
    assert main(["export", "--to", f"chdb:{CHDB}?db=cli_export", "--store", str(store)]) == 0
    assert "exported 0 segment(s), 0 rows" in capsys.readouterr().err
    outs = {}
    for engine in ("duckdb", "chdb"):
        assert main(["forensics", "scores", "--store", str(store), "--format", "json", "--engine", engine]) == 0
        outs[engine] = json.loads(capsys.readouterr().out)
    assert outs["chdb"] == outs["duckdb"] and outs["duckdb"]
    assert main(["forensics", "tenants", "--engine", "clickhouse", "--dsn", f"chdb:{CHDB}?db=cli_export",
                 "--format", "json"]) == 0
    by_server = json.loads(capsys.readouterr().out)
    assert main(["forensics", "tenants", "--store", str(store), "--format", "json"]) == 0
    assert by_server == json.loads(capsys.readouterr().out)
    assert main(["export", "--print-ddl", "--cluster", "prod"]) == 0
    assert "ENGINE = Distributed(`prod`" in capsys.readouterr().out


BAD = [
    (["forensics", "runs", "--engine", "clickhouse"], "--engine clickhouse needs --dsn"),
    (["forensics", "runs", "--dsn", "clickhouse://h:8123/db"], "--dsn is for --engine clickhouse"),
    (["forensics", "runs", "--engine", "clickhouse", "--dsn", "mysql://h/db"], "expected clickhouse://"),
    (["forensics", "runs", "--engine", "clickhouse", "--dsn", "clickhouse://h:8123/bad-name"], "letters, digits"),
    (["forensics", "runs", "--engine", "clickhouse", "--dsn", "clickhouse://h:99999/db"], "port must be"),
    (["forensics", "runs", "--engine", "clickhouse", "--dsn", "clickhouse:///db"], "no host"),
    (["forensics", "runs", "--engine", "clickhouse", "--dsn", "clickhouse://127.0.0.1:1/db"], "cannot reach ClickHouse"),
    (["export", "--to", "clickhouse://127.0.0.1:1/db", "--store", "{store}"], "cannot reach ClickHouse"),
    (["forensics", "runs", "--spans-table", "otel_traces"], "--spans-table reads a ClickHouse table"),
    (["forensics", "runs", "--engine", "chdb", "--spans-table", "x; DROP TABLE y"], "expected TABLE or DATABASE.TABLE"),
    (["forensics", "runs", "--chdb-path", "/tmp/x"], "--chdb-path is for --engine chdb"),
    (["forensics", "runs", "--engine", "chdb", "--store", "{tmp}/nothing"], "no kvledger store"),
    (["report", "--out", "{tmp}/r", "--engine", "clickhouse"], "--engine clickhouse needs --dsn"),
    (["dashboard", "--engine", "duckdb", "--dsn", "clickhouse://h/db"], "--dsn is for --engine clickhouse"),
    (["export", "--store", "{tmp}/nothing"], "export needs --to"),
    (["export", "--to", "chdb:{tmp}/ch", "--store", "{tmp}/nothing"], "no kvledger store"),
    (["export", "--to", "chdb:{tmp}/ch", "--interval", "0"], "--interval must be in [0.1, 86400] seconds"),
    (["export", "--to", "ftp://h/db", "--store", "{store}"], "expected clickhouse://"),
    (["export", "--to", "chdb:", "--store", "{store}"], "chdb needs a data directory"),
]


@pytest.mark.parametrize("argv,error", BAD, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_engine_and_export_options_are_refused_with_a_clear_error(argv, error, tmp_path, capsys, fleet):
    store, _, _ = fleet
    before = {p.name for p in Path(CHDB).iterdir()}
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{store}", str(store)) for a in argv]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and error in err and "Traceback" not in err, err
    assert {p.name for p in Path(CHDB).iterdir()} == before and not (tmp_path / "ch").exists()


def test_export_refuses_a_store_that_does_not_verify(tmp_path, fleet, capsys):
    import shutil
    store = tmp_path / "copy"
    shutil.copytree(fleet[0], store)
    seg = next(store.glob("segments/spans/*.parquet"))
    seg.write_bytes(seg.read_bytes()[:-9] + b"tampered!")
    assert main(["export", "--to", f"chdb:{CHDB}?db=exp_broken", "--store", str(store)]) != 0
    err = capsys.readouterr().err
    assert "does not verify" in err and "refusing to export" in err
    assert main(["forensics", "runs", "--engine", "chdb", "--store", str(store)]) != 0
    assert "does not verify" in capsys.readouterr().err


@pytest.mark.xdist_group("glm53")
def test_the_report_and_the_dashboard_say_the_same_on_chdb(glm53_vulnerable, tmp_path):
    from dashboard.data import Panels
    from forensics.report import build
    _, store = glm53_vulnerable
    by = {e: build(store, engine={"engine": e}) for e in ("duckdb", "chdb")}
    for r in by.values():
        r.pop("generated_at")
    prov = {e: r.pop("provenance") for e, r in by.items()}
    assert by["chdb"] == by["duckdb"] and by["duckdb"]["counts"]["affected_responses"] > 0
    assert prov["chdb"]["engine"] == "chdb" and prov["chdb"]["chain_head"] == prov["duckdb"]["chain_head"]
    assert prov["chdb"]["query_sha256"].keys() > {"exposure_x", "exposures", "tenants"}
    d, c = Panels(store), Panels(store, engine={"engine": "chdb"})
    assert c.totals() == d.totals() and c.totals()["affected_responses"] > 0
    same(d.exposures(), c.exposures(), "dashboard exposures")
    assert c.tenants() == d.tenants() and c.time_range() == d.time_range()
    # the tenant picker's names, asked of each engine, are those of every request it holds
    assert d.tenants() == sorted(d.fx.requests()["tenant_h"].drop_nulls().unique().to_list()) and len(d.tenants()) > 1


@pytest.mark.xdist_group("glm53")
def test_a_donor_of_the_recipients_own_tenant_still_surfaces_on_either_engine(glm53_vulnerable, tmp_path):
    """The donor is not the recipient's tenant's "earlier request of its own": a store where the
    donor of the most surfaced pair is made one of the recipient tenant's requests (its spans' and
    arrivals' tenant) keeps that pair surfaced, on DuckDB and on chdb alike."""
    import pyarrow.compute as pc
    _, src = glm53_vulnerable
    fx = Forensics(src, answer_cache=False)
    ex = fx.query("exposures").filter(pl.col("evidence") == "surfaced")
    row = ex.sort("shared_ngrams", descending=True).row(0, named=True)
    tenant = fx.requests().filter(pl.col("incarnation") == row["response"])["tenant_h"][0]
    assert row["donor_tenant"] != tenant        # (a cross-tenant pair, made same-tenant below)

    def moved(t: str, data: pa.Table) -> pa.Table:            # the donor's rows under the recipient's tenant
        if t not in ("spans", "arrivals"):
            return data
        mine = pc.equal(data["incarnation"], row["donor"]).fill_null(False)
        return data.set_column(data.schema.get_field_index("tenant_h"), "tenant_h",
                               pc.if_else(mine, tenant, data["tenant_h"]))
    a = _exposures_on_both(rewrite_store(src, tmp_path / "same-tenant", moved), "the donor of the recipient's tenant")
    now = a.filter((pl.col("response") == row["response"]) & (pl.col("donor") == row["donor"]))
    assert now.select("donor_tenant", "evidence").rows() == [(tenant, "surfaced")]


def test_a_stale_chdb_mirror_is_rebuilt_from_the_store_in_hand(fleet):
    """--engine chdb's copy is a cache: one holding another history of the store (a record whose
    sha256 is not the store's) is dropped and rebuilt, never mixed with the store's rows."""
    store = fleet[0]
    fx = ClickHouseForensics(store)
    want = fx.query("fleet_impact")
    seg = read_chain(store)[0]
    fx.target.insert_arrow("kvledger_segments", pa.table({
        "store_id": [fx.verdict.store_id], "seq": pa.array([seg.seq], pa.int64()), "table": [seg.table],
        "file": [seg.file], "rows": pa.array([seg.rows], pa.int64()), "sha256": ["f" * 64],
        "exported_at": pa.array([time.time_ns()], pa.timestamp("ns", "UTC"))}), token="stale-history")
    fx.close()
    again = ClickHouseForensics(store)
    try:
        same(want, again.query("fleet_impact"), "fleet_impact after the rebuild")
        assert again.rows("capacity") == Forensics(store).rows("capacity")
    finally:
        again.close()


@pytest.mark.xdist_group("glm53")
def test_text_the_recipients_tenant_had_earlier_is_not_surfaced_on_either_engine(glm53_vulnerable, tmp_path):
    """The evidence rules, not just the rows: a surfaced response's output n-grams added (through the
    real segment writer) to the output of another request - one of its own tenant that arrived
    before it cancels the evidence (the text may have come through the tenant's own traffic), one
    of another tenant cancels nothing (an output is not a prompt: not "common") - and chdb says
    what DuckDB says. (The rule's time side: tests/test_forensics.py, on DuckDB.)"""
    _, src = glm53_vulnerable
    fx = Forensics(src, answer_cache=False)
    ex = fx.query("exposures")
    req = fx.requests()
    for which, cancelled in (("own-tenant-earlier", True), ("other-tenant", False)):
        pick = None
        for row in ex.filter(pl.col("evidence") == "surfaced").iter_rows(named=True):
            me = req.filter(pl.col("incarnation") == row["response"]).row(0, named=True)
            who = ((pl.col("tenant_h") == me["tenant_h"]) & (pl.col("arrived_at") < me["arrived_at"]) if cancelled
                   else pl.col("tenant_h") != me["tenant_h"])
            mates = req.filter(who & ~pl.col("incarnation").is_in([row["response"], row["donor"]]))
            if mates.height:
                pick = row, mates["incarnation"][0]
                break
        assert pick is not None, f"the incident has a surfaced response and a request for the {which} case"
        row, mate = pick
        out = fx.con.sql(f"SELECT n, hash FROM ngrams WHERE incarnation = {row['response']} AND role = 'output'").pl()

        def added(t: str, data: pa.Table) -> pa.Table:       # those rows added
            return data if t != "ngrams" else pa.concat_tables([data, pa.table({
                "incarnation": pa.array([mate] * out.height, pa.int64()), "role": pa.array(["output"] * out.height),
                "n": out["n"].to_arrow(), "hash": out["hash"].to_arrow(),
                "pos": pa.array(range(out.height), pa.int32())}).cast(data.schema)])
        a = _exposures_on_both(rewrite_store(src, tmp_path / which, added), f"the text in the output of an {which} request")
        now = a.filter((pl.col("response") == row["response"]) & (pl.col("donor") == row["donor"]))
        assert now["evidence"].to_list() == (["read"] if cancelled else ["surfaced"]), which


def _exposures_on_both(store: Path, what: str) -> pl.DataFrame:
    """The store's exposures on DuckDB, once chdb's are the same."""
    d, c = Forensics(store, answer_cache=False), ClickHouseForensics(store)
    try:
        a = d.query("exposures")
        same(a, c.query("exposures"), f"exposures, {what}")
        return a
    finally:
        c.close()
