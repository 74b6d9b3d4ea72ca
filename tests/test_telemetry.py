"""Spans, metrics and ledger rows come from the engine's own paths, follow the GenAI semantic
conventions, join to each other, keep tenants and text out of the store, and count every drop."""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace.export import SpanExportResult

from engine.config import EngineConfig
from engine.errors import InputError
from engine.llm import LLMEngine
from engine.models import load_model
from engine.request import SamplingParams
from forensics.queries.duckdb import Forensics
from telemetry import Telemetry, open_store
from telemetry.store.keys import WriterKeys
from telemetry.ledger import NGRAM
from telemetry.otel import TTFT_BUCKETS, StoreMetricExporter, StoreSpanExporter

pytestmark = pytest.mark.xdist_group("glm53")


def test_one_trace_per_request_with_children_across_nodes(glm53_vulnerable):
    res, store = glm53_vulnerable
    spans = open_store(store).sql('SELECT * FROM spans').pl()
    roots = spans.filter(pl.col("operation") == "request")
    assert sorted(roots["incarnation"]) == sorted(r.incarnation for r in res.requests)
    assert roots["TraceId"].n_unique() == roots.height
    r0 = roots.row(0, named=True)
    attrs = dict(r0["SpanAttributes"]) if not isinstance(r0["SpanAttributes"], dict) else r0["SpanAttributes"]
    assert r0["SpanName"] == "text_completion recall" and r0["SpanKind"] == "SERVER"
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.provider.name"] == "kvledger"
    assert attrs["gen_ai.request.model"] == "recall" and int(attrs["gen_ai.usage.input_tokens"]) > 0
    assert attrs["gen_ai.response.id"] == str(r0['incarnation'])
    kids = spans.join(roots.select("TraceId", pl.col("SpanId").alias("root")), on="TraceId")
    kids = kids.filter(pl.col("operation") != "request")
    assert (kids["ParentSpanId"] == kids["root"]).all()
    assert set(kids["operation"]) == {"admission", "prefill", "kv_transfer", "decode"}
    prefill_nodes = set(kids.filter(pl.col("operation") == "prefill")["node"])
    assert prefill_nodes == {"prefill0", "prefill1-canary"}          # linked across nodes, same trace


def test_ledger_rows_carry_their_requests_trace(glm53_vulnerable):
    _, store = glm53_vulnerable
    con = open_store(store)
    unmatched = con.sql("""SELECT count(*) FROM page_reads r JOIN spans s ON s.incarnation = r.reader
                           AND s.operation = 'request' WHERE r.trace_id <> s."TraceId" """).fetchall()
    assert unmatched == [(0,)]
    assert con.sql("SELECT count(*) FROM page_reads WHERE trace_id IS NULL").fetchall() == [(0,)]


def test_ledger_rows_carry_writer_reader_and_found_scopes(glm53_vulnerable):
    _, store = glm53_vulnerable
    con = open_store(store)
    scope = "(SELECT DISTINCT incarnation, scope_h FROM spans WHERE operation = 'request')"
    for table, who in (("page_writes", "writer"), ("page_reads", "reader")):
        n, wrong = con.sql(f"""SELECT count(*), count(*) FILTER (WHERE t.scope_h IS DISTINCT FROM s.scope_h)
                               FROM {table} t LEFT JOIN {scope} s ON s.incarnation = t.{who}""").fetchall()[0]
        assert n > 0 and wrong == 0, table
    # per slot read: the scope found is the scope of the writer found (NULL where no slot was read)
    n, wrong = con.sql(f"""WITH slots AS (SELECT unnest(found_writers) AS w, unnest(found_scopes_h) AS fs FROM page_reads)
                           SELECT count(*), count(*) FILTER (WHERE fs IS DISTINCT FROM s.scope_h)
                           FROM slots LEFT JOIN {scope} s ON s.incarnation = slots.w""").fetchall()[0]
    assert n > 0 and wrong == 0
    cross = con.sql("""SELECT check_passed, count(*) FILTER (WHERE list_bool_or(list_transform(found_scopes_h,
                           lambda x: x IS NOT NULL AND x <> scope_h))) FROM page_reads GROUP BY ALL""").fetchall()
    assert dict(cross)[True] == 0 and dict(cross)[False] > 0     # scopes never share; the incident crosses them


def test_an_ngram_of_whitespace_punctuation_or_one_token_is_never_evidence():
    """Only windows with at least 4 distinct content tokens are hashed: 12 spaces in two texts, a
    rule of dashes or one repeated word prove nothing about whose data a response read."""
    from engine.models.tokenizer import ByteTokenizer
    from telemetry.ledger import ngram_hashes
    from telemetry.store.keys import Keys
    tok, keys = ByteTokenizer(), Keys(b"p" * 32, b"n" * 32)
    noise = ["            ", "------------", ". . . . . . ", "aaaaaaaaaaaa", "abababababab", "!? !? !? !? ", "a.b.c,a.b.c,"]
    for text in noise:
        g, h, pos = ngram_hashes(keys, [tok.encode(text)], content=tok.content_mask())
        assert len(h) == 0, text
    g, h, pos = ngram_hashes(keys, [tok.encode("the secret is CANARY-x9Fq2")], content=tok.content_mask())
    assert len(h) == len("the secret is CANARY-x9Fq2") - 11 and sorted(pos.tolist()) == list(range(len(h)))


def test_ngram_windows_are_the_reference_s_on_random_token_lists_with_repeats():
    """``ngram_hashes`` counts a window's distinct content tokens in passes over all lists at once;
    the windows it keeps must be exactly those a window-at-a-time reference keeps (a set of the
    window's content tokens, ids past the mask carry none), each hashed as its own 12 tokens, in list
    then position order - over small vocabularies, where tokens repeat inside windows."""
    from telemetry.ledger import NGRAM, NGRAM_MIN_CONTENT, ngram_hashes
    from telemetry.store.keys import Keys
    keys, rng = Keys(b"p" * 32, b"n" * 32), np.random.default_rng(5)
    kept = 0
    for trial in range(150):
        vocab = int(rng.choice([2, 5, 9, 40, 5000]))
        lists = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 50)))] for _ in range(int(rng.integers(1, 5)))]
        mask = None if trial % 4 == 0 else rng.random(max(1, vocab - int(rng.integers(0, 3)))) < rng.random()
        want = [(i, k, keys.ngram_pseudonym(t[k:k + NGRAM])) for i, t in enumerate(lists) for k in range(len(t) - NGRAM + 1)
                if len({x for x in t[k:k + NGRAM] if mask is None or (x < len(mask) and mask[x])}) >= NGRAM_MIN_CONTENT]
        g, h, pos = ngram_hashes(keys, lists, content=mask)
        assert list(zip(g.tolist(), pos.tolist(), h.tolist())) == want, trial
        kept += len(want)
    assert kept > 1000


