"""Forensics reconstructs, from the store alone, exactly what the oracle of DESIGN.md sees:
(response, donor incarnation, node, page, position) sets equal - precision and recall 1.0."""
from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from telemetry import open_store
from telemetry.recorder import recording
from engine.disagg.cluster import Guards
from engine.replay.glm53 import glm53
from forensics.queries.duckdb import Forensics
from engine.commands.main import main
from tests.conftest import GLM53_SMALL, rewrite_store

pytestmark = pytest.mark.xdist_group("glm53")


def oracle_set(res) -> set[tuple]:
    return {tuple(e) for ex in res.exposures.values() for e in ex if e.donor != e.response}


def forensic_set(store) -> set[tuple]:
    slots = Forensics(store).exposure_slots()
    return set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"]))


def test_vulnerable_exposures_equal_the_oracle_slot_for_slot(glm53_vulnerable):
    res, store = glm53_vulnerable
    truth, found = oracle_set(res), forensic_set(store)
    assert truth, "the vulnerable replay must expose something"
    assert found == truth                       # precision and recall exactly 1.0


@pytest.mark.parametrize("run", ["glm53_hardened", "glm53_unified"])
def test_nothing_reported_where_the_oracle_sees_nothing(run, request):
    res, store = request.getfixturevalue(run)
    assert oracle_set(res) == set() and forensic_set(store) == set()
    assert Forensics(store).exposures().is_empty()


def test_exposure_rows_name_every_over_pool_response_and_its_donors(glm53_vulnerable):
    res, store = glm53_vulnerable
    ex = Forensics(store).exposures()
    assert set(ex["response"]) == {r.incarnation for r in res.over_pool}
    for r in res.over_pool:
        donors = {e.donor for e in res.exposures[r.incarnation]} - {r.incarnation}
        assert set(ex.filter(ex["response"] == r.incarnation)["donor"]) == donors
    assert set(ex["kinds"].explode()) <= {"stale", "foreign", "unwritten"}
    assert (ex["foreign_tokens"] > 0).all() and (ex["attention_mass"] >= 0).all()


def test_cli_counts_equal_the_oracle(glm53_vulnerable, capsys):
    res, store = glm53_vulnerable
    assert main(["forensics", "exposures", "--store", str(store), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # 63-bit ids travel as decimal strings (a JSON number is a double to jq and JavaScript: ids collapse)
    assert all(isinstance(r["response"], str) and isinstance(r["donor"], str) for r in rows)
    assert all(r["first_read"].endswith("Z") for r in rows)              # times carry their zone
    assert {(int(r["response"]), int(r["donor"])) for r in rows} == {t[:2] for t in oracle_set(res)}
    assert sum(r["foreign_tokens"] for r in rows) == len({(t[0], t[1], t[2], t[4]) for t in oracle_set(res)})


def test_usage_honesty_and_the_impact_predicate_find_the_victims(glm53_vulnerable):
    res, store = glm53_vulnerable
    fx = Forensics(store)
    ttft = fx.query("ttft")
    dishonest = set(ttft.filter(ttft["usage_dishonest"])["incarnation"])
    assert dishonest == {r.incarnation for r in res.over_pool}          # billed 700+ tokens, prefilled 1
    impact = fx.query("impact")
    assert set(impact["incarnation"]) == {r.incarnation for r in res.over_pool}
    assert (impact["prompt_tokens_billed"] > impact["pool_tokens"]).all()


@pytest.mark.xdist_group("runs")
@pytest.mark.parametrize("fixture", ["glm53_vulnerable", "mixed"])
def test_ttft_and_runs_answer_without_building_the_n_gram_evidence_and_alike_after_it(fixture, request):
    """ttft's floor leaves out the window's exposed responses - exposure_pairs_in's, the same responses
    as exposures_in's without its n-gram evidence - and runs reads the slot rows' pairs: on a snapshot
    where nothing else was asked, neither builds the evidence (~1 s at 121 M read rows with nothing
    kept), and each answers as on a snapshot that built it first."""
    store = request.getfixturevalue(fixture)[0] if fixture == "mixed" else request.getfixturevalue(fixture)[1]
    fresh, after = Forensics(store, answer_cache=False), Forensics(store, answer_cache=False)
    exposed = set(after.query("exposures")["response"])
    assert "exposure_ngrams" in after._made and exposed
    for q in ("ttft", "runs"):
        assert_frame_equal(fresh.query(q), after.query(q))
        assert "exposure_ngrams" not in fresh._made, q
    ttft = fresh.query("ttft")
    # the floor's healthy requests are those neither exposed nor billed over their prefill
    healthy = ttft.filter(~pl.col("usage_dishonest") & ~pl.col("incarnation").is_in(list(exposed))
                          & (pl.col("prompt_tokens_prefilled") >= 32))
    assert ttft["healthy_requests"][0] == healthy.height < ttft.height
    assert set(ttft["incarnation"]) & exposed      # (exposed responses are rows, not in the floor)
    assert_frame_equal(fresh.query("exposures"), after.query("exposures"))     # then built, as usual
    assert "exposure_ngrams" in fresh._made


def test_preflight_and_guard_liveness_come_from_the_store(glm53_vulnerable, glm53_hardened):
    pre = Forensics(glm53_vulnerable[1]).query("preflight")
    small = pre.filter(pre["node"] == "prefill0")
    assert not small["pool_fits_context"][0] and small["policy"][0] == "vulnerable"
    guards = Forensics(glm53_hardened[1]).query("guards")
    on = guards.filter(guards["enabled"])
    assert set(on["guard"]) == set(Guards.__dataclass_fields__)
    assert not guards["idle_but_on"].any(), guards.filter(guards["idle_but_on"])
    # reject_before_bootstrap rejected the over-pool prompts at the router, so downstream guards never saw them
    rbb = guards.filter(guards["guard"] == "reject_before_bootstrap")
    assert rbb["failed"][0] == GLM53_SMALL["victims"]
    assert not guards.filter(guards["guard"] == "read_check")["idle_but_on"][0]
    assert (Forensics(glm53_vulnerable[1]).query("guards")["enabled"] == False).all()  # noqa: E712


def test_transfers_show_reserved_versus_landed_sets(glm53_vulnerable):
    res, store = glm53_vulnerable
    tr = Forensics(store).query("transfers")
    bad = tr.filter(~tr["landed_equals_reserved"])
    assert set(bad["incarnation"]) == {r.incarnation for r in res.over_pool}
    assert (bad["landed"] == 1).all() and (bad["outcome"] == "admitted").all()   # vulnerable decode trusted it


def test_without_the_ledger_writer_forensics_says_it_cannot_answer(tmp_path, capsys):
    """The ledger is the only source: switch its writer off and the reconstruction fails - and every
    reader says so instead of answering "0" (absence of evidence is not evidence of absence)."""
    store = tmp_path / "no-ledger"
    res = glm53("vulnerable", "disaggregated", recorder=recording(str(store), record_ledger=False),
                **{**GLM53_SMALL, "victims": 1, "background": 4})
    assert oracle_set(res), "the oracle still sees the leak"
    assert forensic_set(store) == set()
    runs = Forensics(store).query("runs")
    assert runs["page_ledger"].to_list() == [False] and runs["exposed_responses"].to_list() == [None]
    assert_frame_equal(Forensics(store).page_ledgers(), runs.select("boot", "page_ledger"))   # what commands read
    boot = runs["boot"][0]
    for query in ("exposures", "scores", "tenants", "tenant_scores"):
        assert main(["forensics", query, "--store", str(store), "--format", "json"]) == 3, query
        err = capsys.readouterr().err
        assert f"page-level exposure cannot be answered for run {boot}: no page ledger was recorded" in err
    assert main(["forensics", "runs", "--store", str(store)]) == 0
    assert "cannot be answered" in capsys.readouterr().err
    assert main(["forensics", "impact", "--store", str(store), "--format", "json"]) == 0      # the spans still answer
    assert len(json.loads(capsys.readouterr().out)) == len(res.over_pool)
    from forensics.report import build, markdown
    rep = build(store)
    assert rep["coverage"]["runs_without_ledger"] == [boot] and rep["counts"]["runs_without_ledger"] == 1
    assert "cannot be established" in rep["what_happened"]["summary"] and rep["clock_72h"]["deadline"] is None
    assert "no page ledger was recorded" in markdown(rep) and "No response read" not in markdown(rep)


def test_a_store_copy_is_enough(glm53_vulnerable, tmp_path):
    """Forensics needs nothing but the store directory (e.g. shipped to the security team)."""
    res, store = glm53_vulnerable
    copy = tmp_path / "copy"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("writer.lock"))
    assert forensic_set(copy) == oracle_set(res)


def test_disclosure_report_counts_equal_the_oracle_and_leak_nothing(glm53_vulnerable, tmp_path, capsys):
    res, store = glm53_vulnerable
    out = tmp_path / "report"
    aware = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).replace(tzinfo=None, microsecond=0)
    assert main(["report", "--store", str(store), "--out", str(out),
                 "--event", f"{aware.isoformat()} report received from a customer"]) == 0
    rep = json.loads((out / "report.json").read_text())                 # validated against the schema on write
    truth = oracle_set(res)
    assert rep["counts"]["affected_responses"] == len({t[0] for t in truth})
    assert rep["counts"]["donor_requests"] == len({t[1] for t in truth} - {-1})
    assert rep["counts"]["foreign_tokens"] == len({(t[0], t[1], t[2], t[4]) for t in truth if t[1] != -1})
    assert rep["counts"]["usage_dishonest_responses"] == len(res.over_pool)
    assert rep["provenance"]["chain_ok"] and len(rep["provenance"]["query_sha256"]) >= 10
    assert rep["clock_72h"]["deadline"] == (aware + dt.timedelta(hours=72)).isoformat() + "Z"
    assert rep["generated_at"].endswith("Z") and all(e["time"].endswith("Z") for e in rep["timeline"])
    assert [r["policy"] for r in rep["runs"]] == ["vulnerable"] and "## Runs covered" in (out / "report.md").read_text()
    assert {int(r["incarnation"]) for r in rep["what_happened"]["over_pool_requests"]} == {r.incarnation for r in res.over_pool}
    surfaced = {int(r["response"]) for r in rep["responses"] if r["surfaced"]}
    assert {inc for inc, _, _ in res.surfaced} <= surfaced      # every canary that surfaced is flagged
    text = "".join(p.read_text() for p in out.iterdir())
    for secret in list(res.canaries) + ["acme", "globex", "initech", "umbrella"]:
        assert secret not in text
    assert "<table>" in (out / "report.html").read_text()
    assert main(["report", "--store", str(store), "--out", str(out), "--event", "yesterday lunch"]) == 2
    assert "expected 'ISO-TIME what happened'" in capsys.readouterr().err


@pytest.mark.parametrize("args,error", [
    (["--event", "2026-09-01T10:00 report received"], "is before the first foreign read"),
    (["--event", "2026-09-01T10:00+02:00 declared an incident"], "is before the first foreign read"),
    (["--from", "2026-09-02T00:00", "--to", "2026-09-01T00:00"], "is after --to"),
    (["--run", "ffffffffffffffff"], "no run with that boot id"),
])
def test_report_refuses_a_clock_or_window_that_cannot_be_true(glm53_vulnerable, tmp_path, capsys, args, error):
    _, store = glm53_vulnerable
    assert main(["report", "--store", str(store), "--out", str(tmp_path / "r"), *args]) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "r").exists(), "nothing is written on a refused report"