def test_ngrams_and_releases_come_from_the_requests(glm53_vulnerable):
    """Finished requests' n-grams are hashed together on the writer thread: per request and role
    they must be exactly the keyed hashes of that request's own 12-token windows (a reference
    computed here, one window at a time: no window may span two requests). Every request that
    decoded released its pages, and a release row names them."""
    res, store = glm53_vulnerable
    con = open_store(store)
    keys = WriterKeys.open_or_create(Path(store)).keys      # the writer's keys, held outside the store

    def content(t: int) -> bool:          # the recall model's bytes: a letter, a digit or part of a UTF-8 character
        return chr(t).isalnum() or t >= 0x80

    def reference(tokens: list[int]) -> set[tuple[int, int]]:
        starts = [k for k in range(len(tokens) - NGRAM + 1)
                  if len({t for t in tokens[k:k + NGRAM] if content(t)}) >= 4]      # evidence at all
        return {(keys.ngram_pseudonym(tokens[k:k + NGRAM]), k) for k in starts}
    stored = {(i, role): set(zip(h, p)) for i, role, h, p in
              con.sql("SELECT incarnation, role, list(hash), list(pos) FROM ngrams GROUP BY ALL").fetchall()}
    for req in res.requests:
        for role, toks in (("prompt", req.prompt_ids), ("output", req.output_ids)):
            assert stored.get((req.incarnation, role), set()) == reference(list(toks)), (req.incarnation, role)
    assert sum(len(v) for v in stored.values()) > 1000
    rel = con.sql("SELECT incarnation, kind, ended_by, len(pages) FROM releases").fetchall()
    assert {k for _, k, _, _ in rel} <= {"immediate", "deferred"} and all(n > 0 for *_, n in rel)
    assert {i for i, *_ in rel} >= {r.incarnation for r in res.requests if r.output_ids}


def test_the_released_pages_counter_counts_the_release_rows(glm53_vulnerable):
    """kvledger.pages.released (an observable counter over a plain tally: the engine thread no
    longer calls the SDK per release) ends, per node, kind and end, at the pages the release rows
    name."""
    _, store = glm53_vulnerable
    con = open_store(store)
    rows = dict(((n, k, e), v) for n, k, e, v in con.sql(
        "SELECT node, kind, ended_by, sum(len(pages)) FROM releases GROUP BY ALL").fetchall())
    counted = dict(((n, k, e), v) for n, k, e, v in con.sql("""
        SELECT node, attributes['kind'], attributes['ended_by'], arg_max(value, ts) FROM metrics
        WHERE name = 'kvledger.pages.released' GROUP BY ALL""").fetchall())
    assert rows and counted == {key: float(v) for key, v in rows.items()}
    assert {k for _, k, _ in counted} <= {"immediate", "deferred"}


def test_a_pseudonym_is_the_names_hmac_kept_or_not():
    """Keys.pseudonym keeps what it made per name (the engine thread asks at every arrival); kept
    or made again after the memo starts over, it is the name's HMAC under the pseudonym key."""
    import hashlib
    import hmac
    from telemetry.store.keys import Keys
    k = Keys(b"p" * 32, b"n" * 32)
    key = hmac.new(b"p" * 32, b"kvledger/pseudonym", hashlib.sha256).digest()
    names = [f"tenant-{i}" for i in range(Keys.PSEUDONYMS_KEPT + 10)]
    for rounds in range(2):
        for name in names:
            assert k.pseudonym(name) == hmac.new(key, name.encode(), hashlib.sha256).hexdigest()[:16]
    assert len(k._named) <= Keys.PSEUDONYMS_KEPT
    assert k.pseudonym("a") != Keys(b"q" * 32, b"n" * 32).pseudonym("a")


def test_the_keyed_hashes_are_a_keyed_cipher_not_a_public_hash():
    """n-gram and tag pseudonyms: AES-256 under the store's keys (before: a keyed mix of a public
    polynomial hash, whose collisions anyone can compute). Another key gives other values; the
    column path equals the cipher's own CBC mode one window at a time."""
    from telemetry.store.keys import Keys
    k, other = Keys(b"p" * 32, b"n" * 32), Keys(b"p" * 32, b"m" * 32)
    a = [7, 9] + list(range(100, 100 + NGRAM - 2))
    win = np.array([a, [9, 7] + a[2:], a[::-1], [2 ** 32 - 1] * NGRAM], dtype=np.uint64)
    h = k.ngram_pseudonyms(win)
    assert len(set(h.tolist())) == 4 and h.dtype == np.int64
    assert k.ngram_pseudonyms(np.zeros((0, NGRAM), dtype=np.uint64)).shape == (0,)
    assert h.tolist() == [k.ngram_pseudonym(w) for w in win.tolist()]
    assert not set(h.tolist()) & set(other.ngram_pseudonyms(win).tolist())
    tags = np.array([0, 1, -1, 2 ** 62], dtype=np.int64)
    t = k.tag_pseudonyms(tags)
    assert len(set(t.tolist())) == 4 and not set(t.tolist()) & set(tags.tolist())
    assert k.tag_pseudonyms(tags[1:2]).tolist() == t[1:2].tolist()          # per value, not per column
    with pytest.raises(ValueError):
        k.ngram_pseudonyms(np.array([[2 ** 33] * NGRAM], dtype=np.uint64))


def test_segments_dictionary_encode_all_but_the_keyed_hashes(glm53_vulnerable):
    """Parquet options name leaf columns by path ("found_writers.list.element"): a list column
    left out of the dictionary would be stored as plain 8-byte values (a real size regression)."""
    import pyarrow.parquet as pq
    _, store = glm53_vulnerable
    for table, dictionary, plain in (("page_reads", ["found_writers.list.element", "found_scopes_h.list.element", "reader"], []),
                                     ("page_writes", ["writer", "trace_id"], ["tag_h.list.element"])):
        seg = sorted((Path(store) / "segments" / table).glob("*.parquet"))[0]
        rg = pq.ParquetFile(seg).metadata.row_group(0)
        cols = {rg.column(i).path_in_schema: rg.column(i) for i in range(rg.num_columns)}
        assert all("RLE_DICTIONARY" in cols[c].encodings for c in dictionary), table
        assert all("RLE_DICTIONARY" not in cols[c].encodings for c in plain), table
        assert cols["page"].is_stats_set and not any(c.is_stats_set for p, c in cols.items() if ".list." in p)


def test_ngrams_segments_have_row_groups_a_lookup_skips_by_their_hash_bloom_filters(tmp_path, monkeypatch):
    """The n-gram evidence looks ngrams rows up by hash: each ngrams segment (a flush's and a
    merge's) is written in row groups of LOOKUP_ROW_GROUP rows with a Bloom filter on ``hash``, that
    DuckDB probes: a hash is never excluded from a row group that holds it and is excluded from the
    others but for the filter's rare false positives (0.1 %), and the lookup's rows are the rows. A
    small flush's filter is sized for its rows."""
    import duckdb
    import pyarrow as pa
    import telemetry.store.columns as columns
    from telemetry.store import SegmentWriter
    monkeypatch.setattr(columns, "LOOKUP_ROW_GROUP", 1000)
    rng = np.random.default_rng(7)
    n = 3500
    hashes = rng.integers(-2 ** 63, 2 ** 63 - 1, n, dtype=np.int64)
    ngrams = pa.table({"incarnation": np.arange(n, dtype=np.int64) // 10, "role": ["prompt"] * n,
                       "n": np.full(n, NGRAM, np.int16), "hash": hashes, "pos": np.arange(n, dtype=np.int32) % 10})
    w = SegmentWriter(tmp_path / "store", flush_interval=3600, compact_fan=2)
    for part in (ngrams.slice(0, 2000), ngrams.slice(2000), ngrams.slice(0, 40)):
        w.submit("ngrams", part)
        w.flush()
    w.close()
    assert w.compactions >= 1                          # the two big flushes merged: a merge's segment too
    segs = {len(pa.parquet.read_metadata(f).to_dict()["row_groups"]): f
            for f in sorted((tmp_path / "store" / "segments" / "ngrams").glob("*.parquet"))}
    con = duckdb.connect()
    probes = false_positives = 0
    for seg in segs.values():
        meta = con.sql(f"SELECT row_group_id, row_group_num_rows, bloom_filter_length FROM parquet_metadata('{seg}') "
                       "WHERE path_in_schema = 'hash' ORDER BY 1").fetchall()
        assert all(rows <= 1000 and length > 0 for _, rows, length in meta), seg
        rows = pa.parquet.read_table(seg)
        for h in rows["hash"].to_pylist()[::97]:
            probe = dict(con.sql(f"SELECT row_group_id, bloom_filter_excludes FROM parquet_bloom_probe('{seg}', 'hash', {h})").fetchall())
            holds = {i for i, (_, rg_rows, _) in enumerate(meta)
                     if h in rows.slice(sum(m[1] for m in meta[:i]), rg_rows)["hash"].to_pylist()}
            passed = {i for i, excluded in probe.items() if not excluded}
            assert holds and holds <= passed, (seg, h)
            probes, false_positives = probes + len(probe), false_positives + len(passed - holds)
        absent = con.sql(f"SELECT count(*) FROM parquet_bloom_probe('{seg}', 'hash', 12345) WHERE NOT bloom_filter_excludes").fetchall()
        probes, false_positives = probes + len(meta), false_positives + absent[0][0]
        want = set(rows["hash"].to_pylist()[::50])
        got = con.sql(f"SELECT hash FROM '{seg}' WHERE hash IN ({', '.join(map(str, want))})").fetchall()
        assert sorted(h for (h,) in got) == sorted(h for h in rows["hash"].to_pylist() if h in want)
    assert max(segs) >= 3 and min(segs) == 1 and probes > 100 and false_positives <= 1
    small = con.sql(f"SELECT bloom_filter_length FROM parquet_metadata('{segs[1]}') WHERE path_in_schema = 'hash'").fetchall()
    big = con.sql(f"SELECT max(bloom_filter_length) FROM parquet_metadata('{segs[max(segs)]}') WHERE path_in_schema = 'hash'").fetchall()
    assert small[0][0] < big[0][0]


def test_ngrams_segments_hold_the_outputs_in_row_groups_of_their_own(tmp_path, monkeypatch):
    """A segment's output n-grams (columns.APART) come first, in row groups of their own - a flush's
    segment and a merge's - each part in the order its rows came: a lookup filtering on role =
    'output' skips every prompt row group by its min and max and one of prompt rows every output
    row group; the segments hold the rows that were submitted, and a segment of one role alone is
    written as it came."""
    import duckdb
    import pyarrow as pa
    import telemetry.store.columns as columns
    from telemetry.store import SegmentWriter
    monkeypatch.setattr(columns, "LOOKUP_ROW_GROUP", 1000)
    rng = np.random.default_rng(11)
    parts = []
    for k, (reqs, outs) in enumerate([(30, 25), (40, 60), (3, 0)]):    # the last: prompts alone
        rows = []
        for i in range(reqs):
            inc = k * 1000 + i
            rows += [(inc, "prompt", p) for p in range(50)] + [(inc, "output", None) for _ in range(outs)]
        inc, role, pos = zip(*rows)
        parts.append(pa.table({"incarnation": np.array(inc, np.int64), "role": list(role),
                               "n": np.full(len(rows), NGRAM, np.int16),
                               "hash": rng.integers(-2 ** 62, 2 ** 62, len(rows), dtype=np.int64),
                               "pos": pa.array(pos, pa.int32())}))
    w = SegmentWriter(tmp_path / "store", flush_interval=3600, compact_fan=2)
    for part in parts:
        w.submit("ngrams", part)
        w.flush()
    w.close()
    assert w.compactions >= 1                          # the first two flushes merged: a merge's segment too
    con = duckdb.connect()
    segs = sorted((tmp_path / "store" / "segments" / "ngrams").glob("*.parquet"))     # flushes' and merges'
    got = open_store(tmp_path / "store").table("ngrams").to_arrow_table()      # (merged parts may linger a while)
    key = lambda t: sorted(zip(*[t[c].to_pylist() for c in ("incarnation", "role", "hash", "pos")]))  # noqa: E731
    assert key(got) == key(pa.concat_tables(parts))
    both = 0
    for seg in segs:
        t = pa.parquet.read_table(seg)
        roles = t["role"].to_pylist()
        first = roles.count("output")
        assert roles == ["output"] * first + ["prompt"] * (len(roles) - first), seg
        for role in ("output", "prompt"):       # each part in the order it came
            mine = t.filter(pa.compute.equal(t["role"], role))
            assert mine["incarnation"].to_pylist() == sorted(mine["incarnation"].to_pylist())
        groups = con.sql(f"SELECT row_group_id, any_value(row_group_num_rows), min(stats_min_value), max(stats_max_value) "
                         f"FROM parquet_metadata('{seg}') WHERE path_in_schema = 'role' GROUP BY 1 ORDER BY 1").fetchall()
        assert all(lo == hi for _, _, lo, hi in groups), groups          # no row group holds both roles
        assert sum(rows for _, rows, lo, _ in groups if lo == "output") == first
        both += 0 < first < len(roles)
        for role in ("output", "prompt"):
            plan = con.sql(f"EXPLAIN ANALYZE SELECT hash FROM '{seg}' WHERE role = '{role}'").fetchall()[0][1]
            scanned = re.search(r"Row Groups Scanned: (\d+) / (\d+)", plan)     # (none at all: no scan shown)
            assert int(scanned[1] if scanned else 0) == sum(lo == role for _, _, lo, _ in groups), plan
    assert both >= 2


def test_genai_metrics_use_the_spec_buckets(glm53_vulnerable):
    res, store = glm53_vulnerable
    m = open_store(store).sql("""SELECT node, bucket_counts, boundaries, count FROM metrics
                                 WHERE name = 'gen_ai.server.time_to_first_token'
                                 QUALIFY row_number() OVER (PARTITION BY node ORDER BY ts DESC) = 1""").pl()
    assert m["boundaries"][0].to_list() == list(TTFT_BUCKETS)
    assert m["count"].sum() == sum(r.first_token_at is not None for r in res.requests)