def test_an_early_awareness_time_is_accepted_when_forced(glm53_vulnerable, tmp_path):
    _, store = glm53_vulnerable
    assert main(["report", "--store", str(store), "--out", str(tmp_path / "r"), "--allow-early-awareness",
                 "--event", "2026-09-01T10:00+02:00 report received"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["clock_72h"]["became_aware"] == "2026-09-01T08:00:00Z"      # written in UTC, zone named


def test_scores_add_up_per_tenant_and_window(glm53_vulnerable, capsys):
    res, store = glm53_vulnerable
    fx = Forensics(store)
    per_response, per_tenant = fx.query("scores"), fx.query("tenant_scores", bucket_s=3600)
    assert per_tenant["score"].sum() == per_response["score"].sum() > 0
    assert set(per_tenant["tenant"]) == set(per_response["tenant"])
    assert per_tenant["responses"].sum() == per_response.height == len(res.foreign_readers)
    assert main(["forensics", "tenant_scores", "--store", str(store), "--bucket", "0"]) == 2
    assert "--bucket must be in [1, 315360000] seconds" in capsys.readouterr().err


def test_queries_side_by_side_equal_each_query_alone(glm53_vulnerable):
    _, store = glm53_vulnerable
    names = ["exposures", "scores", "tenants", "ttft", "transfers", "guards", "preflight", "releases"]
    together = Forensics(store).queries(names)            # fresh snapshot: materialised on the way
    alone = Forensics(store)
    for n in names:        # floating sums (attention mass) may add up in another order: equal to 1e-9
        assert_frame_equal(together[n], alone.query(n), rel_tol=1e-9, abs_tol=1e-12)
    assert together["exposures"].height > 0 and together["scores"].height > 0


def _relink(store) -> None:
    """Recompute every link of the chain over the files as they are now (no key: signatures stale)."""
    import hashlib

    from telemetry.store.chain import GENESIS, Link
    prev = GENESIS
    for f in sorted((store / "chain").glob("*.json")):
        body = json.loads(f.read_text())
        links = []
        for e in body["links"]:
            ln = Link(**{**e, "prev": prev, "sha256": hashlib.sha256((store / e["file"]).read_bytes()).hexdigest()})
            ln = ln._replace(link=ln.computed())
            links.append(ln._asdict())
            prev = ln.link
        body["links"] = links
        f.write_text(json.dumps(body))


def test_a_store_written_by_an_older_schema_still_opens_and_answers(glm53_vulnerable, tmp_path):
    """Columns added to schema.sql later (here preflight_action and advertised_context, and the
    transfers' set summaries) read as NULL in segments written before them; every query still runs,
    the exposures do not change and transfer integrity is computed from the slot lists instead."""
    import pyarrow.parquet as pq
    res, store = glm53_vulnerable
    old = tmp_path / "old-store"
    shutil.copytree(store, old)
    for seg in (old / "segments" / "config_snapshots").glob("*.parquet"):
        t = pq.read_table(seg)
        pq.write_table(t.drop_columns(["preflight_action", "advertised_context", "exposure_index"]), seg)
    for seg in (old / "segments" / "transfers").glob("*.parquet"):
        t = pq.read_table(seg)
        pq.write_table(t.drop_columns(["n_reserved", "n_sent", "n_landed", "landed_is_reserved"]), seg)
    _relink(old)            # the chain names the rewritten files' hashes; its signatures are then stale
    fx = Forensics(old, allow_unverified=True)
    assert fx.unverified_note and "not signed by this store's key" in fx.unverified_note and not fx.left_out
    assert not fx.indexed and Forensics(store).indexed      # no run says it wrote the index: the as-of join answers
    pre = fx.query("preflight")
    assert pre.height and pre["preflight_action"].is_null().all()
    assert set(zip(*(fx.exposure_slots()[c] for c in ('response', 'donor', 'node', 'page', 'position'))))\
        == forensic_set(store) == oracle_set(res)
    assert fx.exposures().height == Forensics(store).exposures().height
    now, then = Forensics(store).query("transfers"), fx.query("transfers")
    assert now.height > 0 and not now["landed_equals_reserved"].all()      # the incident's transfers differ
    assert then.sort("transfer_id").equals(now.sort("transfer_id"))


def test_segments_of_two_schemas_bound_by_their_known_columns_read_as_every_file_read_by_name(glm53_vulnerable,
                                                                                                 tmp_path):
    """A reader whose verification cache holds its segments' column signatures binds each table a
    group of segments per signature (no footer of every file read at each bind): where half of a
    table's segments lack columns added later, every table reads the same rows as when every file's
    schema is read by name (the path without signatures), the missing columns NULL; a file changed
    since its signature was taken misses it."""
    import pyarrow.parquet as pq

    from telemetry.store.chain import _sha, file_columns, read_chain
    from telemetry.store.reader import segment_files
    _, store = glm53_vulnerable
    old = tmp_path / "mixed-schema"
    shutil.copytree(store, old)
    segs = sorted((old / "segments" / "spans").glob("*.parquet"))
    assert len(segs) >= 2
    for seg in segs[::2]:
        pq.write_table(pq.read_table(seg).drop_columns(["ttft_s", "error_type"]), seg)
    _relink(old)
    cache: dict = {}
    for link in read_chain(old):
        _sha(old / link.file, cache)        # what a verification leaves in the reader's cache
    files = segment_files(old)
    sigs = {file_columns(f, cache) for f in files["spans"]}
    assert None not in sigs and len(sigs) == 2
    fast, slow = open_store(old, files=files, cache=cache), open_store(old, files=files)
    for table in files:
        a, b = (c.sql(f"SELECT * FROM {table}").pl() for c in (fast, slow))
        assert a.columns == b.columns and a.height == b.height, table
        assert a.sort(a.columns, nulls_last=True).equals(b.sort(b.columns, nulls_last=True)), table
    nulls, spans = fast.sql("SELECT count(*) FILTER (WHERE ttft_s IS NULL), count(*) FROM spans").fetchall()[0]
    assert 0 < nulls < spans and fast.sql("SELECT count(ttft_s) FROM spans").fetchall()[0][0] > 0
    pq.write_table(pq.read_table(segs[1]), segs[1], compression="zstd")     # changed: its signature misses
    assert file_columns(str(segs[1]), cache) is None


def test_the_report_reads_as_a_breach_notification(glm53_vulnerable, glm53_hardened, tmp_path):
    """Title block with the controller and DPO placeholders, the summary first with whether the
    exposure is contained now and which protections are in force, data subjects as cache scopes,
    the measures with their times; --include-excerpts in every format, the redaction explained."""
    from forensics.report import build, parse_event, write
    _, store = glm53_vulnerable
    rep = build(store, events=[parse_event("2099-01-01T00:00 read check switched on fleet-wide")], include_excerpts=True)
    st = rep["status_now"]
    assert st["contained"] is False and st["protections"] == [] and "NOT contained" in st["statement"]
    assert rep["counts"]["donor_scopes"] >= rep["counts"]["donor_tenants"] > 0
    assert rep["measures"][-1] == {"time": "2099-01-01T00:00:00Z", "measure": "read check switched on fleet-wide"}
    assert "fill in" in rep["notification"]["controller"] and "fill in" in rep["notification"]["dpo_contact"]
    paths = {p.name: p for p in write(rep, tmp_path / "r")}
    md, html = paths["report.md"].read_text(), paths["report.html"].read_text()
    # GDPR art. 33(3) (a)-(d) in order after the summary, then the evidence
    heads = ["## Summary", "## (a) Nature of the breach", "## (b) Contact point", "## (c) Likely consequences",
             "## (d) Measures taken and proposed", "## Runs covered", "## Counts", "## Whom to notify"]
    assert [md.index(h) for h in heads] == sorted(md.index(h) for h in heads)
    assert md.index("data protection officer") < md.index("## Summary")
    assert "data subjects" not in md.replace("estimates the data subjects", "")   # accounts are not people
    assert "each may hold data about many people" in md and "## Words used in this report" in md
    assert "running under policy" not in md          # measures are what changed, not the state a node ran in
    summary = rep["what_happened"]["summary"]
    assert "another customer's" in summary and "only their own tenant's" in summary
    heads_row = "| responses that read KV of other requests | "
    assert heads_row + f"{rep['counts']['cross_tenant_responses']} | {rep['counts']['same_tenant_only_responses']} |" in md
    for n in rep["notifications"]:                   # the worst case first, no comfort where there is none
        if set(n["roles"]) & {"donor", "donor-surfaced", "recipient"}:
            assert "no other customer's data was involved" not in n["statement"]
        assert n["first_read"].endswith("Z") and n["what_to_do"]
    order = ["donor-surfaced", "donor", "recipient", "same-tenant"]
    assert [order.index(n["role"]) for n in rep["notifications"]] == sorted(order.index(n["role"])
                                                                            for n in rep["notifications"])
    assert "| measure | count |" in md and "<th></th><th></th>" not in html.replace("\n", "")
    assert "## Evidence excerpts" in md and "Redacted by construction" in md and "keyed n-grams" in html
    excerpts = paths["excerpts.csv"].read_text().splitlines()
    assert excerpts[0] == "response,donor,evidence,shared_ngrams" and len(excerpts) == len(rep["excerpts"]["pairs"]) + 1
    assert "narrower" in md          # report "surfaced" vs the replay's "canaries surfaced", explained
    hardened = build(glm53_hardened[1])
    assert hardened["status_now"]["contained"] is True and "read_check" in hardened["status_now"]["protections"]
    # nothing exposed: no incident story, no 72-hour clock, but what the guards prevented
    assert hardened["counts"]["affected_responses"] == 0 and hardened["clock_72h"]["deadline"] is None
    assert "No response read KV cache" in hardened["what_happened"]["summary"]
    assert "reject path" not in hardened["what_happened"]["summary"] and hardened["what_happened"]["cwe"] == []
    assert any("refused" in p for p in hardened["prevented"]) and "The guards prevented" in hardened["what_happened"]["summary"]
    assert "no 72-hour" in hardened["clock_72h"]["note"] and hardened["data_categories"] == []
    plain = write(build(store), tmp_path / "plain")
    assert "excerpts.csv" not in {p.name for p in plain} and "Evidence excerpts" not in (tmp_path / "plain" / "report.md").read_text()


def test_the_html_report_renders_as_a_document_in_a_browser(glm53_vulnerable, tmp_path):
    """Rendered by Chromium at 1200 px, as a person opens it: the title block and summary come
    first, nothing is wider than the page, no table has an empty header row (screenshot kept)."""
    from playwright.sync_api import sync_playwright

    from forensics.report import build, write
    from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS
    write(build(glm53_vulnerable[1], include_excerpts=True), tmp_path / "r")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto((tmp_path / "r" / "report.html").as_uri())
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        if os.environ.get("KVLEDGER_KEEP_SCREENSHOTS"):             # to look at it, as a person would
            import shutil
            shutil.copy(tmp_path / "report.png", os.environ["KVLEDGER_KEEP_SCREENSHOTS"])
        heads = page.locator("h1, h2").all_inner_texts()
        wide = page.evaluate("document.documentElement.scrollWidth")
        empty_headers = page.evaluate("[...document.querySelectorAll('thead tr')].filter("
                                      "tr => [...tr.cells].every(c => !c.innerText.trim())).length")
        first_table = page.locator("table").first.inner_text()
        browser.close()
    assert heads[:3] == ["KV cache cross-request exposure - disclosure report", "Summary", "(a) Nature of the breach"]
    assert "data protection officer" in first_table and wide <= 1200 and empty_headers == 0
    assert (tmp_path / "report.png").stat().st_size > 50_000


def test_a_window_strictly_inside_one_exposure_finds_it(glm53_vulnerable, tmp_path):
    """A response is in a window when any of its foreign reads is: a read run that began before the
    window and ended after it counts (the old rule kept only reads that *began* inside it)."""
    import polars as pl
    _, store = glm53_vulnerable
    fx = Forensics(store)
    slots = fx.exposure_slots()
    run = slots.sort(pl.col("ts_last") - pl.col("ts_first"), descending=True).row(0, named=True)
    span = run["ts_last"] - run["ts_first"]
    assert span > dt.timedelta(0), "some read run must last more than one step"
    t0, t1 = run["ts_first"] + span / 3, run["ts_first"] + 2 * span / 3       # strictly inside that run
    inside = fx.query("exposures", t0, t1)
    assert run["response"] in set(inside["response"])
    overlapping = slots.filter((pl.col("ts_first") <= t1) & (pl.col("ts_last") >= t0))
    assert set(inside["response"]) == set(overlapping["response"])
    assert set(fx.query("scores", t0, t1)["response"]) <= set(inside["response"])
    after = slots["ts_last"].max() + dt.timedelta(seconds=1)
    assert fx.query("exposures", after, after + dt.timedelta(hours=1)).height == 0
    out = tmp_path / "r"
    assert main(["report", "--store", str(store), "--out", str(out), "--from", t0.isoformat(),
                 "--to", t1.isoformat()]) == 0
    rep = json.loads((out / "report.json").read_text())
    exposed = inside.filter(pl.col("evidence") != "blocked")
    assert rep["counts"]["affected_responses"] == exposed["response"].n_unique() > 0


def test_the_pdf_report_prints_every_id_and_header_word_whole(glm53_vulnerable, tmp_path, capsys):
    """`report --format pdf`: the HTML printed by Chromium with the print CSS; its pages rendered
    (pdftoppm) and read back (pdftotext): every response id and every table header word is on one
    line, never broken."""
    import re
    import subprocess
    _, store = glm53_vulnerable
    out = tmp_path / "r"
    assert main(["report", "--store", str(store), "--out", str(out), "--format", "pdf", "--include-excerpts"]) == 0
    pdf = out / "report.pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    subprocess.run(["pdftoppm", "-r", "40", "-png", str(pdf), str(tmp_path / "page")], check=True)
    pages = sorted(tmp_path.glob("page-*.png"))
    assert len(pages) >= 2 and all(p.stat().st_size > 2_000 for p in pages)
    text = subprocess.run(["pdftotext", "-layout", str(pdf), "-"], check=True, capture_output=True, text=True).stdout
    rep = json.loads((out / "report.json").read_text())
    ids = {r["response"] for r in rep["responses"]} | {p["donor"] for p in rep["excerpts"]["pairs"] if p["donor"] != "-1"}
    ids |= {n["tenant"] for n in rep["notifications"]} | {n["role"] for n in rep["notifications"]}
    broken = [i for i in ids if not re.search(rf"(?<![\w-]){re.escape(i)}(?![\w-])", text)]
    assert ids and not broken, f"broken across lines: {broken}"
    for word in ("prompt_tokens_billed", "advertised_context", "preflight_action", "what_to_do", "shared_ngrams"):
        assert word in text, f"header word {word} broken"
    assert "(a) Nature of the breach" in text and "(d) Measures taken and proposed" in text


def test_tenants_resolve_maps_pseudonyms_back_for_the_key_holder_only(glm53_vulnerable, tmp_path, capsys,
                                                                      monkeypatch):
    """From pseudonym back to customer: candidate names (a list, or serve's keys file) tried under
    the store's pseudonym key. Every pseudonym in the store resolves; without the key, refused;
    nothing in the store changes."""
    res, store = glm53_vulnerable
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    names = tmp_path / "names.txt"
    names.write_text("# candidates\nacme\nglobex\ninitech\numbrella\nnobody-at-all\n")
    assert main(["tenants", "resolve", "--store", str(store), "--names", str(names), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    pseudonyms = set(Forensics(store).requests()["tenant_h"].drop_nulls())
    assert {r["tenant"] for r in rows} == pseudonyms
    assert {r["name"] for r in rows} == {"acme", "globex", "initech", "umbrella"}    # every tenant found
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": "acme", "sk-b": {"tenant": "globex", "user": "u1"}}))
    assert main(["tenants", "resolve", "--store", str(store), "--names", str(keys), "--format", "json"]) == 0
    out = capsys.readouterr()
    assert {r["name"] for r in json.loads(out.out)} == {"acme", "globex", None}
    assert "2 of 4 pseudonym(s) matched no candidate name" in out.err
    monkeypatch.setenv("KVLEDGER_KEY_DIR", str(tmp_path / "not-the-keys"))
    assert main(["tenants", "resolve", "--store", str(store), "--names", str(names)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: refused: no pseudonym key of store") and "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == before                  # wrote nothing


@pytest.mark.parametrize("content,error", [
    (None, "no such file"), ("", "no names in it"), ("{not json", "is not JSON"),
    ('{"sk": 3}', "maps each API key to a tenant name"), ("x" * 2000, "longer than 1024 characters"),
])
def test_tenants_resolve_refuses_a_names_file_it_cannot_read(content, error, tmp_path, capsys, glm53_vulnerable):
    path = tmp_path / "names"
    if content is not None:
        path.write_text(content)
    assert main(["tenants", "resolve", "--store", str(glm53_vulnerable[1]), "--names", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: --names") and error in err and "Traceback" not in err


def _ngram_rule(store, shadow: str, extra_requests: str | None = None, edit_requests: str | None = None):
    """exposure_ngrams over the real store, its ``ngrams`` replaced by the view ``shadow`` (SQL over
    the stored rows), ``extra_requests`` (SQL rows) added to its requests and ``edit_requests`` (an
    UPDATE of ``temp.requests``) run on them: the rule's own SQL."""
    from forensics.queries.duckdb import sql
    fx = Forensics(store, answer_cache=False)      # its tables are edited: built here, never read back
    fx._ensure("requests")
    fx._ensure("exposure_slots")
    fx.con.execute("CREATE TEMP TABLE stored_ngrams AS SELECT * FROM ngrams")
    fx.con.execute(f"CREATE OR REPLACE TEMP VIEW ngrams AS {shadow}")
    if extra_requests or edit_requests:     # (a table of its own: the snapshot's requests may be a view, grown.py)
        fx.con.execute("CREATE TEMP TABLE requests AS SELECT * FROM main.requests")
    if extra_requests:
        fx.con.execute(f"INSERT INTO temp.requests BY NAME {extra_requests}")
    if edit_requests:
        fx.con.execute(edit_requests)
    rule = fx.con.sql(sql("exposure_ngrams")).pl()
    # what readers run - the rule in steps (forensics/queries/evidence.py) - gives the rule's rows here too
    from forensics.queries import evidence
    kept = dict(evidence._KEPT)
    evidence._KEPT.clear()                  # nothing kept over the stored rows: these are edited
    try:
        evidence.build(fx.con, store, fx.files["ngrams"], sql, disk=False)
        assert fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall() == sorted(rule.rows())
        # and with requests narrowed to the pairs' rows (a reader's exposure questions: Forensics.
        # materialise(narrow=True)), the rest of them added as the evidence names them (``cover``)
        evidence._KEPT.clear()
        fx.con.register("_every_request", fx.con.sql("SELECT * FROM requests").to_arrow_table())
        fx.con.execute("CREATE OR REPLACE TEMP TABLE requests AS SELECT * FROM _every_request SEMI JOIN "
                       "(SELECT response AS i FROM exposure_runs UNION SELECT donor FROM exposure_runs) ON incarnation = i")
        covered: set[int] = set()

        def cover(incarnations: set[int]) -> None:
            covered.update(incarnations)
            fx.con.execute("INSERT INTO temp.requests SELECT * FROM _every_request WHERE list_contains($i, incarnation) "
                           "AND incarnation NOT IN (SELECT incarnation FROM temp.requests)", {"i": sorted(incarnations)})
        fx.con.execute("DROP TABLE exposure_ngrams")
        evidence.build(fx.con, store, fx.files["ngrams"], sql, disk=False, cover=cover)
        assert fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall() == sorted(rule.rows())
        fx.con.execute("CREATE OR REPLACE TEMP TABLE requests AS SELECT * FROM _every_request")
    finally:
        evidence._KEPT.clear()
        evidence._KEPT.update(kept)
    fx.covered = covered
    return rule, fx


def _surfaced_pair(store):
    ng, fx = _ngram_rule(store, "SELECT * FROM stored_ngrams")
    assert ng.height, "the incident surfaces donor text"
    return ng.sort("shared_ngrams", descending=True).row(0, named=True), fx


def test_text_the_recipients_own_tenant_had_earlier_is_not_surfaced(glm53_vulnerable):
    """The recipient's output repeats the donor's text - but an earlier request of the recipient's
    own tenant held that text too: it may have come through the tenant's own traffic, not through
    the slots it read from the donor. Not evidence; the same request arriving later cancels nothing."""
    _, store = glm53_vulnerable
    pair, fx = _surfaced_pair(store)
    r, d = pair["response"], pair["donor"]
    me = fx.con.sql(f"SELECT tenant_h, arrived_at FROM requests WHERE incarnation = {r}").fetchall()[0]
    shadow = (f"SELECT * FROM stored_ngrams UNION ALL SELECT 99 AS incarnation, 'output' AS role, n, hash, 0 AS pos "
              f"FROM stored_ngrams WHERE incarnation = {r} AND role = 'output'")
    for offset, cancelled in (("- INTERVAL 1 SECOND", True), ("+ INTERVAL 1 SECOND", False)):
        extra = (f"SELECT 99::BIGINT AS incarnation, '{me[0]}' AS tenant_h, "
                 f"TIMESTAMP '{me[1]}' {offset} AS arrived_at")
        ng, gx = _ngram_rule(store, shadow, extra)
        still = ng.filter((ng["response"] == r) & (ng["donor"] == d)).height
        assert still == (0 if cancelled else 1), offset
        assert 99 in gx.covered         # a request outside every pair: its row added for the evidence


def test_the_donor_of_the_recipients_own_tenant_is_not_the_tenant_s_own_earlier_traffic(glm53_vulnerable):
    """A donor of the recipient's own tenant arrived before the recipient and holds the text in its
    prompt: the text still came through the slots read from that donor - the donor is not "an
    earlier request of the tenant's own" that would cancel it. The pair's evidence is unchanged
    when the donor is made one of the recipient's tenant's requests."""
    _, store = glm53_vulnerable
    pair, fx = _surfaced_pair(store)
    r, d = pair["response"], pair["donor"]
    (tenant, arrived), (_, donor_arrived) = (fx.con.sql(f"SELECT tenant_h, arrived_at FROM requests WHERE incarnation = {i}")
                                           .fetchall()[0] for i in (r, d))
    assert donor_arrived < arrived          # (the donor's KV was written before the recipient read it)
    ng, _ = _ngram_rule(store, "SELECT * FROM stored_ngrams",
                        edit_requests=f"UPDATE temp.requests SET tenant_h = '{tenant}' WHERE incarnation = {d}")
    assert ng.filter((ng["response"] == r) & (ng["donor"] == d))["shared_ngrams"].to_list() == [pair["shared_ngrams"]]


def test_text_outside_the_slots_read_from_the_donor_is_not_surfaced(glm53_vulnerable):
    """An n-gram of the donor's prompt counts only where the recipient read the donor's KV at its
    positions: moved past every position read, the same text is no evidence; without positions (a
    store written before them) it counts as before."""
    _, store = glm53_vulnerable
    pair, _ = _surfaced_pair(store)
    r, d = pair["response"], pair["donor"]
    far = ("SELECT incarnation, role, n, hash, CASE WHEN incarnation = {d} AND role = 'prompt' THEN {pos} "
           "ELSE pos END AS pos FROM stored_ngrams")
    ng, _ = _ngram_rule(store, far.format(d=d, pos="pos + 1000000"))
    assert ng.filter((ng["response"] == r) & (ng["donor"] == d)).height == 0
    ng, _ = _ngram_rule(store, far.format(d=d, pos="NULL"))
    assert ng.filter((ng["response"] == r) & (ng["donor"] == d))["shared_ngrams"].to_list() == [pair["shared_ngrams"]]


def _runs_of_positions(rows) -> list[tuple[int, int, int, int]]:
    """Maximal runs [lo, hi] of consecutive positions per (response, donor), by hand."""
    by: dict[tuple[int, int], set[int]] = {}
    for response, donor, position in rows:
        by.setdefault((response, donor), set()).add(position)
    out = []
    for (response, donor), positions in by.items():
        ordered = sorted(positions)
        lo = prev = ordered[0]
        for p in ordered[1:] + [None]:
            if p is None or p > prev + 1:
                out.append((response, donor, lo, prev))
                lo = p
            prev = p
    return sorted(out)


@pytest.mark.xdist_group("runs")
@pytest.mark.parametrize("fixture", ["glm53_vulnerable", "mixed"])
def test_the_read_runs_are_the_runs_of_the_donor_positions_exposure_slots_has(fixture, request):
    """The evidence's step 1a (evidence.read_runs over read_runs.sql's masks) folds each pair's read
    masks into the maximal runs of the donor positions the response read: those of exposure_slots'
    rows (one per slot) whose response the read check did not stop."""
    from forensics.queries import evidence
    from forensics.queries.duckdb import sql
    store = request.getfixturevalue(fixture)[0] if fixture == "mixed" else request.getfixturevalue(fixture)[1]
    fx = Forensics(store, answer_cache=False)
    fx.materialise(evidence=False)
    got = evidence.read_runs(fx.con.sql(sql("evidence/read_runs")).to_arrow_table())
    slots = fx.con.sql("SELECT response, donor, donor_position FROM exposure_slots ANTI JOIN "
                       "(SELECT incarnation AS response FROM requests WHERE error_type = 'ReadCheckViolation') "
                       "USING (response) WHERE donor <> -1 AND donor_position IS NOT NULL").fetchall()
    fx.close()
    assert slots and sorted(zip(*[got.column(c).to_pylist() for c in ("response", "donor", "lo", "hi")])) \
        == _runs_of_positions(slots)


def test_the_read_runs_fold_any_masks_as_their_bits_say():
    """Masks of one or many intervals, bit 63 set, empty, bits at or above the page's width (not
    slots: ignored; a width below 1 has none), intervals of one pair that overlap, touch or not across rows, several pairs:
    the runs of the positions the masks' bits name, by hand."""
    import numpy as np
    import pyarrow as pa
    from forensics.queries.evidence import read_runs
    rng = np.random.default_rng(7)
    special = np.array([-1, 0, 1, -2 ** 63, 2 ** 62, 0x0F0F, 0x70, 0xFFFF0000FFFF, 0b1011], np.int64)
    for trial in range(300):
        n = int(rng.integers(0, 40))
        mask = np.where(rng.random(n) < 0.5, rng.integers(-2 ** 63, 2 ** 63 - 1, n, dtype=np.int64),
                        special[rng.integers(0, len(special), n)])
        width = rng.choice([-3, 0, 8, 16, 32, 64], n)      # (a page size below 1: no slots)
        masks = pa.table({"response": rng.integers(0, 3, n), "donor": rng.integers(0, 3, n),
                          "position_offset": rng.integers(0, 150, n).astype(np.int32),
                          "slot_mask": pa.array(mask, pa.int64()), "width": width.astype(np.int32)})
        want = _runs_of_positions([(r, d, off + s) for r, d, off, m, w in zip(*[masks.column(c).to_pylist() for c in masks.column_names])
                                   for s in range(w) if (m >> s) & 1])
        got = read_runs(masks)
        assert got.schema.names == ["response", "donor", "lo", "hi"]
        assert sorted(zip(*[got.column(c).to_pylist() for c in got.column_names])) == want, trial


@pytest.mark.parametrize("absent", [0, 200, 6000])
def test_the_evidence_finds_the_pairs_rows_alike_with_the_join_s_values_pushed_into_the_scan_or_not(
        glm53_vulnerable, absent):
    """The pairs' ngrams rows (and a candidate hash's) are found by a semi join whose values DuckDB
    pushes into the scan as a filter (row groups of other incarnations skipped) for up to PUSHED of
    them (DuckDB's own default: 50): with the pairs' incarnations alone, with 200 absent ones added
    (pushed beyond DuckDB's default) and with 6000 (more than PUSHED: not pushed), the rows an IN
    list gives, and the connection's setting is DuckDB's default again after each lookup (other
    queries on it are not changed); the evidence is the rule's."""
    from forensics.queries import evidence
    from forensics.queries.duckdb import sql
    _, store = glm53_vulnerable
    evidence._KEPT.clear()
    fx = Forensics(store, answer_cache=False)
    fx.materialise()
    incs = evidence._ids(fx.con, sql("evidence/pairs"), "incarnation")
    values = incs | set(range(-absent, 0))
    rows = lambda t: sorted(zip(*[t.column(c).to_pylist() for c in evidence.COLUMNS]), key=repr)  # noqa: E731
    whole = fx.con.table("ngrams")
    got = evidence._rows(fx.con, whole, "incarnation", values, evidence.COLUMNS)
    want = whole.filter(f"incarnation IN ({', '.join(map(str, incs))})").select(*evidence.COLUMNS).to_arrow_table()
    assert got.num_rows > 0 and rows(got) == rows(want)
    assert fx.con.sql("SELECT current_setting('dynamic_or_filter_threshold')").fetchall() == [(50,)]
    h = got.column("hash")[0].as_py()
    hits = evidence._rows(fx.con, whole, "hash", {h} | set(range(-absent, 0)), ["incarnation", "role", "hash"])
    assert hits.num_rows > 0 and set(hits.column("hash").to_pylist()) == {h}
    assert fx.con.sql("SELECT current_setting('dynamic_or_filter_threshold')").fetchall() == [(50,)]
    ev = fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall()
    assert ev and ev == fx.con.sql(f"SELECT * FROM ({sql('exposure_ngrams')}) ORDER BY ALL").fetchall()
    fx.close()
    evidence._KEPT.clear()


def test_the_evidences_kept_rows_outlive_the_process_and_a_bad_entry_is_ignored(glm53_vulnerable, monkeypatch):
    """A build that read the whole ngrams table leaves its rows and its answer in the state
    directory: the next process (here: this one with its memory cleared) starts from them, scans
    nothing and reuses the answer (the same pairs, rows and requests) - not where other steps' SQL
    or another DuckDB made it; an entry cut short, or one whose segment changed since, is ignored
    (the whole table is read again), and the answer is the rule's every time."""
    from forensics.queries import evidence
    from forensics.queries.duckdb import sql
    _, store = glm53_vulnerable

    def build() -> tuple[list, dict]:
        evidence._KEPT.clear()                 # a new process
        evidence._SAVED.clear()
        before = dict(evidence.stats)
        fx = Forensics(store)
        fx.answers = None                      # as on a store that changed: the tables are built
        fx.materialise()
        got = fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall()
        assert got and got == fx.con.sql(f"SELECT * FROM ({sql('exposure_ngrams')}) ORDER BY ALL").fetchall()
        fx.close()
        return got, {k: evidence.stats[k] - before[k] for k in before}
    first, _ = build()
    again, read = build()
    assert again == first and read == {"whole_scans": 0, "new_segment_reads": 0, "loaded": 1, "reused": 1,
                                     "carried": 0, "rebuilt": 0}
    with monkeypatch.context() as m:            # other SQL made the kept answer: the rows only
        m.setattr(evidence, "_ident", lambda sql: "other steps")
        again, read = build()
    assert again == first and read == {"whole_scans": 0, "new_segment_reads": 0, "loaded": 1, "reused": 0,
                                     "carried": 0, "rebuilt": 0}
    d = evidence._dir(str(store.resolve()))
    evidence.entry_written(d)                   # (written on a thread of its own)
    (next(d.glob("hits-*.arrow"))).write_bytes(b"ARROW1 cut short")
    again, read = build()
    assert again == first and read["loaded"] == 0 and read["whole_scans"] == 2
    evidence.entry_written(d)                   # (the rebuilt entry: written on a thread of its own)
    meta = json.loads((d / "meta.json").read_text())
    seg = next(iter(meta["files"]))
    meta["files"][seg][2] -= 1                 # the segment's change time is not the one kept
    (d / "meta.json").write_text(json.dumps(meta))
    again, read = build()
    assert again == first and read["whole_scans"] == 2 and read["rebuilt"] == 1


def test_kept_entries_are_written_off_the_answer_s_path_whole_and_in_the_order_made(tmp_path, monkeypatch):
    """grown.py's and evidence.py's entries are written on a thread of their own (write_entry_later):
    while a write is held back nothing of it is visible, a second write of the same entry waits for
    the first, the entry's loader (entry_written) waits for both, and the entry is then the last
    one made, whole, with no file of the first left beside it."""
    import threading
    import pyarrow as pa
    from forensics.queries import answers
    gate, real = threading.Event(), answers.write_entry
    monkeypatch.setattr(answers, "write_entry", lambda d, tables, meta: gate.wait(10) and real(d, tables, meta))
    d = tmp_path / "entry"
    answers.write_entry_later(d, {"t": pa.table({"x": [1]})}, {"n": 1})
    answers.write_entry_later(d, {"t": pa.table({"x": [2, 3]})}, {"n": 2})
    assert not d.exists()
    gate.set()
    answers.entry_written(d)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["n"] == 2 and sorted(p.name for p in d.iterdir()) == ["meta.json", f"t-{meta['gen']}.arrow"]
    with pa.ipc.open_file(d / f"t-{meta['gen']}.arrow") as f:
        assert f.read_all().column("x").to_pylist() == [2, 3]


def test_a_kept_entry_is_read_mapped_and_a_table_read_stays_whole_when_the_entry_is_rewritten(tmp_path):
    """Kept tables and answers are memory-mapped, not copied into Arrow's memory (an idle store's
    dashboard reads ~100 MB of them back on every refresh at 121 M read rows); a table read from an
    entry keeps its values when the entry is written again and the file it was mapped from removed."""
    import numpy as np
    import pyarrow as pa
    from forensics.queries import answers
    d = tmp_path / "entry"
    big = pa.table({"x": pa.array(np.arange(1_000_000, dtype=np.int64))})
    assert answers.write_entry(d, {"t": big}, {"n": 1})
    path = d / f"t-{json.loads((d / 'meta.json').read_text())['gen']}.arrow"
    before = pa.total_allocated_bytes()
    t = answers.read_kept(path)
    assert pa.total_allocated_bytes() - before < big.nbytes // 100       # mapped: 8 MB not copied
    assert answers.write_entry(d, {"t": pa.table({"x": [7]})}, {"n": 2}) and not path.exists()
    assert t.equals(big)


def test_a_response_cut_off_mid_decode_keeps_its_tenant_and_is_counted(tmp_path):
    """Issue 33: a response still decoding (or cut off by a crash) had no request row: tenant NULL,
    same_tenant wrong, not counted by runs or the report. Its arrival is now written by the ledger
    before its first read, so everything but what its end would have said is known."""
    from engine.replay.glm53 import glm53
    from forensics.report import build
    from telemetry.recorder import Telemetry
    from tests.conftest import GLM53_SMALL

    class Cut(Exception):
        pass
    opened, done = [], [0]

    def factory(**kw):
        opened.append(Telemetry(tmp_path / "cut", **kw))
        return opened[-1]

    def progress(n, total=None):                 # the replay stops, mid-decode, after 9 finished requests
        done[0] += n
        if done[0] >= 9:
            raise Cut
    with pytest.raises(Cut):
        glm53("vulnerable", recorder=factory, progress=progress, **GLM53_SMALL)
    opened[0].writer.flush()                     # its writer still live: the running responses are in flight
    live = Forensics(tmp_path / "cut").query("exposures").filter(~pl.col("response_finished"))
    assert live.height and set(live["response_state"]) == {"in flight"}
    opened[0].close()                            # what a crash leaves: rows, no end for the running requests
    fx = Forensics(tmp_path / "cut")
    req = fx.requests()
    running = set(req.filter(~pl.col("finished"))["incarnation"])
    ex = fx.query("exposures")
    cut = ex.filter(pl.col("response").is_in(list(running)))
    assert cut.height, "some response was reading foreign KV when it was cut off"
    assert cut["response_tenant"].null_count() == 0 and not cut["same_tenant"].any()
    assert set(cut["response_state"]) == {"cut off"} and not cut["response_finished"].any()
    assert set(ex.filter(~pl.col("response").is_in(list(running)))["response_state"]) == {"finished"}
    umbrella = req.filter(pl.col("incarnation").is_in(list(running)) & (pl.col("prompt_tokens_billed") > 656))
    assert set(cut["response_tenant"]) <= set(umbrella["tenant_h"])
    runs = fx.query("runs")
    assert runs["unfinished"][0] == len(running) and runs["requests"][0] == req.height
    rep = build(tmp_path / "cut")
    listed = {int(r["response"]) for r in rep["responses"]}
    assert set(cut["response"]) <= listed
    assert rep["counts"]["unfinished_responses"] == cut["response"].n_unique()
    assert {r["response_state"] for r in rep["responses"] if int(r["response"]) in running} == {"cut off"}
    # judged on what it had streamed: its prompt and its output so far are in the n-grams, each
    # window inside what it had decoded (written to its KV) plus the token just sampled
    con = open_store(tmp_path / "cut")
    decoded = dict(con.sql("SELECT writer, sum(n_slots) FROM page_writes WHERE path = 'decode' GROUP BY ALL").fetchall())
    ng = {(i, role): end for i, role, end in
          con.sql("SELECT incarnation, role, max(pos) + any_value(n) FROM ngrams GROUP BY ALL").fetchall()}
    assert all((i, "prompt") in ng for i in running)
    streamed = [i for i in running if (i, "output") in ng]
    assert streamed, "no running response's streamed output was hashed"
    assert all(ng[(i, "output")] <= decoded.get(i, 0) + 1 for i in streamed)
    # the umbrella request cut off mid-decode had already repeated a victim's text: surfaced, on
    # its streamed tokens alone (before, only a finished response's output was ever hashed)
    assert "surfaced" in ex.filter(pl.col("response").is_in(streamed))["evidence"].to_list()


# ---- the exposure index: written by the ledger writer, verified against the as-of join ----------------
@pytest.mark.parametrize("fixture", ["glm53_vulnerable", "glm53_hardened", "glm53_unified"])
def test_the_exposure_index_equals_the_as_of_join(fixture, request, capsys):
    res, store = request.getfixturevalue(fixture)
    fx = Forensics(store)
    chk = fx.verify_index()
    assert fx.indexed and chk.ok, chk
    assert chk.join_rows >= len(oracle_set(res)) and (chk.join_rows > 0) is (fixture == "glm53_vulnerable" or
                                                                          bool(res.blocked_set))
    assert main(["forensics", "verify-index", "--store", str(store)]) == 0
    assert "exposure index == as-of join" in capsys.readouterr().out
    assert main(["forensics", "verify-index", "--store", str(store), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["join_rows"] == out["index_rows"] == chk.join_rows and out["differences"] == []
    # the index is small beside the ledger it answers for (what makes the readers fast)
    n = lambda t: fx.con.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0]  # noqa: E731
    assert n("exposure_index") < n("page_reads")
    # readers keep the index's runs (exposure_runs_index.sql); the join's slot rows folded into runs
    # (exposure_runs_of_slots.sql, what exposure_pairs_of.sql reads on the join's path) are the same
    # runs, and the pairs of each are the same pairs
    from forensics.queries.duckdb import sql
    from forensics.queries.grown import WHOLE
    con = fx.con
    con.sql(sql("exposure_slots")).to_table("exposure_slots")
    runs = {}
    for side, text in (("index", sql("exposure_runs_index")), ("join", sql("exposure_runs_of_slots"))):
        con.execute(f"CREATE OR REPLACE TABLE exposure_runs AS {text}")
        runs[side] = con.sql("SELECT * EXCLUDE (slot_mask, attention_mass), list_filter(range(64), "
                             "lambda s: (slot_mask >> s) & 1 = 1) AS slots, round(attention_mass, 9) AS mass "
                             "FROM exposure_runs").pl().sort(pl.all())
        con.execute(sql("exposure_pairs_of"))
        runs[side + " pairs"] = con.sql(f"SELECT * EXCLUDE (attention_mass), round(attention_mass, 9) AS mass "
                                        f"FROM exposure_pairs_of({WHOLE}, false)").pl().sort("response", "donor")
    assert runs["index"].height == n("exposure_runs") and runs["index"].equals(runs["join"])
    assert runs["index pairs"].equals(runs["join pairs"])
    assert runs["index"].height < n("exposure_slots") or n("exposure_slots") == 0


def test_verify_index_names_every_difference(glm53_vulnerable, tmp_path, capsys):
    """A store whose index is wrong (one of its rows lost, one donor changed) verifies as a store - it
    is signed as written - and verify-index names both differences (exit 1); readers told not to
    trust it answer from the join."""
    import pyarrow as pa
    import pyarrow.compute as pc
    res, store = glm53_vulnerable

    def edit(table, t):
        if table != "exposure_index":
            return t
        t = t.sort_by([("reader", "ascending"), ("page", "ascending"), ("part", "ascending")])
        donor = t["donor"].to_pylist()
        donor[1] = 4242
        return t.slice(1).set_column(t.schema.get_field_index("donor"), "donor", pa.array(donor[1:], pa.int64()))
    bad = tmp_path / "bad-index"
    rewrite_store(store, bad, edit)
    assert main(["forensics", "verify-index", "--store", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "exposure index != as-of join" in out and "join only" in out and "index only" in out and "4242" in out
    assert main(["forensics", "verify-index", "--store", str(bad), "--format", "json"]) == 1
    diff = json.loads(capsys.readouterr().out)["differences"]
    assert {d["side"] for d in diff} == {"join only", "index only"} and "4242" in {str(d["donor"]) for d in diff}
    assert forensic_set(bad) != oracle_set(res)                          # the readers used the (wrong) index ...
    fx = Forensics(bad, use_index=False)                                  # ... the join still has the truth
    slots = fx.exposure_slots()
    assert set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"])) == oracle_set(res)
    # a store whose runs wrote no index: nothing to verify (exit 3), the join answers
    rewrite_store(store, tmp_path / "no-index", lambda table, t: t.filter(pc.scalar(False)) if table == "exposure_index"
             else t.drop_columns(["exposure_index"]) if table == "config_snapshots" else t)
    assert main(["forensics", "verify-index", "--store", str(tmp_path / "no-index")]) == 3
    assert "without the exposure index" in capsys.readouterr().err
    assert forensic_set(tmp_path / "no-index") == oracle_set(res)
    assert main(["forensics", "verify-index", "--store", str(store), "--engine", "chdb"]) == 2
    assert "reads the local store's ledger with DuckDB" in capsys.readouterr().err


def _reads_flushed_before_their_writes(store: Path) -> int:
    """Page reads that reached the store in an earlier flush (chain file) than a write to that page
    and generation they came after: a store cut between the two flushes (``kill -9``) would hold the
    read without the write, and its join would name the slot's earlier writer."""
    import duckdb
    from telemetry.store.chain import read_chain_files
    # the flushes' own segments (a merge's file, made later, holds rows of earlier flushes; the
    # merged files stay on disk for the writer's grace period, minutes, longer than this test)
    links = [(ln.file, i) for i, f in enumerate(read_chain_files(store)) for ln in f.links if not ln.replaces]
    assert all((store / rel).is_file() for rel, _ in links)
    con = duckdb.connect()
    con.execute("CREATE TABLE flush AS SELECT unnest(?::VARCHAR[]) AS rel, unnest(?::BIGINT[]) AS flush",
                [[r for r, _ in links], [i for _, i in links]])
    seg = lambda t, cols: (f"SELECT {cols}, flush FROM read_parquet('{store}/segments/{t}/*.parquet', filename=true) s "  # noqa: E731
                           f"JOIN flush ON s.filename = '{store}/' || flush.rel")     # (a merge's file: no flush)
    return con.sql(f"""WITH w AS ({seg('page_writes', 'node, page, generation, lclock')}),
                            r AS ({seg('page_reads', 'node, page, generation, lclock_first')})
                       SELECT count(*) FROM r JOIN w USING (node, page, generation)
                       WHERE w.lclock <= r.lclock_first AND w.flush > r.flush""").fetchall()[0][0]


def test_no_read_is_flushed_before_a_write_it_read(tmp_path, monkeypatch):
    """Every write reaches the store in the flush of the first read after it, or an earlier one - a
    transfer's landed records too (reported as each call lands, taken by the same fold as the steps
    around them, not queued behind them): whichever flush a kill cuts after, the join and the index
    see the same writes. A writer that flushes at almost every item makes every boundary a cut (at normal
    priority: under SCHED_IDLE beside another busy test worker its items batch up - CI counted 50 flushes
    where this machine counts 120-140 idle and 220 normal)."""
    from engine.replay.glm53 import glm53
    from telemetry.recorder import recording
    store = tmp_path / "every-flush"
    monkeypatch.setattr("telemetry.store.writer.CHAIN_FAN", 0)     # a chain file a flush: the flushes are told apart
    glm53("vulnerable", "disaggregated", recorder=recording(store, flush_interval=0.001, writer_priority="normal"),
          context=1024, victims=2, background=8, max_tokens=160, seed=3)
    assert len(list((store / "chain").glob("*.json"))) >= 30          # many flushes: many possible cuts
    assert _reads_flushed_before_their_writes(store) == 0
    fx = Forensics(store)
    chk = fx.verify_index()
    assert chk.ok and chk.join_rows > 0, chk


def test_a_replay_killed_mid_fold_leaves_an_index_equal_to_the_join(tmp_path):
    """kill -9 while the ledger writer folds an incident's reads: whatever reached the store, the index
    in it answers exactly what the join over the same ledger answers."""
    import signal
    import subprocess
    import sys
    import time
    store = tmp_path / "killed"
    code = ("from engine.replay.glm53 import glm53\nfrom telemetry.recorder import recording\n"
            f"glm53('vulnerable', 'disaggregated', recorder=recording({str(store)!r}, flush_interval=0.2), "
            "context=1024, victims=2, background=8, max_tokens=160, seed=3)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:      # until some of the incident's reads are in the store
            time.sleep(0.3)
            segs = list((store / "segments" / "exposure_index").glob("*.parquet")) if store.exists() else []
            if len(segs) >= 2:
                break
        assert proc.poll() is None, "the replay ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    fx = Forensics(store)
    chk = fx.verify_index()
    assert fx.indexed and chk.ok and chk.join_rows > 0, chk


# ---- the shared tables kept between commands (forensics/queries/answers.py) -----------------------
def _own_copy(src, tmp_path, name: str = "store", writable: bool = False) -> Path:
    """The store copied to a path of the test's own: the kept answers are per store path, so no other
    test (nor another worker) reads or writes this copy's entries. ``writable``: a store of its own
    identity (rewritten through the real segment writer, its own key and anchor) - a copy that is
    appended to would move the anchor of the store it was copied from (one store id)."""
    store = tmp_path / name
    if writable:
        rewrite_store(src, store, lambda table, t: t)
    else:
        shutil.copytree(src, store)
    return store


def _entries(store) -> list[Path]:
    """The kept answers of this store path."""
    from forensics.queries.answers import answers_dir
    return sorted(answers_dir(store).glob("*.duckdb"))


def _answered(store, **kw) -> tuple[Forensics, dict[str, pl.DataFrame]]:
    fx = Forensics(store, **kw)
    out = {q: fx.query(q) for q in ("exposures", "tenants", "scores")}
    out["slots"] = fx.exposure_slots().sort(pl.all())
    if fx.answers is not None:
        fx.answers.wait()       # its entry and kept answers are written on threads of their own (nice 19):
    return fx, out              # what the next reader or a listing of the state directory finds is then set


def _same(a: dict, b: dict) -> None:
    for q in a:
        assert_frame_equal(a[q], b[q], check_exact=False, rel_tol=1e-12)


@pytest.mark.parametrize("fixture", ["glm53_vulnerable", "glm53_hardened", "glm53_unified"])
def test_the_exposure_questions_answer_alike_from_the_pairs_requests_alone(fixture, request):
    """exposures, tenants and scores read requests only through the exposure macros: a reader makes
    only the rows of the pairs' responses and donors and of the incarnations the n-gram evidence
    counts (``narrowed``) - and answers as with every request made; a query that reads requests
    itself then makes the whole table, and its answer is the whole table's."""
    _, store = request.getfixturevalue(fixture)
    narrow, whole = Forensics(store, answer_cache=False), Forensics(store, answer_cache=False)
    whole._ensure("requests")
    names = ("exposures", "tenants", "scores", "tenant_scores")
    a, b = narrow.queries(list(names), workers=1), whole.queries(list(names), workers=1)
    assert narrow.narrowed is not None and whole.narrowed is None
    total = whole.request_count()
    assert narrow.con.table("requests").count("*").fetchall()[0][0] <= len(narrow.narrowed) < total
    assert narrow.request_count() == total           # counted, not made
    for q in names:
        assert_frame_equal(a[q], b[q])
    for q in ("runs", "ttft", "exposures"):          # requests itself: the whole table made
        assert_frame_equal(narrow.query(q), whole.query(q))
    assert narrow.narrowed is None and narrow.con.table("requests").count("*").fetchall()[0][0] == total
    assert_frame_equal(narrow.page_ledgers(), narrow.query("runs").select("boot", "page_ledger"))


def test_answers_are_read_back_and_equal_the_built_ones(glm53_vulnerable, tmp_path, monkeypatch):
    """A second command on the same verified, idle store reads the shared tables back from the
    state directory instead of building them, and every answer is the one building them gives."""
    monkeypatch.setenv("KVLEDGER_GROW", "0")      # the tables built, not grown: an answers entry is written
    store = _own_copy(glm53_vulnerable[1], tmp_path)
    cold, built = _answered(store)
    assert cold.from_cache == set() and cold.answers is not None
    warm, read = _answered(store)
    assert warm.from_cache == {"requests", "exposure_slots", "exposure_ngrams"}
    _same(built, read)
    assert read["exposures"].height and (read["exposures"]["evidence"] == "surfaced").any()
    off, fresh = _answered(store, answer_cache=False)                    # and with the cache off
    assert off.answers is None and off.from_cache == set()
    _same(built, fresh)
    join, _ = _answered(store, use_index=False)     # another source of the slots: another entry
    assert join.from_cache == set() and join.answers.key != warm.answers.key
    assert len(_entries(store)) == 2


def test_the_answers_entry_is_written_while_the_query_answers(glm53_vulnerable, tmp_path, monkeypatch):
    """The snapshot's answers entry (a second or so at 100 M rows) is written on a thread of its own:
    the query answers before the entry is written; the next reader of the same entry in this
    process, and close(), wait for it; the entry is then read back whole."""
    monkeypatch.setenv("KVLEDGER_GROW", "0")      # the tables built, not grown: an answers entry is written
    import threading

    from forensics.queries.answers import Answers
    store = _own_copy(glm53_vulnerable[1], tmp_path)
    go, real_save = threading.Event(), Answers.save

    def held_save(self, con):
        assert go.wait(60)
        real_save(self, con)
    monkeypatch.setattr(Answers, "save", held_save)
    fx = Forensics(store)
    built = fx.query("exposures")                   # answered while the entry waits to be written
    assert built.height and _entries(store) == []
    waiter = threading.Thread(target=Forensics(store).materialise)     # a second reader: waits for it
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and _entries(store) == []
    go.set()
    waiter.join(60)
    assert not waiter.is_alive() and len(_entries(store)) == 1
    fx.close()
    again = Forensics(store)
    again.materialise()
    assert again.from_cache == {"requests", "exposure_slots", "exposure_ngrams"}
    assert_frame_equal(again.query("tenants"), fx_tenants(store))


def fx_tenants(store) -> pl.DataFrame:
    """tenants built with nothing kept (the reference)."""
    return Forensics(store, answer_cache=False).query("tenants")


def test_grown_tables_are_not_copied_into_an_answers_entry(glm53_vulnerable, tmp_path):
    """Where requests and exposure_slots are grown (kept by grown.py) and the evidence kept by
    evidence.py, no answers entry copies them (seconds at a process's exit at 100 M+ rows): the next
    process starts from those entries - nothing built from scratch, no whole ngrams scan, the
    evidence's answer reused - and answers as the first did; whole-store answers are kept as ever."""
    from forensics.queries import evidence, grown
    from forensics.queries.answers import answers_dir
    store = _own_copy(glm53_vulnerable[1], tmp_path)
    first, built = _answered(store)
    assert first.narrowed and not first.all_kept() and _entries(store) == []   # requests: the pairs' rows only
    first.requests()                                      # every request: requests grown and kept too
    assert first.narrowed is None and first.all_kept() and _entries(store) == []
    first.close()                                         # (its kept answers written: keep_result's threads)
    assert len(sorted(answers_dir(store).glob("*.arrow"))) == 3          # exposures, tenants, scores
    grown._KEPT.clear()                           # a new process
    evidence._KEPT.clear()
    evidence._SAVED.clear()
    g, e = dict(grown.stats), dict(evidence.stats)
    fx = Forensics(store)
    fx.materialise()
    assert fx.from_cache == set() and _entries(store) == []
    assert grown.stats["loaded"] - g["loaded"] == 2 and grown.stats["built"] == g["built"]
    assert evidence.stats["whole_scans"] == e["whole_scans"] and evidence.stats["reused"] - e["reused"] == 1
    _same(built, {q: fx.query(q) for q in ("exposures", "tenants", "scores")}
          | {"slots": fx.exposure_slots().sort(pl.all())})


def test_whole_store_answers_are_kept_and_a_windowed_one_always_runs(glm53_vulnerable, tmp_path, monkeypatch):
    """A query asked of the whole store is kept beside its snapshot's tables and read back by the
    next command without running it (nor building the shared tables); a damaged kept answer is run
    again; a windowed query is never kept."""
    from forensics.queries.answers import answers_dir
    store = _own_copy(glm53_vulnerable[1], tmp_path)
    first, built = _answered(store)
    first.close()                                            # (its kept answers written: keep_result's threads)
    kept = sorted(answers_dir(store).glob("*.arrow"))
    assert len(kept) == 3                                    # exposures, tenants, scores
    ran: list[str] = []
    real_run = Forensics._run
    monkeypatch.setattr(Forensics, "_run", staticmethod(lambda con, text, *a: ran.append(text) or real_run(con, text, *a)))
    again = Forensics(store)
    for q in ("exposures", "tenants", "scores"):
        assert_frame_equal(again.query(q), built[q])
    assert ran == [] and again.from_cache == set()            # read back: nothing run, nothing built
    kept[0].write_bytes(b"not arrow")                         # damaged: that one runs again, right answer
    shutil.copyfile(kept[2], kept[1])                         # another query's answer under this one's name
    third = Forensics(store)
    for q in ("exposures", "tenants", "scores"):
        assert_frame_equal(third.query(q), built[q])
    assert len(ran) == 2
    t0 = built["exposures"]["first_read"].min()
    windowed = Forensics(store).query("exposures", start=t0)
    assert len(ran) == 3 and windowed.height                  # a window: run, and not kept
    assert sorted(answers_dir(store).glob("*.arrow")) == kept


def test_a_kept_answer_is_written_off_the_answer_s_path_at_the_lowest_priority_and_read_once_written(
        tmp_path, monkeypatch):
    """keep_result returns before its answer is written (a thread of its own, at nice 19 on Linux:
    lowest_priority); result() and wait() wait for that write, and the answer read is the one kept."""
    import os
    import sys
    import threading
    from types import SimpleNamespace

    import pyarrow as pa
    from forensics.queries import answers
    gate, seen, real = threading.Event(), [], pa.ipc.new_file

    def held(*a, **k):
        if sys.platform == "linux":
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        gate.wait(10)
        return real(*a, **k)
    monkeypatch.setattr(pa.ipc, "new_file", held)
    a = answers.Answers(tmp_path / "store", SimpleNamespace(store_id="s", seq=1, head="h"), None, {})
    a.keep_result("guards", "SELECT 1", {}, pl.DataFrame({"x": [7]}))
    assert not list(answers.answers_dir(tmp_path / "store").glob("*.arrow"))       # not yet: held back
    threading.Timer(0.2, gate.set).start()
    assert a.result("guards", "SELECT 1", {})["x"].to_list() == [7]                # waited for it
    a.wait()
    assert seen == ([19] if sys.platform == "linux" else [])


def test_kept_answers_of_old_snapshots_are_removed(tmp_path):
    """A store that grows snapshot after snapshot, asked only queries that build no table, keeps the
    answers of its newest KEEP snapshots and no more."""
    from types import SimpleNamespace

    from forensics.queries.answers import KEEP, Answers, answers_dir
    store = tmp_path / "store"
    for seq in range(KEEP + 3):
        a = Answers(store, SimpleNamespace(store_id="s", seq=seq, head=f"h{seq}"), None, {})
        a.keep_result("guards", "SELECT 1", {}, pl.DataFrame({"x": [seq]}))
        a.wait()                                # (written on a thread of its own)
        time.sleep(0.01)                        # distinct modification times
    left = sorted(answers_dir(store).glob("*.arrow"))
    assert len(left) == KEEP
    assert a.result("guards", "SELECT 1", {})["x"].to_list() == [KEEP + 2]


@pytest.mark.parametrize("case", ["garbage", "other-snapshot", "truncated"])
def test_a_damaged_or_foreign_answers_entry_is_rebuilt(glm53_vulnerable, glm53_hardened, tmp_path, case, monkeypatch):
    """An entry that is not this snapshot's (garbage bytes, another store's entry under this key's
    name, half a file) is never read: the tables are built again, the answers are right, no traceback."""
    monkeypatch.setenv("KVLEDGER_GROW", "0")      # the tables built, not grown: an answers entry is written
    store = _own_copy(glm53_vulnerable[1], tmp_path)
    _, built = _answered(store)
    entry = Forensics(store).answers.path
    if case == "garbage":
        entry.write_bytes(os.urandom(4096))
    elif case == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 3])
    else:
        other = Forensics(_own_copy(glm53_hardened[1], tmp_path, "other"))
        other.materialise()
        other.close()
        shutil.copyfile(other.answers.path, entry)
    fx, again = _answered(store)
    assert fx.from_cache == set()
    _same(built, again)
    assert Forensics(store).materialise() is None       # rebuilt entry: read back next time
    assert _answered(store)[0].from_cache == {"requests", "exposure_slots", "exposure_ngrams"}


def test_a_store_that_grew_is_answered_afresh(glm53_vulnerable, tmp_path, monkeypatch):
    """One more segment (here: each surfaced response's matched n-grams now in its own prompt, so
    none is evidence any more) changes the chain head: the kept tables are not this snapshot's and
    the answer changes with the store."""
    monkeypatch.setenv("KVLEDGER_GROW", "0")      # the tables built, not grown: an answers entry is written
    import pyarrow as pa
    from telemetry.store import SegmentWriter
    store = _own_copy(glm53_vulnerable[1], tmp_path, writable=True)
    fx, before = _answered(store)
    surfaced = before["exposures"].filter(pl.col("evidence") == "surfaced")
    assert surfaced.height
    assert _answered(store)[0].from_cache              # unchanged: read back
    own = fx.con.sql("SELECT DISTINCT n.incarnation, n.hash FROM ngrams n JOIN ngrams o ON o.hash = n.hash "
                     "WHERE o.role = 'prompt' AND n.role = 'output' AND n.incarnation IN "
                     f"({', '.join(str(r) for r in surfaced['response'].unique())})").to_arrow_table()
    rows = pa.table({"incarnation": own["incarnation"], "role": pa.array(["prompt"] * own.num_rows),
                     "n": pa.array([12] * own.num_rows, pa.int16()), "hash": own["hash"],
                     "pos": pa.nulls(own.num_rows, pa.int32())})
    w = SegmentWriter(store)
    w.submit("ngrams", rows)
    w.close()
    grown, after = _answered(store)
    assert grown.from_cache == set()
    assert not (after["exposures"]["evidence"] == "surfaced").any()
    assert after["exposures"].height == before["exposures"].height


@pytest.mark.parametrize("case", ["unverified", "live writer", "turned off"])
def test_answers_are_never_kept_for_a_store_that_can_change_or_does_not_verify(glm53_vulnerable, tmp_path,
                                                                               monkeypatch, case):
    from telemetry.store import SegmentWriter
    store = _own_copy(glm53_vulnerable[1], tmp_path, writable=True)
    writer = None
    kw = {}
    if case == "unverified":
        seg = sorted((store / "segments" / "spans").glob("*.parquet"))[0]
        seg.write_bytes(seg.read_bytes()[:-8] + b"tampered")
        kw = {"allow_unverified": True}
    elif case == "live writer":
        writer = SegmentWriter(store)           # holds the store's lock, as serve does
    else:
        monkeypatch.setenv("KVLEDGER_ANSWER_CACHE", "0")
    try:
        for _ in range(2):
            fx = Forensics(store, **kw)
            fx.materialise()
            assert fx.answers is None and fx.from_cache == set()
    finally:
        if writer is not None:
            writer.close()
    assert _entries(store) == []


def _grown_equal_their_sql(con) -> tuple[int, ...]:
    """A snapshot's grown tables (grown.py) against their SQL over the same snapshot; their row counts."""
    from forensics.queries.duckdb import sql
    from forensics.queries.grown import WHOLE
    return (_same_rows(con, "requests", sql("requests")),
            _same_rows(con, "exposure_slots", sql("exposure_slots_index"), "attention_mass"),
            _same_rows(con, "exposure_pairs", f"SELECT * FROM exposure_pairs_of({WHOLE}, false)", "attention_mass"),
            _same_rows(con, "queues", sql("queues")))


def _same_rows(con, table: str, text: str, mass: str | None = None) -> int:
    """Rows of ``table`` (a snapshot's view) against ``text`` (the table's SQL over the same
    snapshot), both ways; ``mass``: a float column compared to 1e-9 relative (sums in another order)."""
    cols = [c for c in con.sql(f"SELECT * FROM {table} LIMIT 0").columns if c != mass]
    sel = ", ".join(f'"{c}"' for c in cols)
    if mass:
        sel += f', round("{mass}", 9) AS "{mass}"'
    a = con.sql(f"SELECT {sel} FROM {table}").fetchall()
    b = con.sql(f"SELECT {sel} FROM ({text})").fetchall()
    key = lambda r: tuple((x is None, str(x)) for x in r)  # noqa: E731
    assert sorted(a, key=key) == sorted(b, key=key), table
    return len(a)


def test_a_growing_stores_shared_tables_equal_their_rules_reading_only_new_segments(tmp_path):
    """A live store read again and again (a dashboard's refreshes). Each snapshot's ``requests``,
    ``queues``, ``exposure_slots`` and ``exposure_pairs``, grown from the last snapshot's with only
    the new segments read (grown.py), equal requests.sql, queues.sql, exposure_slots_index.sql and
    the pairs computed from those slot rows (exposure_pairs_of.sql) over the whole snapshot; its
    n-gram evidence, built from the rows an earlier snapshot kept plus its new segments
    (evidence.py), equals the rule's SQL over the whole ngrams table - while requests arrive and
    finish, exposures start and continue, new output and requests of other tenants arrive, and
    another run begins; for the whole store and for one run. A later snapshot reads the new
    segments, and the whole ngrams table only for incarnations or hashes not covered yet; a
    changed segment starts over."""
    from engine.replay.glm53 import glm53
    from forensics.queries import evidence, grown
    from forensics.queries.duckdb import sql
    from telemetry.recorder import Telemetry
    from tests.conftest import GLM53_SMALL
    opened, done, seen = [], [0], []

    def factory(**kw):
        opened.append(Telemetry(tmp_path / "live", **kw))
        return opened[-1]

    def check(run: str | None = None) -> None:
        live = not opened[-1].writer.closed
        if live:
            opened[-1].writer.flush()
        before, ev_before = dict(grown.stats), dict(evidence.stats)
        fx = Forensics(tmp_path / "live", run, answer_cache=False)
        assert fx.indexed and fx.live == live           # a live store: nothing kept on disk, every snapshot new
        fx.materialise()
        n = _grown_equal_their_sql(fx.con)
        ng = fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall()
        assert ng == fx.con.sql(f"SELECT * FROM ({sql('exposure_ngrams')}) ORDER BY ALL").fetchall()
        unfinished = fx.con.sql("SELECT count(*) FILTER (WHERE NOT finished) FROM requests").fetchall()[0][0]
        seen.append((n, unfinished, {k: grown.stats[k] - before[k] for k in before}, len(ng),
                     {k: evidence.stats[k] - ev_before[k] for k in ev_before}))
        fx.close()

    def progress(n, total=None):
        done[0] += n
        if done[0] % 3 == 0:
            check()
    glm53("vulnerable", recorder=factory, progress=progress, **GLM53_SMALL)
    check()                                             # (the replay closed its store)
    assert seen[-1][0][1] > 0 and seen[-1][0][2] > 0, "the incident's slot rows and pairs"
    assert seen[-1][0][3] > 0, "the requests' admission times"
    assert seen[-1][3] > 0, "the incident surfaces donor text"
    assert any(u for _, u, *_ in seen[:-1]), "a snapshot held requests still running"
    assert all(d["built"] == 0 for _, _, d, *_ in seen[1:]), "later snapshots grow the kept tables, never rebuild"
    assert sum(d["grown"] for _, _, d, *_ in seen) >= 10
    assert sum(d["groups_redone"] for _, _, d, *_ in seen) > 0
    assert len({n[1] for n, *_ in seen}) > 2, "the exposure grew while the store did"
    assert len({x[3] for x in seen}) > 1, "the evidence grew while the store did"
    assert any(x[4]["new_segment_reads"] for x in seen[1:]), "a later snapshot read only the new segments"
    assert any(x[4]["whole_scans"] for x in seen[1:]), "a new exposure: its incarnations read from the whole table"
    assert sum(x[4]["whole_scans"] for x in seen) < 2 * len(seen)        # not every snapshot scans it all
    check()                                             # the same snapshot again: nothing the answers read changed
    assert seen[-1][2]["unchanged"] == 2 and seen[-1][4]["reused"] == 1 and seen[-1][4]["whole_scans"] == 0
    assert seen[-2][4]["reused"] == 0                   # (the replay's last segments changed it)
    boot = opened[0].boot
    glm53("hardened", recorder=factory, **GLM53_SMALL | {"seed": 11})    # another run's traffic, every read checked
    check()                                             # new segments: the rules' answers whether reused or not
    assert seen[-1][2]["grown"] == 2
    assert seen[-1][4]["new_segment_reads"] == 2 and seen[-1][4]["whole_scans"] == 0, seen[-1][4]
    check(boot[:8])                                     # one run: its own kept tables, its rows only
    assert seen[-1][2]["built"] == 2
    check(boot[:8])
    assert seen[-1][2]["unchanged"] == 2 and seen[-1][0] == seen[-2][0]
    for table in ("spans", "ngrams"):                   # same bytes, its ctime moved: start over
        os.utime(next((tmp_path / "live" / "segments" / table).glob("*.parquet")))
    check()
    assert seen[-1][2]["built"] == 1 and seen[-1][2]["unchanged"] == 1     # (the index's segments did not move)
    assert seen[-1][4]["whole_scans"] == 2


@pytest.mark.parametrize("finished", [[], [True] * 3, [False] * 2, [True, True, False], [False, True, True],
                                      [True, False, True, False], [False, True, False]])
def test_grown_requests_split_finished_from_open_rows_in_their_order(finished):
    """The kept requests' finished and open rows (grown._finished: slices where they already lie
    apart, else a mask's copy) are those a filter gives, in the table's order, over several chunks."""
    import pyarrow as pa
    from forensics.queries.grown import _finished
    half = len(finished) // 2
    t = pa.Table.from_batches([pa.record_batch({"incarnation": pa.array(range(a, b), pa.int64()),
                                                "finished": pa.array(finished[a:b], pa.bool_())})
                               for a, b in ((0, half), (half, len(finished)))])
    done, open_ = _finished(t)
    assert done["incarnation"].to_pylist() == [i for i, f in enumerate(finished) if f]
    assert open_["incarnation"].to_pylist() == [i for i, f in enumerate(finished) if not f]
    assert done.schema == open_.schema == t.schema


def test_grown_requests_merge_arrivals_late_ends_and_duplicated_root_spans_as_the_sql_does(tmp_path):
    """The merge rules of grown requests, each met across segments: an unfinished request's
    arrivals in two segments (the earliest arrival's node, the largest prompt), a request that ends
    in a later segment (its arrival row replaced), a root span delivered twice in two segments
    (grouped, any value of each column), an arrival written after its request's end (ignored), a
    request admitted twice (its queue times added up): every snapshot equals requests.sql and
    queues.sql over the whole store."""
    import datetime as dt

    import pyarrow as pa

    from forensics.queries import grown
    from forensics.queries.duckdb import sql
    from telemetry.store import SegmentWriter
    from telemetry.store.schema import arrow_schemas
    t0 = dt.datetime(2026, 12, 5, 8)

    def table(name: str, rows: list[dict]) -> pa.Table:
        schema = arrow_schemas()[name]
        return pa.table({f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in schema}, schema=schema)

    def arrival(inc: int, node: str, s: int, prompt: int) -> dict:
        return {"node": node, "boot": "b1", "incarnation": inc, "tenant_h": f"t{inc % 2}", "scope_h": "s",
                "prompt_tokens": prompt, "ts": t0 + dt.timedelta(seconds=s)}

    def root(inc: int, s: int, **kw) -> dict:
        return {"Timestamp": t0 + dt.timedelta(seconds=s), "Duration": 2_000_000_000, "SpanName": "request",
                "incarnation": inc, "node": "n1", "boot": "b1", "operation": "request", "tenant_h": f"t{inc % 2}",
                "input_tokens": 10, "output_tokens": 4, "finish_reason": "length", **kw}
    def admission(inc: int, s: int, ns: int) -> dict:
        return {"Timestamp": t0 + dt.timedelta(seconds=s), "Duration": ns, "SpanName": "admission",
                "incarnation": inc, "node": "n1", "boot": "b1", "operation": "admission"}
    flushes = [         # (request 4 is admitted twice: preempted, its pages given back, admitted again)
        {"arrivals": [arrival(1, "n1", 10, 7), arrival(2, "n2", 11, 5)],
         "spans": [root(3, 1, ttft_s=None), admission(4, 12, 1_000)]},
        {"arrivals": [arrival(1, "n3", 5, 9), arrival(4, "n1", 12, 3)], "spans": [root(2, 11), root(3, 1, ttft_s=0.5)]},
        {"arrivals": [arrival(3, "n2", 0, 50), arrival(4, "n2", 20, 1)], "spans": [admission(4, 20, 2_000)]},
        {"arrivals": [], "spans": [root(1, 5, error_type="Timeout")]},
    ]
    w = SegmentWriter(tmp_path / "s", boot="b1")
    grown.stats.update(dict.fromkeys(grown.stats, 0))
    try:
        for f in flushes:
            for name, rows in f.items():
                if rows:
                    w.submit(name, table(name, rows))
            w.flush()
            fx = Forensics(tmp_path / "s", answer_cache=False)
            fx.requests()
            _same_rows(fx.con, "requests", sql("requests"))
            _same_rows(fx.con, "queues", sql("queues"))
            queued = fx.con.sql("SELECT queue_ns FROM queues WHERE incarnation = 4").fetchall()
            fx.close()
        got = {r["incarnation"]: r for r in _requests_of(tmp_path / "s")}
    finally:
        w.close()
    assert grown.stats["built"] == 1 and grown.stats["grown"] == 3
    assert [got[i]["finished"] for i in (1, 2, 3, 4)] == [True, True, True, False]
    assert got[3]["ttft_s"] == 0.5 and got[4]["node"] == "n1" and got[4]["prompt_tokens_billed"] == 3
    assert got[1]["error_type"] == "Timeout" and queued == [(3_000,)]


def _requests_of(store) -> list[dict]:
    fx = Forensics(store, answer_cache=False)
    try:
        return fx.requests().to_dicts()
    finally:
        fx.close()


def test_grown_tables_outlive_the_process_and_a_bad_entry_is_ignored(glm53_vulnerable, tmp_path, monkeypatch):
    """A build from scratch leaves the grown tables in the state directory: the next process (here:
    this one with its memory cleared) starts from them and builds nothing; an entry cut short, or
    written by other SQL, is ignored (built again), and the tables equal their SQL every time."""
    from forensics.queries import grown
    _, store = glm53_vulnerable
    monkeypatch.setenv("KVLEDGER_STATE_DIR", str(tmp_path / "state"))

    def build() -> tuple[tuple, dict]:
        grown._KEPT.clear()                    # a new process
        before = dict(grown.stats)
        fx = Forensics(store)
        fx.answers = None                      # as on a store that changed: the tables are built
        fx.materialise()
        n = _grown_equal_their_sql(fx.con)
        fx.close()
        return n, {k: grown.stats[k] - before[k] for k in ("built", "loaded", "saved")}
    first, did = build()
    assert all(first) and did == {"built": 2, "loaded": 0, "saved": 2}
    again, did = build()
    assert again == first and did == {"built": 0, "loaded": 2, "saved": 0}
    entry = grown._dir((str(store.resolve()), None, "exposure_slots"))
    next(entry.glob("runs-*.arrow")).write_bytes(b"ARROW1 cut short")
    again, did = build()
    assert again == first and did == {"built": 1, "loaded": 1, "saved": 1}
    monkeypatch.setattr(grown, "_ident", lambda text, pairs: "other SQL")
    again, did = build()
    assert again == first and did == {"built": 2, "loaded": 0, "saved": 2}


# ---- what a command says while it builds (a first command on a big store takes seconds) --------------
def _on_a_terminal(argv: list[str], env: dict) -> tuple[bytes, bytes, int]:
    """Run the CLI with its stderr on a pseudo-terminal (stdout a pipe): what the terminal showed,
    stdout, exit status."""
    import pty
    import subprocess
    import sys
    main_fd, term = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine.commands", *argv], stdout=subprocess.PIPE, stderr=term,
                            env=env)
    os.close(term)
    shown = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:                 # the terminal closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    out = proc.stdout.read()
    rc = proc.wait(timeout=120)
    os.close(main_fd)
    return shown, out, rc


def test_a_command_from_the_shell_answers_without_importing_pandas(glm53_vulnerable, capsys):
    """pyarrow imports pandas on its first array from Python values (a quarter to half a second of a
    first command from the shell): a query command run as its process's own command line hides it
    from pyarrow first - the same answer, pandas never imported, and still importable after."""
    import subprocess
    import sys
    _, store = glm53_vulnerable
    argv = ["forensics", "exposures", "--store", str(store), "--format", "json"]
    # (the command ends its process itself once the answer is out - main.exit_at_once - running the
    # atexit functions first: the check runs there)
    code = ("import atexit, sys; from engine.commands.main import main; sys.argv = ['kvledger', *sys.argv[1:]]\n"
            "def check():\n"
            "    print('pandas imported' if 'pandas.core' in sys.modules else 'no pandas', file=sys.stderr)\n"
            "    import pandas.core\n"
            "    print('importable', file=sys.stderr)\n"
            "atexit.register(check); rc = main(); print('main returned', file=sys.stderr); sys.exit(rc)")
    child = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, timeout=120,
                           env={**os.environ, "KVLEDGER_ANSWER_CACHE": "0"})
    assert child.returncode == 0, child.stderr.decode()
    assert child.stderr.decode().split() == ["no", "pandas", "importable"], child.stderr.decode()
    assert main(argv) == 0
    assert json.loads(child.stdout) == json.loads(capsys.readouterr().out) != []


@pytest.mark.parametrize("grow", ["1", "0"])
def test_a_command_from_the_shell_ends_at_once_with_what_it_keeps_written(glm53_vulnerable, tmp_path, grow,
                                                                          monkeypatch):
    """A query command run from the shell ends its process as soon as its answer is out
    (main.exit_at_once: no interpreter teardown), after what it keeps for the next reader is written -
    the grown tables and the n-gram evidence's rows, or the answers entry (KVLEDGER_GROW=0), each by a
    thread of its own while the query runs (answers.in_background: joined first). The next
    process reads them back and answers the same; a closed pipe on stdout is no traceback."""
    import subprocess
    import sys

    import forensics.queries.evidence as evidence
    import forensics.queries.grown as grown
    from forensics.output import json_rows
    _, store = glm53_vulnerable
    env = {**os.environ, "KVLEDGER_STATE_DIR": str(tmp_path / "state"), "KVLEDGER_GROW": grow}
    argv = [sys.executable, "-m", "engine.commands", "forensics", "exposures", "--store", str(store), "--format", "json"]
    # the entries' threads made slow (0.5 s each: the answers entry's, the grown tables' and the
    # evidence rows'): the process must wait for them, not end under them
    slow = ("import sys, time; import forensics.queries.answers as a; save, write = a.Answers.save, a.write_entry\n"
            "a.Answers.save = lambda self, con: (time.sleep(0.5), save(self, con))\n"
            "a.write_entry = lambda *x: (time.sleep(0.5), write(*x))[1]\n"
            "from engine.commands.main import main; sys.argv = ['kvledger', *sys.argv[1:]]; sys.exit(main())")
    first = subprocess.run([sys.executable, "-c", slow, *argv[3:]], capture_output=True, env=env, timeout=120)
    assert first.returncode == 0 and first.stderr == b"", first.stderr.decode()
    monkeypatch.setenv("KVLEDGER_STATE_DIR", env["KVLEDGER_STATE_DIR"])
    monkeypatch.setenv("KVLEDGER_GROW", grow)
    try:
        evidence._KEPT.clear()
        grown._KEPT.clear()
        built, scans = grown.stats["built"], evidence.stats["whole_scans"]
        fx = Forensics(store)
        if grow == "1":
            assert evidence.kept(store) and fx.answers is not None and not fx.answers.path.exists()
        else:
            assert fx.answers is not None and fx.answers.path.is_file()        # the thread's entry, whole
        assert json.loads(first.stdout) == json.loads(json_rows(fx.exposures())) != []
        assert fx.from_cache == ({"requests", "exposure_slots", "exposure_ngrams"} if grow == "0" else set())
        assert (grown.stats["built"], evidence.stats["whole_scans"]) == (built, scans)    # read back, not rebuilt
        fx.close()
    finally:
        evidence._KEPT.clear()
        grown._KEPT.clear()
    closed = subprocess.run(f"{' '.join(argv)} | head -c 10", shell=True, capture_output=True, env=env, timeout=120)
    assert closed.stdout.startswith(b"[{") and b"Traceback" not in closed.stderr, closed.stderr.decode()


def test_the_status_line_draws_every_phase_however_short():
    """Each phase a command names is drawn when it is named, not at the status line's next timed
    refresh: phases that end at once (a small store's exposure slots) were never shown on a terminal."""
    import io

    from forensics.commands.query import status

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with status(term) as say:
        for phase in ("building the exposure slots", "building the n-gram evidence", "answering"):
            say(phase)
    for phase in ("verifying the store", "building the exposure slots", "building the n-gram evidence", "answering"):
        assert f"kvledger: {phase}" in term.getvalue(), phase


def test_a_command_says_what_it_builds_on_a_terminal_and_nothing_in_a_pipe(glm53_vulnerable, tmp_path):
    """On a terminal, stderr carries a status line while the store is verified and the shared tables
    are built - the n-gram evidence named, and whether every ngrams segment is read - and the
    answer on stdout is the same as in a pipe, where stderr stays empty."""
    import subprocess
    import sys
    _, store = glm53_vulnerable
    env = {**os.environ, "KVLEDGER_ANSWER_CACHE": "0"}      # nothing kept: every shared table is built
    argv = ["forensics", "exposures", "--store", str(store), "--format", "json"]
    shown, out, rc = _on_a_terminal(argv, env)
    assert rc == 0, shown
    text = shown.decode(errors="replace")
    for phase in ("kvledger: verifying the store", "kvledger: building the exposure slots and the requests they name",
                  "kvledger: building the n-gram evidence: every ngrams segment is read"):
        assert phase in text, text
    piped = subprocess.run([sys.executable, "-m", "engine.commands", *argv], capture_output=True, env=env, timeout=120)
    assert piped.returncode == 0 and piped.stderr == b"" and json.loads(piped.stdout) == json.loads(out) != []
    shown, _, rc = _on_a_terminal(["forensics", "verify-index", "--store", str(store)], env)
    assert rc == 0 and b"recomputing the exposure index" in shown
    shown, _, rc = _on_a_terminal(["forensics", "exposures", "--store", str(tmp_path / "none")], env)
    assert rc != 0 and b"kvledger: error:" in shown and b"Traceback" not in shown


@pytest.mark.parametrize("text,want", [
    ("SELECT a FROM t\nORDER BY a, b\n", "SELECT a FROM t\n"),                       # the query's own
    ("SELECT a FROM t\nORDER BY a DESC\n\n  \n", "SELECT a FROM t\n"),                # trailing blank lines
    ("SELECT a FROM (\n    SELECT a FROM t\n    ORDER BY a\n)\n", None),              # a subquery's: kept
    ("SELECT row_number() OVER (ORDER BY a) FROM t\n", None),                          # a window's: kept
    ("SELECT a FROM t\n-- ORDER BY a\n", None),                                       # a comment: kept
    ("SELECT a FROM t ORDER BY a\n", None),                                           # not at the margin: kept
], ids=["own", "blank-lines", "subquery", "window", "comment", "same-line"])
def test_a_query_is_taken_without_its_closing_order_by_only(text, want):
    from forensics.queries.base import without_order
    assert without_order(text) == (text if want is None else want)