def test_no_tenant_id_canary_or_prompt_text_in_the_store(glm53_vulnerable):
    res, store = glm53_vulnerable
    con = open_store(store)
    needles = ["acme", "globex", "initech", "umbrella", "CANARY", res.requests[0].tenant]
    needles.append(bytes(res.requests[0].prompt_ids[100:130]).decode())
    tables = [r[0] for r in con.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    for t in tables:
        dump = str(con.sql(f'SELECT * FROM "{t}"').fetchall())
        for n in needles:
            assert n not in dump, f"{n!r} stored in clear in {t}"


def _engine(tel: Telemetry) -> LLMEngine:
    model, tok = load_model("recall")
    return LLMEngine(model, tok, EngineConfig(kv_memory_budget=8 << 20, context_length=512), recorder=tel)


def _pairs(m) -> list[tuple]:
    """A map column's value as polars gives it (a dict, or key/value structs), as (key, value) pairs."""
    return list(m.items()) if isinstance(m, dict) else [(e["key"], e["value"]) for e in m]


def test_spans_written_as_rows_equal_those_the_sdk_exports(tmp_path, monkeypatch):
    """Where the store is the spans' only destination a request's root (RowSpan) and its children are
    written as rows (SpanRows), not through the SDK: the same requests through both paths give the same
    rows but for ids and times, each child under its root's trace and span, and the same counts."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    eng = _engine(tel)
    prompts = [f"prompt number {i} " * 3 for i in range(3)]
    sp = SamplingParams(max_tokens=4)
    for direct in (True, False):          # the first three requests' children as rows, the next three's via the SDK
        for node in tel.nodes.values():
            node.direct = direct
        eng.generate(prompts, sp)
        tel.writer.flush()          # the writer's thread has ended their spans (under this mode)
    stats = tel.close()
    assert stats["spans_dropped"] == 0 and stats["spans_ended"] == stats["spans_exported"] == 2 * 3 * 4
    spans = open_store(tmp_path / "s").sql("SELECT * FROM spans").pl()
    roots = spans.filter(pl.col("operation") == "request").select("TraceId", pl.col("SpanId").alias("root"),
                                                                  "incarnation", pl.col("Timestamp").alias("t0"))
    kids = spans.filter(pl.col("operation") != "request").join(roots, on="incarnation")
    assert kids.height == 2 * 3 * 3
    assert (kids["TraceId"] == kids["TraceId_right"]).all() and (kids["ParentSpanId"] == kids["root"]).all()
    assert (kids["Duration"] >= 0).all() and (kids["Timestamp"] >= kids["t0"]).all()
    assert kids["SpanId"].n_unique() == kids.height

    timed = ("kvledger.time_to_first_token", "gen_ai.response.id")      # a root's values that differ by request

    def shape(rows: pl.DataFrame) -> list:
        """A run's spans but for ids, times and which incarnation: sorted rows (the keys in order)."""
        order = {inc: i for i, inc in enumerate(sorted(rows["incarnation"].unique()))}
        out = []
        for r in rows.drop("TraceId", "SpanId", "ParentSpanId", "Timestamp", "Duration", "TraceId_right", "root",
                           "t0", "ttft_s", "request_id").iter_rows(named=True):
            r["SpanAttributes"] = [(k, "" if k in timed else v) for k, v in _pairs(r["SpanAttributes"])
                                   if k != "kvledger.incarnation"]
            r["incarnation"] = order[r["incarnation"]]
            out.append(repr(sorted(r.items())))
        return sorted(out)
    incs = sorted(kids["incarnation"].unique())
    first, second = (kids.filter(pl.col("incarnation").is_in(part)) for part in (incs[:3], incs[3:]))
    assert shape(first) == shape(second)
    root_rows = spans.filter(pl.col("operation") == "request").with_columns(
        pl.lit("").alias("TraceId_right"), pl.lit("").alias("root"), pl.lit(0).alias("t0"))
    assert root_rows.height == 6 and root_rows["SpanId"].n_unique() == 6 and root_rows["TraceId"].n_unique() == 6
    assert (root_rows["ParentSpanId"] == "").all() and (root_rows["SpanKind"] == "SERVER").all()
    rows_first, rows_second = (root_rows.filter(pl.col("incarnation").is_in(part)) for part in (incs[:3], incs[3:]))
    assert shape(rows_first) == shape(rows_second)      # attributes in the SDK's order, status, scope, resource
    # the attributes in the SDK's order (insertion), as strings
    row = first.filter(pl.col("operation") == "prefill").row(0, named=True)
    assert [k for k, _ in _pairs(row["SpanAttributes"])] == ["kvledger.operation", "kvledger.node", "kvledger.incarnation",
                                                    "kvledger.prompt_tokens.prefilled"]
    assert row["SpanKind"] == "INTERNAL" and row["StatusCode"] == "UNSET" and row["ScopeName"] == "kvledger"


@pytest.mark.parametrize("case", ["ok", "rejected", "error_then_ok", "ok_then_error", "ended_twice"])
def test_a_root_written_as_a_row_equals_the_sdk_s_export_of_the_same_span(tmp_path, case):
    """RowSpan against the SDK's own span, the same calls on both (attributes set at start and later,
    a key set again, status rules, an event, a second end): StoreSpanExporter's row of the SDK span
    and SpanRows' row of the RowSpan are the same but for the ids."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    from telemetry.otel import RowSpan, SpanRows, StoreSpanExporter
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    _engine(tel)
    node = next(iter(tel.nodes.values()))
    start, attrs = 1_700_000_000_000_000_000, {"gen_ai.operation.name": "text_completion", "kvledger.incarnation": 7,
                                               "kvledger.operation": "request", "kvledger.tenant": "t"}
    sdk = node.tracer.start_span("text_completion recall", kind=SpanKind.SERVER, start_time=start, attributes=dict(attrs))
    rows = SpanRows()
    row = RowSpan(node, rows, "text_completion recall", "SERVER", start, dict(attrs))
    for span in (sdk, row):
        span.set_attributes({"gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": ["length"],
                             "kvledger.operation": "request"})         # set again: moves to the end, as the SDK's
        if case == "rejected":
            span.set_status(Status(StatusCode.ERROR, "pool too small"))
            span.add_event("rejected", {"kvledger.rejection.where": "admission"}, timestamp=start + 5)
            span.set_attributes({"error.type": "PoolTooSmall"})
        elif case == "error_then_ok":
            span.set_status(Status(StatusCode.ERROR, "x"))
            span.set_status(Status(StatusCode.OK))
        elif case == "ok_then_error":
            span.set_status(Status(StatusCode.OK))
            span.set_status(Status(StatusCode.ERROR, "ignored: OK is final"))
        span.end(end_time=start + 1000)
        if case == "ended_twice":        # ignored by both: the row is the first end's
            span.set_attributes({"late": 1})
            span.set_status(Status(StatusCode.ERROR, "late"))
            span.end(end_time=start + 9999)
    got = []

    class Writer:
        accepting = True

        def submit(self, table, data):
            got.append(data)
    StoreSpanExporter(Writer()).export([sdk])
    a, b = got[0].to_pylist()[0], rows.take().to_pylist()[0]
    assert (a["TraceId"], a["SpanId"]) != (b["TraceId"], b["SpanId"])
    for r in (a, b):
        del r["TraceId"], r["SpanId"]
    assert a == b
    assert b["StatusCode"] == {"ok": "UNSET", "rejected": "ERROR", "error_then_ok": "OK", "ok_then_error": "OK",
                               "ended_twice": "UNSET"}[case]
    assert b["Duration"] == 1000
    tel.close()


def test_spans_dropped_by_a_full_queue_are_counted(tmp_path, monkeypatch):
    real = StoreSpanExporter.export
    monkeypatch.setattr(StoreSpanExporter, "export", lambda self, spans: (time.sleep(0.3), real(self, spans))[1])
    tel = Telemetry(tmp_path / "s", span_queue_size=2, model_name="recall", metric_interval=60)
    eng = _engine(tel)
    for node in tel.nodes.values():      # through the SDK's queue (as with an OTLP collector configured)
        node.direct = False
    eng.generate([f"prompt number {i} " * 4 for i in range(12)], SamplingParams(max_tokens=4))
    stats = tel.close()
    assert stats["spans_dropped"] > 0 and stats["spans_dropped"] == stats["spans_ended"] - stats["spans_exported"]
    con = open_store(tmp_path / "s")
    assert con.sql("SELECT count(*) FROM spans").fetchall() == [(stats["spans_exported"],)]
    sdk = con.sql("""SELECT sum(v) FROM (SELECT arg_max(value, ts) AS v FROM metrics
                     WHERE name = 'otel.sdk.processor.span.processed' AND attributes['error.type'] = 'queue_full'
                     GROUP BY node)""").fetchall()
    # the SDK's own counter is exported too; it checks "queue full" before the worker may pop a
    # batch, so it can over-count by a span or two - ours (ended - exported) is exact
    assert sdk[0][0] >= stats["spans_dropped"]


def test_spans_also_go_to_an_otlp_collector(tmp_path, monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    got: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
    try:
        tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
        _engine(tel).generate(["hello otlp"], SamplingParams(max_tokens=3))
        tel.close()
    finally:
        srv.shutdown()
    names, anchors = set(), set()
    for body in got:
        req = ExportTraceServiceRequest.FromString(body)
        spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        names |= {s.name for s in spans}
        anchors |= {tuple(a.value.string_value or a.value.int_value for a in s.attributes
                          if a.key in ("kvledger.anchor.seq", "kvledger.anchor.head", "kvledger.anchor.signature"))
                    for s in spans if s.name == "kvledger.anchor"}
    assert "text_completion recall" in names and "decode recall" in names
    # every signed head the writer anchored also went to the collector (a copy outside the machine)
    from telemetry.store import verify
    v = verify(tmp_path / "s")
    anchored = {(e["seq"], e["head"], e["signature"]) for e in map(json.loads, Path(v.anchor).read_text().splitlines())
                if not e["seal"]}
    assert anchored and anchored <= anchors, (anchored, anchors)


def test_usage_fields_of_a_unified_request(tmp_path):
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    eng = _engine(tel)
    (r,) = eng.generate(["abcdefgh" * 5], SamplingParams(max_tokens=5))
    tel.close()
    row = Forensics(tmp_path / "s").requests().row(0, named=True)
    assert (row["prompt_tokens_billed"], row["prompt_tokens_prefilled"], row["output_tokens"]) == (40, 40, 5)
    assert row["finish_reason"] == "length" and row["ttft_s"] == pytest.approx(r.ttft, abs=1e-6)


def test_request_spans_end_off_the_engine_thread_and_none_is_lost(tmp_path, monkeypatch):
    """A finished request's spans and histograms are built on the store writer's thread, not the
    engine's; the requests still queued when the recorder closes are ended by ``close`` (every
    request has its root and children in the store); one request whose spans fail to build costs
    that request's spans only - the store writer (which holds the ledger too) goes on."""
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    threads, real = [], tel._end_request

    def end(engine, root, rec, rejection, req):
        threads.append(threading.current_thread().name)
        if len(threads) == 5:                   # the second request of the second batch
            broken.append(req.incarnation)
            raise RuntimeError("a span that cannot be built")
        real(engine, root, rec, rejection, req)
    monkeypatch.setattr(tel, "_end_request", end)
    eng = _engine(tel)
    broken: list[int] = []
    first = eng.generate([f"request {i} " * 4 for i in range(3)], SamplingParams(max_tokens=3))
    deadline = time.monotonic() + 30
    while len(threads) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads == ["kvledger-store-writer"] * 3
    gate, real_finish = threading.Event(), tel._finish_spans

    def finish_then_open() -> list:             # close's own pass opens the gate the writer waits at
        out = real_finish()
        if threading.current_thread() is threading.main_thread():
            gate.set()
        return out
    monkeypatch.setattr(tel, "_finish_spans", finish_then_open)
    tel.writer.submit_lazy(lambda: (gate.wait(60), [])[1])     # the writer's thread held: nothing ends there
    later = eng.generate([f"later {i} " * 4 for i in range(3)], SamplingParams(max_tokens=3))
    assert len(threads) == 3
    tel.close()
    assert threads[3:] == ["MainThread"] * 3
    assert tel.writer.error is None
    spans = open_store(tmp_path / "s").sql(
        "SELECT incarnation, list_sort(list(operation)) AS ops FROM spans GROUP BY incarnation").pl()
    got = dict(zip(spans["incarnation"], spans["ops"].to_list()))
    (lost,) = broken
    for r in first + later:
        if r.incarnation != lost:
            assert got[r.incarnation] == ["admission", "decode", "prefill", "request"], r.incarnation
    assert lost not in got and lost in {r.incarnation for r in later}
    assert open_store(tmp_path / "s").sql(f"SELECT count(*) FROM page_reads WHERE reader = {lost}").fetchall()[0][0] > 0


def test_queueing_never_exceeds_time_to_first_token(glm53_vulnerable):
    """The admission span (queued, no work yet) ends before the first token: TTFT minus queueing >= 0."""
    _, store = glm53_vulnerable
    ttft = Forensics(store).query("ttft")
    assert ttft.height and (ttft["service_ttft_s"] >= 0).all() and (ttft["queue_s"] >= 0).all()


def test_exporters_after_close_report_failure_instead_of_raising(tmp_path):
    """An SDK thread can outlive close (the SDK restarts its threads in a forked child): its export
    is then a reported failure, never an exception in a background thread, and nothing is written."""
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    _engine(tel).generate(["one prompt " * 4], SamplingParams(max_tokens=2))
    tel.close()
    segments = sorted((tmp_path / "s" / "chain").iterdir())
    assert StoreSpanExporter(tel.writer).export([]) == SpanExportResult.FAILURE
    assert StoreMetricExporter(tel.writer, "n").export(None) == MetricExportResult.FAILURE
    assert sorted((tmp_path / "s" / "chain").iterdir()) == segments


def test_exporters_report_failure_once_the_store_writer_failed(tmp_path):
    """A failed store writer (here: rows that do not fit the schema) is a StoreError for the engine,
    and a reported failure - not an exception with a traceback - for the SDK's exporters."""
    from telemetry.store import StoreError
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    tel.writer.submit("ngrams", {"incarnation": np.zeros(1, dtype=np.int64)})     # no role, n, hash
    with pytest.raises(StoreError, match="missing columns"):
        tel.writer.flush()
    assert not tel.writer.accepting
    assert StoreSpanExporter(tel.writer).export([]) == SpanExportResult.FAILURE
    assert StoreMetricExporter(tel.writer, "n").export(None) == MetricExportResult.FAILURE
    with pytest.raises(StoreError, match="missing columns"):    # closed: its error again, and the writer's
        tel.close()                                             # thread and the store's lock released
    assert not tel.writer._thread.is_alive() and tel.writer.closed
    Telemetry(tmp_path / "s", model_name="recall", metric_interval=60).close()     # the store taken over


def test_per_request_maps_stay_bounded_in_a_long_run(tmp_path):
    """The incarnation -> trace ids and incarnation -> scope maps outlive their requests (late
    ledger rows still name them) but are bounded: past the cap the oldest half is forgotten, and
    the newest requests' rows still carry their trace and scope."""
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    tel.ids_cap = tel.ledger.scopes.cap = 4
    eng = _engine(tel)
    for i in range(7):
        eng.generate([f"request number {i} " * 3], SamplingParams(max_tokens=2))
    assert 0 < len(tel._ids) <= 4 and 0 < len(tel.ledger.scopes.code) <= 4
    last = next(reversed(tel._ids))
    tel.close()
    con = open_store(tmp_path / "s")
    rows = con.sql(f"SELECT count(*), bool_and(trace_id = '{tel._ids[last][0]}'), bool_and(scope_h IS NOT NULL) "
                   f"FROM page_reads WHERE reader = {last}").fetchall()[0]
    assert rows[0] > 0 and rows[1] and rows[2]


def test_transfer_and_rejection_records_are_dropped_when_their_request_ends(tmp_path):
    """Disaggregated: a request's transfer record (it holds the slot sets as tensors) and its
    rejection are read by its root span when it ends, then dropped: a long-running server keeps
    neither once the request is over (late ones are bounded like the other per-request maps)."""
    from engine.disagg.cluster import DisaggCluster, Guards
    from engine.kv.pool import KVPool
    model, tok = load_model("recall")
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    cfg = lambda tokens, node: EngineConfig(kv_memory_budget=tokens // 16 * pb, page_size=16,  # noqa: E731
                                            context_length=512, node_id=node)
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60)
    cl = DisaggCluster(model, tok, [cfg(1024, "p0")], cfg(256, "d0"), Guards.policy("hardened"), recorder=tel)
    try:
        ok = [cl.submit(f"request {i} " * 8, SamplingParams(max_tokens=3), f"t{i}") for i in range(3)]
        big = cl.submit("x" * 400, SamplingParams(max_tokens=3), "t9")     # more KV than the decode pool holds
        cl.run_until_done()
    finally:
        cl.close()
    assert all(r.error is None for r in ok) and big.error is not None
    assert tel._transfers == {} and tel._rejections == {}
    tel.close()
    spans = open_store(tmp_path / "s").sql(
        "SELECT SpanAttributes['kvledger.slots.landed'], SpanAttributes['kvledger.rejection.where'] FROM spans "
        "WHERE SpanAttributes['kvledger.operation'] = 'request' ORDER BY incarnation").fetchall()
    assert sum(landed is not None for landed, _ in spans) == 3          # the transfer records were read first
    assert sum(where is not None for _, where in spans) == 1            # and the rejection


def test_read_runs_and_write_runs_are_lossless(tmp_path):
    """The same traffic recorded with read-run coalescing on and off describes the same reads (every
    read step inside exactly one run, with the same findings), and write runs expand to one slot
    each with one content tag per slot; coalescing does merge (fewer rows)."""
    stores = {}
    for coalesce in (True, False):
        tel = Telemetry(tmp_path / str(coalesce), model_name="recall", metric_interval=60, coalesce=coalesce,
                        flush_interval=0.2)     # short flushes: runs split across segments must still add up
        eng = _engine(tel)
        for i in range(3):
            eng.add_request("the quick brown fox jumps over the lazy dog " * (2 + i), SamplingParams(max_tokens=24),
                            f"t{i}")
        eng.run_until_done()
        tel.close()
        stores[coalesce] = open_store(tmp_path / str(coalesce))
    per_step = """WITH m AS (SELECT min(reader) AS m FROM page_reads),   -- incarnations differ by an offset per run
                  r AS (SELECT *, unnest(range(step_last - step_first + 1)) AS k FROM page_reads),
                  s AS (SELECT *, CASE WHEN slots_read > slots_first THEN slots_first + k ELSE slots_read END AS sr FROM r)
                  SELECT reader - m, page, generation, found_generation, block_index, bad_mask, step_first + k AS step, sr,
                         list_transform(found_writers, lambda x, i: CASE WHEN x < 0 OR i > sr THEN -1 ELSE x - m END)
                  FROM s, m ORDER BY ALL"""
    merged, plain = (stores[c].sql(per_step).fetchall() for c in (True, False))
    assert merged == plain and len(plain) > 0
    sums = [stores[c].sql("SELECT count(*), sum(n_reads), sum(step_last - step_first + 1) FROM page_reads").fetchall()[0]
            for c in (True, False)]
    assert sums[0][1] == sums[0][2] == sums[1][1] == sums[1][0] and sums[0][0] < sums[1][0]
    # the expansion above covered growing runs (a page the reader fills with its own decode)
    grown = stores[True].sql("SELECT count(*) FROM page_reads WHERE slots_read = slots_first + n_reads - 1 "
                             "AND n_reads > 1").fetchall()[0][0]
    assert grown > 0
    assert stores[False].sql("SELECT max(n_reads) FROM page_reads").fetchall() == [(1,)]
    for con in stores.values():
        slots = con.sql("""SELECT count(*), count(DISTINCT (node, page, generation, slot, lclock)),
                                  (SELECT sum(n_slots) FROM page_writes), (SELECT max(n_slots) FROM page_writes),
                                  (SELECT bool_and(len(tag_h) = n_slots) FROM page_writes)
                           FROM (SELECT *, slot_first + unnest(range(n_slots::BIGINT)) AS slot FROM page_writes)""").fetchall()[0]
        assert slots[0] == slots[1] == slots[2] and slots[3] > 1 and slots[4]
    assert stores[True].sql("SELECT sum(n_slots) FROM page_writes").fetchall() == \
        stores[False].sql("SELECT sum(n_slots) FROM page_writes").fetchall()


def test_read_runs_fold_the_same_in_any_batching(tmp_path):
    """Steps folded one at a time, in uneven batches and all at once give the same rows (the
    batched fold is exact, whatever the writer thread's wake-ups were)."""
    from telemetry.ledger import ReadRuns
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60, flush_interval=600)
    tel.ledger.FOLD_CELLS = 1 << 40                 # keep every step pending: fold them here by hand
    eng = _engine(tel)
    for i in range(3):
        eng.add_request("the quick brown fox jumps over the lazy dog " * (2 + i), SamplingParams(max_tokens=24), f"t{i}")
    eng.run_until_done()
    steps = list(tel.ledger._pending)       # StepRecords, as the engine handed them over

    def rows(batches: list[list]) -> list[tuple]:
        runs = ReadRuns("n", eng.pool.page_size)
        for b in batches:
            runs.add(b)
        d = runs.drain()
        return sorted(zip(d["reader"].tolist(), d["block_index"].tolist(), d["page"].tolist(), d["step_first"].tolist(),
                          d["step_last"].tolist(), d["n_reads"].tolist(), d["slots_read"].tolist(), d["slots_first"].tolist(),
                          map(tuple, d["found_writers"].tolist()),
                          [None if m != m else round(m, 9) for m in d["attention_mass"].tolist()]))
    one = rows([[s] for s in steps])
    assert len(steps) > 10 and len(one) < sum(int((s.block_tables >= 0).sum()) for s in steps)     # runs merged
    from engine.kernels import native
    if native() is not None:        # the C fold as well (no compiler: the numpy fold is the only one)
        assert _fold_both_ways(eng.pool.page_size, [steps[:3], steps[3:4], steps[4:17], steps[17:]]) > 0
    # a page the reader fills with its own decode is one growing run, not a row per token (24 new tokens each)
    assert max((n for _, _, _, _, _, n, sr, sf, _, _ in one if sr == sf + n - 1 and sr > sf), default=0) >= 8
    assert rows([steps]) == one
    assert rows([steps[:3], steps[3:4], steps[4:17], steps[17:]]) == one
    tel.ledger._pending.clear()
    tel.close()


def test_a_fold_s_batch_gives_each_field_as_the_records_one_by_one(tmp_path):
    """A fold reads its records once (telemetry.ledger._Batch: whole-batch concatenations, the lists
    that consecutive steps share converted once): every tensor field equals the records' tensors
    flattened one by one in step order, and the per-step scalars, shapes, batch rows, incarnations,
    prompt lengths and ids equal the records' own - on the engine's steps (block tables that gain
    columns as the sequences grow, batches that change) and on the same steps with their tables
    reshaped, some fields as numpy and lists not shared between consecutive steps."""
    from telemetry.ledger import StepRecord, _Batch, _cat
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60, flush_interval=600)
    tel.ledger.FOLD_CELLS = 1 << 40                 # keep every step pending
    eng = _engine(tel)
    for i in range(3):
        eng.add_request("the quick brown fox jumps over the lazy dog " * (1 + 2 * i), SamplingParams(max_tokens=40), f"t{i}")
    eng.run_until_done()
    steps = list(tel.ledger._pending)
    cols = {int(s.block_tables.shape[1]) for s in steps}
    assert len(steps) > 30 and len(cols) > 2 and len({len(s.incs) for s in steps}) > 1     # tables grow, batches change
    assert any(a.incs is b.incs for a, b in zip(steps, steps[1:]))                           # lists shared step to step
    tensor_fields = [f for f in StepRecord._fields[8:]]
    rng = np.random.default_rng(0)

    def odd(s):     # the same step: its lists copied (not shared), two of its tables [B, C] -> [B * C, 1]
        B, C = s.block_tables.shape
        return s._replace(incs=list(s.incs), ids=list(s.ids), prompt_lens=list(s.prompt_lens),
                          **{f: getattr(s, f).reshape(B * C, 1) for f in ("block_tables", "slots_read")})
    cases = {"the engine's steps": steps,
             "copied lists, reshaped tables, positions as numpy": [
                 (odd(s) if rng.random() < 0.5 else s)._replace(positions=s.positions.numpy().copy()) for s in steps]}
    for name, recs in cases.items():
        for batch in (recs, recs[:1], recs[5:23]):
            b = _Batch(batch)
            for f in tensor_fields:
                want = np.concatenate([np.asarray(r[StepRecord._fields.index(f)]).reshape(-1) for r in batch])
                got = b(f)
                assert got.dtype == _cat(batch, f).dtype and np.array_equal(got, want, equal_nan=got.dtype.kind == "f"), (name, f)
            for f in ("step", "lclock", "ts_ns"):
                assert b.per_step(f).tolist() == [getattr(r, f) for r in batch], (name, f)
            assert b.shape("block_tables", 1).tolist() == [r.block_tables.shape[1] for r in batch], name
            assert b.row_counts().tolist() == [len(r.incs) for r in batch], name
            assert b.rows("incs").tolist() == [x for r in batch for x in r.incs], name
            assert b.rows("prompt_lens").tolist() == [x for r in batch for x in r.prompt_lens], name
            assert b.ids() == [x for r in batch for x in r.ids], name
    tel.ledger._pending.clear()
    tel.close()


def _fold_both_ways(page_size: int, batches: list[list]) -> int:
    """Fold the batches in engine/kernels/read_runs.c and in numpy: the same rows in the same order
    (a run's mass to 1e-12: C sums a run's reads in order, numpy pairwise); how many rows."""
    from engine.kernels import native
    from telemetry.ledger import ReadRuns
    assert native() is not None, "the native kernels are not built: nothing to compare"
    out = {}
    for way in (True, False):
        runs = ReadRuns("n", page_size, native=way)
        for b in batches:
            runs.add(b)
        out[way] = runs.drain()
    c, n = out[True], out[False]
    assert c.keys() == n.keys()
    for k in n:
        if isinstance(n[k], np.ndarray) and n[k].dtype.kind == "f":
            np.testing.assert_allclose(c[k], n[k], rtol=1e-12, equal_nan=True, err_msg=k)
        elif isinstance(n[k], np.ndarray):
            np.testing.assert_array_equal(c[k], n[k], err_msg=k)
        else:                       # dictionary-coded columns, the ids
            assert repr(c[k]) == repr(n[k]), k
    return len(n["reader"])


NEEDS_CC = pytest.mark.skipif(os.environ.get("KVLEDGER_NATIVE") == "0" or shutil.which("cc") is None,
                              reason="the native ledger folds (read runs, index reads) need the kernels (a C compiler)")


@NEEDS_CC
def test_the_native_read_run_fold_gives_the_numpy_fold_s_rows_on_random_reads():
    """Random reads that mostly repeat the step before's (so that runs form) and otherwise change
    one thing - a slot's writer, the slots read (one more, one fewer, a jump), the failing slots,
    a generation, the page, which readers are in the batch - folded in random batches both ways."""
    import torch
    from telemetry.ledger import StepRecord
    rng = np.random.default_rng(7)
    S, B, C = 4, 5, 3
    pg, eg, fg, bm, sr = (rng.integers(0, 3, (B, C)) for _ in range(5))
    fw = rng.integers(1, 3, (B, C, S))
    steps = []
    for t in range(400):
        for b in range(B):
            for c in range(C):
                what = rng.integers(0, 12)
                if what == 0:
                    fw[b, c, rng.integers(0, S)] = rng.integers(1, 3)
                elif what in (1, 2):
                    sr[b, c] = min(S, sr[b, c] + 1)
                elif what == 3:
                    sr[b, c] = rng.integers(0, S + 1)
                elif what == 4:
                    bm[b, c] = rng.integers(0, 3)
                elif what == 5:
                    (eg if rng.integers(0, 2) else fg)[b, c] = rng.integers(0, 3)
                elif what == 6:
                    pg[b, c] = rng.integers(-1, 3)
        rows = np.sort(rng.choice(B, size=int(rng.integers(1, B + 1)), replace=False))
        t64 = lambda a: torch.from_numpy(np.ascontiguousarray(a[rows], dtype=np.int64))   # noqa: E731
        steps.append(StepRecord("n", t, 10 * t, 1000 * t, rows.tolist(), [(f"t{i}", f"s{i}") for i in rows], None, S,
                                None, None, None, None, None, None, None, t64(pg), t64(eg), t64(sr), t64(fg), t64(bm),
                                t64(fw), torch.from_numpy(rng.random((len(rows), C)).astype(np.float32))))
    cuts = np.sort(rng.choice(np.arange(1, len(steps)), size=30, replace=False))
    batches = [steps[a:b] for a, b in zip([0, *cuts], [*cuts, len(steps)])]
    assert _fold_both_ways(S, batches) > 100


@NEEDS_CC
def test_the_native_read_run_fold_gives_the_numpy_fold_s_rows_on_an_incident(tmp_path, monkeypatch):
    """Every batch the ledger writer folded during the GLM-5.3 incident (stale reads, foreign
    writers, landed transfers, pages filled by their reader's decode) folded again both ways."""
    from engine.replay.glm53 import glm53
    from telemetry.ledger import ReadRuns
    seen: dict[ReadRuns, tuple[int, list]] = {}      # keyed by the object itself: no id reused by a later one
    real = ReadRuns.add

    def add(self, steps, cat=None):
        seen.setdefault(self, (self.S, []))[1].append(list(steps))
        return real(self, steps, cat)
    monkeypatch.setattr(ReadRuns, "add", add)
    from telemetry.recorder import recording
    glm53("vulnerable", "disaggregated", recorder=recording(tmp_path / "s"), context=1024, victims=2, background=4,
          max_tokens=48, seed=3)
    monkeypatch.setattr(ReadRuns, "add", real)
    assert seen
    rows = 0
    for page_size, batches in seen.values():
        rows += _fold_both_ways(page_size, batches)
    failing = sum(int((s.bad_mask != 0).sum()) for _, bs in seen.values() for b in bs for s in b)
    assert rows > 0 and failing > 0, (rows, failing)


def _index_reads_both_ways(row_cells, row_reader, page, gen, sr, bad) -> tuple[int, int]:
    """The exposure index's holdings and failing cells of one fold by engine/kernels/read_runs.c and
    by numpy: the same triples, each once, in first-read order; the same cells in order."""
    from telemetry.exposure_index import unique_rows
    from telemetry.ledger import _index_reads
    got = _index_reads(row_cells, row_reader, page, gen, sr, bad)
    assert got is not None, "the native kernels are not built: nothing to compare"
    holds, cells = got
    reader = np.repeat(row_reader, row_cells)
    read = (page >= 0) & (sr > 0)
    trip = np.stack([page[read], gen[read], reader[read]], axis=1).astype(np.int64)
    u, inv = unique_rows(trip)
    first = np.full(len(u), len(trip))
    np.minimum.at(first, inv, np.arange(len(trip)))
    assert holds.tolist() == u[np.argsort(first)].tolist()
    assert cells.tolist() == np.flatnonzero(read & (bad != 0)).tolist()
    return len(holds), len(cells)


@NEEDS_CC
def test_the_native_index_reads_give_the_numpy_holdings_and_failing_cells():
    """Random folds (pages repeating, none (-1), slots read 0, failing masks, readers sharing
    pages), an empty one and one holding thousands, both ways."""
    rng = np.random.default_rng(5)
    total = [0, 0]
    for _ in range(40):
        B = rng.integers(1, 9, rng.integers(1, 30))            # rows per step
        C = rng.integers(1, 12, len(B))                         # block-table columns per step
        row_cells = np.repeat(C, B)
        n = int(row_cells.sum())
        readers = rng.integers(0, 6, len(row_cells))
        page = np.where(rng.random(n) < 0.1, -1, rng.integers(0, 20, n))
        gen = rng.integers(0, 3, n)
        sr = np.where(rng.random(n) < 0.1, 0, rng.integers(1, 17, n))
        bad = np.where(rng.random(n) < 0.2, rng.integers(1, 1 << 16, n), 0)
        h, c = _index_reads_both_ways(row_cells, readers, page, gen, sr, bad)
        total[0] += h
        total[1] += c
    assert total[0] > 1000 and total[1] > 1000
    empty = np.zeros(0, np.int64)
    assert _index_reads_both_ways(np.array([0]), np.array([7]), empty, empty, empty, empty) == (0, 0)
    # one fold holding thousands of (page, generation, reader): the kernel's set starts at 1,024
    # entries and doubles past half full, several times here
    row_cells = np.full(500, 40)
    n = int(row_cells.sum())
    page, gen = rng.integers(0, 3000, n), rng.integers(0, 4, n)
    holds, _ = _index_reads_both_ways(row_cells, rng.integers(0, 50, 500), page, gen, rng.integers(1, 17, n), np.zeros(n, np.int64))
    assert holds > 8000


@NEEDS_CC
def test_the_native_index_reads_on_an_incident(tmp_path, monkeypatch):
    """The inputs of every fold of the exposure index during a GLM-5.3 vulnerable replay, both ways
    (failing reads among them); the index that replay kept, and that of the same replay on the numpy
    path, each equal to the as-of join over its ledger."""
    from engine.replay.glm53 import glm53
    import telemetry.ledger as L
    seen = []
    real = L._index_reads

    def spy(*a):
        seen.append(tuple(np.array(x, copy=True) for x in a))
        return real(*a)
    monkeypatch.setattr(L, "_index_reads", spy)
    from telemetry.recorder import recording
    kw = dict(context=1024, victims=2, background=4, max_tokens=48, seed=3)
    glm53("vulnerable", "disaggregated", recorder=recording(tmp_path / "c"), **kw)
    monkeypatch.setattr(L, "_index_reads", lambda *a: None)          # the numpy path
    glm53("vulnerable", "disaggregated", recorder=recording(tmp_path / "np"), **kw)
    monkeypatch.setattr(L, "_index_reads", real)
    assert seen
    counts = np.array([_index_reads_both_ways(*a) for a in seen])
    assert counts[:, 0].sum() > 0 and counts[:, 1].sum() > 0, counts.sum(axis=0)
    for store in ("c", "np"):                  # each replay's index = the as-of join over its ledger
        fx = Forensics(tmp_path / store)
        chk = fx.verify_index()
        assert fx.indexed and chk.ok and chk.join_rows > 0, (store, chk)


def test_the_store_writer_runs_at_idle_priority_unless_told_otherwise(tmp_path, monkeypatch):
    """SCHED_IDLE for the writer thread by default (the engine's cores first; an overdue flush is
    raised back: test_store's kill -9 test); normal when asked, by argument or
    KVLEDGER_WRITER_PRIORITY; anything else is refused before a store is opened."""
    import os
    cases = [({}, None, os.SCHED_IDLE, "idle"), ({"writer_priority": "normal"}, None, os.SCHED_OTHER, "normal"),
             ({}, "normal", os.SCHED_OTHER, "normal"), ({"writer_priority": "idle"}, "normal", os.SCHED_IDLE, "idle")]
    for i, (kw, env, policy, named) in enumerate(cases):
        if env is None:
            monkeypatch.delenv("KVLEDGER_WRITER_PRIORITY", raising=False)
        else:
            monkeypatch.setenv("KVLEDGER_WRITER_PRIORITY", env)
        tel = Telemetry(tmp_path / f"s{i}", model_name="recall", **kw)
        tel.writer.flush()                                  # the thread has set its policy by now
        assert os.sched_getscheduler(tel.writer._thread.native_id) == policy
        assert os.sched_getscheduler(0) == os.SCHED_OTHER   # the caller (the engine's thread) is untouched
        assert tel.close()["writer_priority"] == named
    with pytest.raises(InputError, match="writer priority must be idle or normal"):
        Telemetry(tmp_path / "bad", model_name="recall", writer_priority="realtime")
    assert not (tmp_path / "bad").exists()


def test_a_writer_that_falls_behind_stops_the_engine_at_the_bound_and_loses_nothing(tmp_path):
    """The engine hands steps over without waiting until MAX_WAITING_CELLS block-table cells wait
    for a writer that does not keep up; then it waits until the writer has caught up. Every step
    is still written."""
    tel = Telemetry(tmp_path / "s", model_name="recall", metric_interval=60, flush_interval=600)
    tel.ledger.FOLD_CELLS, tel.ledger.MAX_WAITING_CELLS = 8, 32
    stalled, release = threading.Event(), threading.Event()

    def stall():                               # occupies the writer thread, as a starved writer would be
        stalled.set()
        release.wait(30)
        return []
    tel.writer.submit_lazy(stall)
    assert stalled.wait(10)
    eng = _engine(tel)
    done = threading.Event()

    def decode():
        eng.generate(["the quick brown fox jumps over the lazy dog " * 3] * 2, SamplingParams(max_tokens=24))
        done.set()
    threading.Thread(target=decode, daemon=True).start()
    deadline = time.time() + 30
    while tel.ledger._cells_in - tel.ledger._cells_out <= tel.ledger.MAX_WAITING_CELLS and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    waiting = tel.ledger._cells_in - tel.ledger._cells_out
    assert not done.is_set() and tel.ledger.MAX_WAITING_CELLS < waiting <= tel.ledger.MAX_WAITING_CELLS + 64, waiting
    release.set()                                  # the writer catches up; the engine goes on
    assert done.wait(60)
    steps = eng.steps
    counts = tel.close()
    assert counts["ledger_waited_s"] > 0.3
    con = open_store(tmp_path / "s")
    assert con.sql("SELECT max(step_last) FROM page_reads").fetchall() == [(steps,)]
    assert con.sql("SELECT sum(n_slots) FROM page_writes").fetchall()[0][0] == 2 * (3 * 44 + 24) - 2
