"""The live dashboard: every panel renders on a store made by a real replay, its numbers equal
the forensic queries', filters narrow them, and a browser sees the exposure count appear and grow
while a replay writes in another process."""
from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.data import Filters, Panels
from tests.streamlit_app import app_test, charts, unknown_fields
from forensics.queries.duckdb import Forensics

pytestmark = pytest.mark.xdist_group("glm53")
APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PANELS = ["Exposure score over time", "Donor -> recipient tenants", "Affected responses", "TTFT vs uncached prompt tokens",
          "Usage honesty", "Transfer integrity", "Deferred releases and held capacity", "Guard liveness",
          "Preflight per node", "Foreign fleet (vLLM / SGLang telemetry)", "External probes", "Export"]


def _app(store, monkeypatch) -> AppTest:
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    at = app_test(APP, 120)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _metrics(at) -> dict[str, int | str]:
    return {m.label: int(m.value) if str(m.value).isdigit() else m.value for m in at.metric}


def test_every_panel_renders_and_its_numbers_equal_kvledger_forensics(glm53_vulnerable, monkeypatch):
    res, store = glm53_vulnerable
    at = _app(store, monkeypatch)
    assert [s.value for s in at.subheader] == PANELS
    fx = Forensics(store)
    ex, scores, ttft, tr = fx.query("exposures"), fx.query("scores"), fx.query("ttft"), fx.query("transfers")
    m = _metrics(at)
    assert m["Affected responses"] == scores.height == len(res.over_pool)
    assert m["Foreign KV tokens read"] == int(ex.filter(pl.col("donor") != -1)["foreign_tokens"].sum())
    assert m["Exposure score"] == int(scores["score"].sum())
    cross = ex.filter((pl.col("evidence") == "surfaced") & ~pl.col("same_tenant") & (pl.col("donor") != -1))
    assert m["Surfaced, other customers'"] == cross["response"].n_unique()      # never mixed with a tenant's own
    assert m["Donor tenants"] == ex.filter(pl.col("donor") != -1)["donor_tenant"].n_unique()
    assert m["Billed for more prompt than prefilled"] == int(ttft["usage_dishonest"].sum())
    assert m["Transfers failing integrity"] == int((~tr["integrity_ok"]).sum())
    # the charts: each encodes only columns of the data it reads, and that data is the panels'
    drawn = charts(at)
    assert [unknown_fields(spec, data) for spec, data in drawn] == [[], [], []]
    (_, sot), (_, tm), (_, tt) = drawn      # score over time, donor -> recipient tenants, TTFT
    p = Panels(store)
    assert sot[""].select("time", "cumulative_score").equals(p.score_over_time().select("time", "cumulative_score"))
    assert tm[""].sort("donor_tenant", "recipient_tenant").equals(p.tenant_matrix().sort("donor_tenant", "recipient_tenant"))
    anomalies = p.ttft().filter(pl.col("below_floor") | pl.col("usage_dishonest"))
    assert anomalies.height and sorted(tt["dots"].filter(pl.col("anomaly"))["incarnation"]) == sorted(anomalies["incarnation"])
    assert tt["dots"].height == ttft.height and tt["floor"]["uncached"].is_sorted()
    # drill-down: every affected response, and for each exactly its donors
    drill = at.selectbox(key="drill")
    assert sorted(drill.options) == sorted(str(r) for r in scores["response"])
    for r in scores["response"]:
        drill.select(r).run()
        shown = at.dataframe[1].value
        assert sorted(shown["donor"]) == sorted(ex.filter(pl.col("response") == r)["donor"])


def test_filters_narrow_the_numbers_the_same_way_as_the_data_layer(glm53_vulnerable, monkeypatch):
    _, store = glm53_vulnerable
    at = _app(store, monkeypatch)
    donor = Forensics(store).query("exposures")["donor_tenant"].drop_nulls()[0]
    at.selectbox(key="tenant").select(donor).run()
    want = Panels(store, Filters(tenant=donor)).totals()
    assert _metrics(at)["Foreign KV tokens read"] == want["foreign_tokens"] > 0
    at.selectbox(key="tenant").select("all").run()
    at.selectbox(key="node").select("prefill1-canary").run()
    assert _metrics(at)["Affected responses"] == 0          # the canary node's pool fits: nobody exposed there
    at.selectbox(key="node").select("all").run()
    at.selectbox(key="policy").select("hardened").run()
    assert _metrics(at)["Affected responses"] == 0


def test_a_hardened_store_shows_nothing_exposed_and_every_guard_alive(glm53_hardened, monkeypatch):
    _, store = glm53_hardened
    at = _app(store, monkeypatch)
    assert _metrics(at)["Affected responses"] == 0 and _metrics(at)["Exposure score"] == 0
    assert any("No exposure recorded" in i.value for i in at.info)
    guards = Forensics(store).query("guards")
    assert not guards["idle_but_on"].any()


def test_missing_store_is_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_STORE", str(tmp_path / "nothing"))
    at = app_test(APP, 60)
    at.run()
    assert "No kvledger store at" in at.error[0].value and "picks it up by itself" in at.error[0].value


def test_export_builds_the_report_for_the_window(glm53_vulnerable, monkeypatch):
    _, store = glm53_vulnerable
    at = _app(store, monkeypatch)
    at.button(key="export").click().run()
    assert not at.exception
    assert any("Report ready: 2 affected response(s)" in s.value for s in at.success)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: str) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


CHROMIUM = "/usr/bin/chromium"
# 1 when any element is drawn faded (Streamlit's stale state) or its running widget shows
FADED = """() => {
  const faded = [...document.querySelectorAll('[data-testid="stElementContainer"]')]
      .some(e => e.offsetParent !== null && parseFloat(getComputedStyle(e).opacity) < 0.99);
  const w = document.querySelector('[data-testid="stStatusWidget"]');
  const running = !!w && getComputedStyle(w).visibility !== 'hidden' && w.offsetParent !== null && w.innerText.trim() !== '';
  return (faded || running) ? 1 : 0;
}"""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def test_browser_sees_the_exposure_count_appear_and_grow_while_a_replay_writes(tmp_path):
    from playwright.sync_api import sync_playwright
    assert Path(CHROMIUM).exists(), "Debian's chromium is needed (.ci/run installs it: apt-get install chromium)"
    store, port = tmp_path / "live", _free_port()
    kv = [sys.executable, "-m", "engine.commands"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dash = subprocess.Popen(kv + ["dashboard", "--store", str(store), "--port", str(port), "--refresh", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    replay = None
    try:
        seen = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            deadline = time.time() + 300
            while time.time() < deadline:
                try:
                    page.goto(f"http://127.0.0.1:{port}", timeout=10_000)
                    break
                except Exception:
                    time.sleep(1)
            # the dashboard is up before the store exists, as when on-call opens it first
            page.get_by_text("No kvledger store at").first.wait_for(timeout=60_000)
            replay = subprocess.Popen(kv + ["replay", "glm53", "--store", str(store), "--victims", "3",
                                            "--max-tokens", "160"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            page.get_by_text("Foreign KV tokens read").first.wait_for(timeout=180_000)   # picked up by itself
            while time.time() < deadline:
                metric = page.locator('[data-testid="stMetric"]').filter(has_text="Foreign KV tokens read")
                if metric.count():
                    seen.append(int(metric.first.inner_text().split()[-1]))
                if replay.poll() is not None and len(seen) > 3 and seen[-1] == seen[-2] and seen[-1] > 0:
                    break
                time.sleep(1)
            page.get_by_text("EXPOSURE in the store").first.wait_for(timeout=30_000)    # the red banner
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            # a store that no longer changes, refreshing: sampled every 0.25 s, as a person glancing at it
            faded, stamps = 0, set()
            for _ in range(48):
                faded += page.evaluate(FADED)
                stamps.add(page.locator("text=/data as of/").first.inner_text())
                time.sleep(0.25)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            keep = os.environ.get("KVLEDGER_KEEP_SCREENSHOTS")       # to look at it, as a person would
            if keep:
                import shutil
                shutil.copy(tmp_path / "dashboard.png", Path(keep) / "dashboard.png")
            browser.close()
        assert overflow <= 0, f"the page is {overflow} px wider than a 1400 px window"
        assert len(stamps) >= 2, stamps          # it did refresh while sampled...
        assert faded <= 0.05 * 48, f"{faded} of 48 samples faded or showed the running widget"   # ...without fading
        assert replay.wait(timeout=60) == 0
        assert seen and seen[-1] > 0, seen                  # the exposure count appears...
        assert seen == sorted(seen) and len(set(seen)) >= 2, seen   # ...and grows, live, while the replay writes
        # SIGTERM to `kvledger dashboard` alone (not its group) stops the Streamlit child it started
        kids = Path(f"/proc/{dash.pid}/task/{dash.pid}/children").read_text().split()
        os.kill(dash.pid, 15)
        dash.wait(timeout=30)
        gone = time.time() + 20
        while time.time() < gone and any(map(_alive, kids)):
            time.sleep(0.2)
        assert kids and not any(map(_alive, kids)), kids
    finally:
        if replay is not None and replay.poll() is None:
            replay.kill()
        if dash.poll() is None:
            os.killpg(dash.pid, 15)
            dash.wait(timeout=30)


def test_a_store_that_does_not_verify_is_shown_under_a_red_banner(glm53_vulnerable, monkeypatch, tmp_path):
    import shutil
    _, store = glm53_vulnerable
    copy = tmp_path / "tampered"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("writer.lock"))
    (copy / "segments" / "spans" / "999999999.parquet").write_bytes(b"dropped in")
    at = _app(copy, monkeypatch)
    assert any("UNVERIFIED STORE" in e.value and "not written by this store's writer" in e.value for e in at.error)
    clean = _app(store, monkeypatch)
    assert not any("UNVERIFIED" in e.value for e in clean.error)


# ---- the on-call view (issue 34) ----------------------------------------------------------------
def test_an_unprotected_run_is_red_before_any_exposure_and_a_hardened_one_green(glm53_vulnerable, glm53_hardened,
                                                                                  monkeypatch):
    _, store = glm53_vulnerable
    first = Forensics(store).query("exposures")["first_read"].min()
    at = app_test(APP, 120)
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    at.query_params["to"] = (first - dt.timedelta(seconds=1)).isoformat()     # a window before the first leak
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    m = _metrics(at)
    assert m["Affected responses"] == 0 and m["Protection"] == "RED"
    unprotected = [e.value for e in at.error if e.value.startswith("UNPROTECTED")]
    assert unprotected and "read check off" in unprotected[0] and "KV pool smaller than the context" in unprotected[0]
    # every node named, in the run's order, with its numbers (computed in columns, not row by row)
    assert ("read check off on prefill0, decode0, prefill1-canary; KV pool smaller than the context it serves on "
            "prefill0 (656 < 1024 tokens); 10 guard(s) off (cancel_both_halves, checksum, deferred_release, "
            "double_free_check and 6 more)") in unprotected[0]
    assert not any("Protected and clean" in s.value for s in at.success)
    assert m["Last foreign read"].endswith("ago")         # the clock is the whole store's, not the window's
    _, hard = glm53_hardened
    at = _app(hard, monkeypatch)
    assert _metrics(at)["Protection"] == "OK" and _metrics(at)["Last foreign read"] == "never"
    assert any("Protected and clean" in s.value for s in at.success)
    assert not any(e.value.startswith(("UNPROTECTED", "EXPOSURE")) for e in at.error)


def test_the_view_lives_in_the_url(glm53_vulnerable, monkeypatch):
    _, store = glm53_vulnerable
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    at = app_test(APP, 120)
    at.query_params["view"] = "integrity"
    at.query_params["from"] = "now-100d"
    at.run()
    assert not at.exception
    assert [s.value for s in at.subheader] == ["Transfer integrity", "Deferred releases and held capacity",
                                               "Guard liveness", "Preflight per node", "Export"]
    assert at.text_input(key="from").value == "now-100d"
    tenant = Forensics(store).query("exposures")["donor_tenant"].drop_nulls()[0]
    at.selectbox(key="tenant").select(tenant).run()
    assert at.query_params["tenant"] == [tenant] or at.query_params["tenant"] == tenant
    at.text_input(key="from").input("yesterday").run()             # a bad time: one line in the sidebar
    assert not at.exception and any("not a time: 'yesterday'" in e.value for e in at.sidebar.error)


DAMAGE = {
    "flipped header byte": lambda s: _flip(s, 4),
    "flipped middle byte": lambda s: _flip(s, None),
    "flipped footer byte": lambda s: _flip(s, -10),
    "truncated segment": lambda s: _seg(s).write_bytes(_seg(s).read_bytes()[:100]),
    "deleted segment": lambda s: _seg(s).unlink(),
    "dropped-in file": lambda s: (s / "segments" / "spans" / "999999999.parquet").write_bytes(b"dropped in"),
    "unreadable chain file": lambda s: sorted((s / "chain").iterdir())[0].write_text("{not json"),
    "chain link edited": lambda s: _edit_chain(s),
}


def _seg(store: Path) -> Path:
    return sorted((store / "segments" / "page_reads").glob("*.parquet"))[0]


def _flip(store: Path, at: int | None) -> None:
    b = bytearray(_seg(store).read_bytes())
    b[len(b) // 2 if at is None else at] ^= 0xFF
    _seg(store).write_bytes(bytes(b))


def _edit_chain(store: Path) -> None:
    import json
    f = sorted((store / "chain").iterdir())[0]
    body = json.loads(f.read_text())
    body["links"][0]["rows"] += 1
    f.write_text(json.dumps(body))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_kind_of_damage_is_the_red_banner_never_a_traceback(damage, glm53_vulnerable, monkeypatch, tmp_path,
                                                                    capsys):
    import shutil

    from engine.commands.main import main
    _, store = glm53_vulnerable
    copy = tmp_path / "damaged"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("writer.lock"))
    DAMAGE[damage](copy)
    at = _app(copy, monkeypatch)                    # _app asserts no exception
    assert any(e.value.startswith("UNVERIFIED STORE") for e in at.error), [e.value for e in at.error]
    assert "Affected responses" not in _metrics(at)          # no numbers without --allow-unverified
    monkeypatch.setenv("KVLEDGER_ALLOW_UNVERIFIED", "1")
    at = _app(copy, monkeypatch)
    assert any(e.value.startswith("UNVERIFIED STORE") for e in at.error)
    readable = damage != "unreadable chain file"
    assert ("Affected responses" in _metrics(at)) == readable
    capsys.readouterr()
    for query in ("exposures", "tenants"):
        rc = main(["forensics", query, "--store", str(copy), "--allow-unverified", "--format", "json"])
        err = capsys.readouterr().err
        assert "Traceback" not in err and "UNVERIFIED STORE" in err or not readable, err
        assert rc == (0 if readable else 2), (query, rc, err)
        assert not readable or err.startswith("kvledger: warning: UNVERIFIED STORE"), err
    if damage in ("flipped middle byte", "unreadable chain file"):        # the report reads as the queries do
        rc = main(["report", "--store", str(copy), "--allow-unverified", "--format", "json", "--out", str(tmp_path / "r")])
        assert rc == (1 if readable else 2) and "Traceback" not in capsys.readouterr().err   # 1: chain BROKEN


def test_unwritten_slots_are_never_a_tenant(glm53_vulnerable):
    _, store = glm53_vulnerable
    tm = Forensics(store).query("tenants")
    assert "(unwritten)" not in tm["donor_tenant"].drop_nulls().to_list()
    assert set(tm["donor_kind"]) <= {"tenant", "unwritten", "unrecorded"}
    assert tm.filter(pl.col("donor_kind") == "tenant")["donor_tenant"].null_count() == 0
    assert tm.filter(pl.col("donor_kind") != "tenant")["donor_tenant"].null_count() == \
        tm.filter(pl.col("donor_kind") != "tenant").height
    assert Panels(store).tenant_matrix()["donor_kind"].unique().to_list() in ([], ["tenant"])


def test_a_run_not_in_the_store_is_named_not_called_damage(glm53_vulnerable, monkeypatch):
    _, store = glm53_vulnerable
    monkeypatch.setenv("KVLEDGER_RUN", "zzz")
    at = _app(store, monkeypatch)
    assert [e.value for e in at.error if e.value.startswith("Cannot show run 'zzz'")]
    assert not any(e.value.startswith("UNVERIFIED") for e in at.error)


def test_a_restarted_dashboard_does_not_hash_the_store_again(glm53_vulnerable, tmp_path, monkeypatch):
    """The dashboard's verification cache is kept on disk per store (as the commands' is): a new
    dashboard process (an empty in-process cache) reads the segment hashes back instead of hashing
    every segment; a segment changed in place is hashed again and the store does not verify."""
    import shutil

    from dashboard import data
    from telemetry.store import chain
    store = tmp_path / "store"
    shutil.copytree(glm53_vulnerable[1], store)
    monkeypatch.setattr(data, "VERIFIED", {})
    assert Panels(store).fx.verdict.ok
    hashed: list = []
    real = chain.sha256_file
    monkeypatch.setattr(chain, "sha256_file", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(data, "VERIFIED", {})                 # a restarted dashboard process
    assert Panels(store).fx.verdict.ok and hashed == []
    seg = sorted((store / "segments" / "spans").glob("*.parquet"))[0]
    seg.write_bytes(seg.read_bytes()[:-8] + b"tampered")
    monkeypatch.setattr(data, "VERIFIED", {})
    assert not Panels(store).fx.verdict.ok and hashed == [seg]


# ---- the banner before the n-gram evidence (issue 36: a first render with nothing kept) ----------
def _nothing_kept(monkeypatch) -> None:
    """A new dashboard process with no kept answers or evidence rows (the verification cache stays)."""
    from forensics.queries import evidence
    monkeypatch.setenv("KVLEDGER_ANSWER_CACHE", "0")
    monkeypatch.setattr(evidence, "_KEPT", {})


def test_the_early_banner_s_numbers_are_the_whole_banner_s_in_every_view(glm53_vulnerable, monkeypatch, tmp_path):
    """Before the n-gram evidence is built, early() gives totals()' affected responses, the responses
    that read another customer's KV (critical + high) and the tenant counts, and the protection
    state and exposure clock are the same - for the whole store, windows around the leaks, a tenant,
    a node and a policy, and a store whose foreign reads the read check blocked; once the evidence
    is built there is no early banner."""
    from engine.disagg.cluster import Guards
    from engine.replay.faults import run_fault
    from telemetry.recorder import recording
    _, store = glm53_vulnerable
    ex = Forensics(store).query("exposures")
    assert ex.filter(~pl.col("same_tenant") & (pl.col("donor") != -1)).height     # cross-tenant reads to count
    first, last = ex["first_read"].min(), ex["last_read"].max()
    mid = first + (last - first) / 2
    views = [Filters(), Filters(start=first - dt.timedelta(seconds=1), end=first), Filters(start=mid),
             Filters(end=first - dt.timedelta(seconds=1)), Filters(tenant=ex["donor_tenant"].drop_nulls()[0]),
             Filters(tenant=ex["response_tenant"].drop_nulls()[-1]), Filters(node="prefill0"),
             Filters(node="prefill1-canary"), Filters(policy="vulnerable"), Filters(policy="hardened")]
    hard = tmp_path / "blocked"         # the late write's reads, every one stopped by the read check
    run_fault("late_write", guards=Guards.only("read_check"), recorder=recording(str(hard), flush_interval=0.2))
    assert set(Forensics(hard).query("exposures")["evidence"]) == {"blocked"}
    seen = set()
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    for where, f in [(store, f) for f in views] + [(hard, Filters())]:
        _nothing_kept(monkeypatch)
        p = Panels(where, f)
        assert p.fx.evidence_pending()
        early, pr = p.early(), p.protection(now, early=True)
        assert early is not None and "exposure_ngrams" not in p.fx._made     # said before the evidence
        t = p.totals()
        assert early == {k: t[k] for k in early}, f
        assert pr == p.protection(now)
        assert not p.fx.evidence_pending() and p.early() is None
        seen.add(tuple(early.values()))
    assert len(seen) >= 3 and (0, 0, 0, 0) in seen       # the views differ: the comparison is not of zeros only


def test_a_first_render_with_nothing_kept_draws_the_early_banner_then_the_whole_one(glm53_vulnerable, monkeypatch):
    _, store = glm53_vulnerable
    _nothing_kept(monkeypatch)
    at = _app(store, monkeypatch)
    assert 0 < at.session_state["early_banner_s"] <= at.session_state["state_line_s"]
    exposure = [e.value for e in at.error if e.value.startswith("EXPOSURE")]
    # the early banner's place holds the whole one now: one EXPOSURE line, with its critical / high split
    assert len(exposure) == 1 and "critical: the donor's text surfaced" in exposure[0], exposure
    assert not any("still being checked" in e.value for e in at.error)
    again = _app(store, monkeypatch)             # the evidence is kept in this process now: no early banner
    assert "early_banner_s" not in again.session_state
    assert [e.value for e in again.error if e.value.startswith("EXPOSURE")][0].split(" (")[0] == exposure[0].split(" (")[0]


def test_a_page_s_queries_that_read_no_evidence_run_while_it_is_built_with_the_answers_given_alone(
        glm53_vulnerable, monkeypatch):
    """A first page's queries asked at once (nothing kept): those that read no n-gram evidence start on
    cursors of their own before its build ends, the others after it - and every answer is the one that
    query gives asked alone."""
    import threading

    from dashboard.data import PAGE, UNORDERED
    from forensics.queries import duckdb as D
    _, store = glm53_vulnerable
    _nothing_kept(monkeypatch)
    fx = D.Forensics(store)
    alone = {n: fx.queries([n], unordered=UNORDERED)[n] for n in PAGE}
    fx.close()
    texts = {D.without_order(D.sql(n)) if n in UNORDERED else D.sql(n): n for n in PAGE}
    readers = {n for t, n in texts.items() if D.EVIDENCE_READERS.search(D.COMMENT.sub("", t))}
    assert readers == {"exposures", "scores", "tenants"} and len(PAGE) - len(readers) >= 5
    events, started = [], threading.Event()
    run, build = D.Forensics._run, D.build_evidence

    def timed_run(con, text, *a):
        events.append(texts[text])
        if texts[text] not in readers:
            started.set()
        return run(con, text, *a)

    def timed_build(*a, **k):
        started.wait(10)            # (a query that reads no evidence has started by now - or never will)
        events.append("building")
        build(*a, **k)
        events.append("built")
    monkeypatch.setattr(D.Forensics, "_run", staticmethod(timed_run))
    monkeypatch.setattr(D, "build_evidence", timed_build)
    _nothing_kept(monkeypatch)
    fx = D.Forensics(store)
    together = fx.queries(list(PAGE), unordered=UNORDERED)
    fx.close()
    built = events.index("built")
    assert events.index("building") > 0 and all(events.index(n) > built for n in readers), events
    assert set(events[:events.index("building")]) <= set(PAGE) - readers, events
    for n in PAGE:
        a, b = alone[n], together[n]
        if n in UNORDERED:
            a, b = a.sort(a.columns, nulls_last=True), b.sort(b.columns, nulls_last=True)
        assert a.equals(b), n
    assert all(alone[n].height for n in ("exposures", "scores", "tenants", "ttft", "transfers"))    # not zeros only


def _shuffled(df: pl.DataFrame, seed: int) -> pl.DataFrame:
    return df.sample(fraction=1.0, shuffle=True, seed=seed)


TRANSFER_ROWS = pl.DataFrame({         # ties on the first key, nulls in it, failing rows among them
    "ts_submit": [5, 1, None, 3, 3, 2, None, 4, 1, 6] * 3,
    "transfer_id": [f"t{i:02d}" for i in range(30)],
    "incarnation": list(range(30)),
    "failing": [i % 4 == 0 for i in range(30)],
})


@pytest.mark.parametrize("limit,red", [(100, "failing"), (5, "failing"), (8, "failing"), (12, "failing"),
                                       (3, None), (100, None)], ids=lambda v: str(v))
def test_a_table_of_unordered_rows_shows_the_rows_its_ordered_query_would(limit, red):
    """The transfers table reads its rows unordered (dashboard.data.UNORDERED): the rows it shows, and
    their order, are still those of transfers.sql's ORDER BY (ascending, nulls last), failing rows
    first - the first `limit` picked without sorting the whole frame, whatever order the rows came in."""
    from dashboard.data import TRANSFER_ORDER, first_rows
    ordered = TRANSFER_ROWS.sort(TRANSFER_ORDER, nulls_last=True)
    want = first_rows(ordered, limit, red)          # the ordered query's rows, as the table took them before
    for seed in range(5):
        got = first_rows(_shuffled(TRANSFER_ROWS, seed), limit, red, TRANSFER_ORDER)
        assert got.equals(want), (seed, got, want)
    assert first_rows(TRANSFER_ROWS.head(0), limit, red, TRANSFER_ORDER).height == 0


def test_the_ttft_chart_draws_the_same_points_whatever_order_its_rows_come_in():
    """ttft's rows come unordered: the chart's sample of healthy requests, and the order its points
    are drawn in, must not change from one refresh to the next (no flicker), and every anomaly is drawn."""
    import random
    from dashboard.data import chart_points
    rnd = random.Random(7)
    n = 5000
    tt = pl.DataFrame({"incarnation": list(range(n)), "tenant_h": [f"t{i % 7}" for i in range(n)],
                       "prompt_tokens_billed": [rnd.randint(1, 900) for _ in range(n)],
                       "prompt_tokens_prefilled": [rnd.randint(1, 900) for _ in range(n)],
                       "prompt_tokens_cached": [0] * n, "service_ttft_s": [rnd.random() for _ in range(n)],
                       "ttft_floor_s": [0.01] * n, "below_floor": [i % 97 == 0 for i in range(n)],
                       "usage_dishonest": [i % 89 == 0 for i in range(n)]})
    first, healthy = chart_points(tt, 300)
    anomalies = tt.filter(pl.col("below_floor") | pl.col("usage_dishonest"))
    assert healthy == n - anomalies.height and first.height == 300 + anomalies.height
    assert set(first.filter(pl.col("anomaly"))["incarnation"]) == set(anomalies["incarnation"])
    for seed in range(4):
        again, _ = chart_points(_shuffled(tt, seed), 300)
        assert again.equals(first), seed
    # the sample is the healthy requests of least (hash, DRAW_ORDER) - also where hashes tie (an
    # incarnation twice, with other draw keys) right at the cut
    from dashboard.data import DRAW_ORDER
    twice = pl.concat([tt, tt.head(400).with_columns(service_ttft_s=pl.col("service_ttft_s") / 2)])
    for frame, limit in [(tt, 300), (twice, 300), (twice, 1), (twice, 4000)]:
        pts, _ = chart_points(frame, limit)
        healthy = frame.filter(~(pl.col("below_floor") | pl.col("usage_dishonest")))
        want = healthy.bottom_k(limit, by=[pl.col("incarnation").hash(seed=0), *DRAW_ORDER]).sort(DRAW_ORDER, nulls_last=True)
        assert pts.filter(~pl.col("anomaly")).select(DRAW_ORDER).equals(want.select(DRAW_ORDER)), limit
    few, healthy = chart_points(tt.head(50), 300)     # under the limit: every request drawn
    assert few.height == 50 and healthy == 50 - tt.head(50).filter(pl.col("below_floor") | pl.col("usage_dishonest")).height


MAPPED = """
import os.path, sys
import streamlit, polars, dashboard.data
from dashboard import serve
if sys.argv[1] == "mapped":
    serve.map_modules()
calls, real = [0], os.path.realpath
def counted(*a, **k):
    calls[0] += 1
    return real(*a, **k)
os.path.realpath = counted
from streamlit import env_util
env_util.is_repl()          # what Streamlit's first element of a process asks (delta_generator)
print(calls[0], len(sys.modules))
"""


def test_the_server_maps_its_modules_files_before_the_first_page_s_first_element_asks():
    """Streamlit's first element in a process calls inspect.stack(), which maps the file of every
    module loaded since its last call (a realpath each); the server does that at its start
    (serve.map_modules, in preload and once it listens), so the first page's element maps none of them."""
    root = Path(__file__).resolve().parent.parent
    seen = {}
    for how in ("mapped", "not"):
        out = subprocess.run([sys.executable, "-c", MAPPED, how], cwd=root, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0, out.stderr
        seen[how] = [int(x) for x in out.stdout.split()]
    (mapped, modules), (unmapped, _) = seen["mapped"], seen["not"]
    assert modules > 500 and unmapped >= modules // 2 and mapped <= 20, seen


# ---- the server's warm-up (dashboard/serve.py: the shared tables built while the server starts) ----
def _no_kept_tables(monkeypatch) -> None:
    """A new dashboard process: no evidence rows, no grown tables, no warm-up done (the
    verification cache stays)."""
    from dashboard import serve
    from forensics.queries import grown
    _nothing_kept(monkeypatch)
    monkeypatch.setattr(grown, "_KEPT", {})
    monkeypatch.setattr(grown, "_LOCKS", {})
    monkeypatch.setattr(serve, "warmed", {})
    for var in ("KVLEDGER_DASHBOARD_WARM", "KVLEDGER_ENGINE", "KVLEDGER_DSN", "KVLEDGER_RUN", "KVLEDGER_ANCHOR"):
        monkeypatch.delenv(var, raising=False)


def _steady(at) -> dict:
    """The page's metrics but the clock's ("N s ago" moves between two renders)."""
    return {k: v for k, v in _metrics(at).items() if k != "Last foreign read"}


def _builds() -> tuple[int, int]:
    """(tables grown.py built from every segment, whole-table reads of the n-gram evidence) so far."""
    from forensics.queries import evidence, grown
    return grown.stats["built"], evidence.stats["whole_scans"]


def test_the_server_s_warm_up_builds_what_a_first_page_reads_and_the_page_shows_the_same(glm53_vulnerable, monkeypatch):
    """After the warm-up a first page builds nothing from every segment (the requests, the exposure
    slots and the n-gram evidence are the warm-up's), draws no early banner, and shows what a first
    page with nothing kept shows."""
    from dashboard import serve
    _, store = glm53_vulnerable
    _no_kept_tables(monkeypatch)
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    cold = _app(store, monkeypatch)
    assert "early_banner_s" in cold.session_state        # (nothing was kept: the early banner came first)
    _no_kept_tables(monkeypatch)
    before = _builds()
    serve.warm()
    assert serve.warmed.get("seconds", 0) > 0, serve.warmed
    built = _builds()
    assert built[0] - before[0] == 2 and built[1] > before[1], (before, built)     # requests, slots; the evidence
    warm = _app(store, monkeypatch)
    assert _builds() == built                            # the page read the warm-up's tables
    assert "early_banner_s" not in warm.session_state
    assert _steady(warm) == _steady(cold) and _steady(warm)["Affected responses"] > 0
    assert [e.value.split(" (")[0] for e in warm.error] == [e.value.split(" (")[0] for e in cold.error]


@pytest.mark.parametrize("page_first", [False, True], ids=["no page yet", "a page loaded first"])
def test_the_warm_up_keeps_the_page_s_whole_store_answers_until_a_page_loads(page_first, glm53_vulnerable, monkeypatch,
                                                                            tmp_path):
    """Where no page has loaded when the shared tables are built and the store's answers are kept
    (it verifies, no writer holds it), the warm-up runs the page's named queries over the whole store:
    a first page then runs none of them (each is read back) and shows what a page that ran them shows.
    Once a page has loaded, the page's queries are left to it (the warm-up would run them beside it)."""
    import forensics.queries.duckdb as fd
    from dashboard import data, serve
    from dashboard.data import PAGE, UNORDERED
    from forensics.queries.answers import answers_dir
    from forensics.queries.base import without_order
    store = tmp_path / "store"
    shutil.copytree(glm53_vulnerable[1], store)          # (kept answers are per store path: this test's own)
    _no_kept_tables(monkeypatch)
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    ref = _steady(_app(store, monkeypatch))                  # (answers off: every query run)
    _no_kept_tables(monkeypatch)
    monkeypatch.setenv("KVLEDGER_ANSWER_CACHE", "1")
    monkeypatch.setattr(data, "page_loaded", threading.Event())
    if page_first:
        data.page_loaded.set()
    serve.warm()
    assert "seconds" in serve.warmed and ("answers" in serve.warmed) != page_first, serve.warmed
    kept = sorted(answers_dir(store).glob("*.arrow"))
    assert len(kept) == (0 if page_first else len(PAGE)), kept
    texts = {fd.sql(n) if n not in UNORDERED else without_order(fd.sql(n)): n for n in PAGE}
    ran: list[str] = []
    run = fd.Forensics._run
    monkeypatch.setattr(fd.Forensics, "_run", staticmethod(lambda con, text, *a: (ran.append(texts.get(text, "")),
                                                                                   run(con, text, *a))[1]))
    at = _app(store, monkeypatch)
    assert data.page_loaded.is_set()
    assert sorted(n for n in ran if n) == ([] if not page_first else sorted(PAGE)), ran
    assert _steady(at) == ref and ref["Affected responses"] > 0


def test_a_page_loaded_while_the_warm_up_runs_waits_for_it_and_nothing_is_built_twice(glm53_vulnerable, monkeypatch):
    from dashboard import serve
    _, store = glm53_vulnerable
    _no_kept_tables(monkeypatch)
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    ref = _steady(_app(store, monkeypatch))
    _no_kept_tables(monkeypatch)
    before = _builds()
    t = serve.start_warm()
    at = _app(store, monkeypatch)
    t.join(timeout=120)
    assert not t.is_alive() and "seconds" in serve.warmed, serve.warmed
    after = _builds()
    # each table built once (by whichever came first), the evidence's two whole reads once
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2), (before, after)
    assert _steady(at) == ref


def test_the_evidence_s_kept_check_does_not_wait_for_a_build_in_progress(glm53_vulnerable):
    """The early banner asks whether evidence rows are kept (``evidence.kept``) while the warm-up's
    build holds the evidence lock: the answer comes at once (not kept yet), not after the build."""
    import threading

    from forensics.queries import evidence
    _, store = glm53_vulnerable
    got: list[bool] = []
    with evidence._LOCK:                 # a build in progress
        t = threading.Thread(target=lambda: got.append(evidence.kept(store / "elsewhere", disk=False)), daemon=True)
        t.start()
        t.join(timeout=5)
        assert not t.is_alive() and got == [False]


@pytest.mark.parametrize("case", ["off", "clickhouse", "no store", "damaged", "no such run", "fails", "stopping",
                                  "interrupted", "exiting"])
def test_the_warm_up_skips_or_fails_quietly_and_keeps_nothing(case, glm53_vulnerable, monkeypatch, tmp_path, capsys):
    """Where it has nothing to do (switched off, another engine, no store, a store that does not
    verify, a run not in it) the warm-up keeps nothing and says why in ``warmed``; an error inside it
    is one note on stderr and nothing kept - never an exception in the server's start; where the
    server is stopping (its exit begun, DuckDB interrupted) it stops quietly."""
    import shutil

    from dashboard import serve
    from forensics.queries import evidence, grown
    from forensics.queries.duckdb import Forensics as F
    _, store = glm53_vulnerable
    _no_kept_tables(monkeypatch)
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    if case == "off":
        monkeypatch.setenv("KVLEDGER_DASHBOARD_WARM", "0")
    elif case == "clickhouse":
        monkeypatch.setenv("KVLEDGER_ENGINE", "chdb")
    elif case == "no store":
        monkeypatch.setenv("KVLEDGER_STORE", str(tmp_path / "nothing"))
    elif case == "damaged":
        shutil.copytree(store, tmp_path / "store")
        seg = sorted((tmp_path / "store" / "segments" / "spans").glob("*.parquet"))[0]
        seg.write_bytes(seg.read_bytes()[:-8] + b"tampered")
        monkeypatch.setenv("KVLEDGER_STORE", str(tmp_path / "store"))
    elif case == "no such run":
        monkeypatch.setenv("KVLEDGER_RUN", "zzz")
    elif case == "stopping":            # the process's exit began while requests were built: no more
        import threading
        stop = threading.Event()
        monkeypatch.setattr(serve, "_stopping", stop)
        monkeypatch.setattr(F, "request_count", lambda self, *a, **k: stop.set())
    else:
        import duckdb
        error = {"fails": RuntimeError("disk gone"), "interrupted": duckdb.InterruptException("INTERRUPT Error"),
                 "exiting": RuntimeError("cannot schedule new futures after interpreter shutdown")}[case]
        monkeypatch.setattr(F, "request_count", lambda self, *a, **k: (_ for _ in ()).throw(error))
    serve.warm()
    assert not evidence._KEPT and not grown._KEPT
    err = capsys.readouterr().err
    if case == "fails":
        assert serve.warmed == {"failed": "RuntimeError: disk gone"}
        assert err.startswith("kvledger: note: the dashboard did not build") and err.count("\n") == 1, err
    else:
        assert set(serve.warmed) == {"skipped"} and not err, (serve.warmed, err)
        if case == "damaged":
            assert "verif" in serve.warmed["skipped"], serve.warmed
        if case == "no such run":
            assert "zzz" in serve.warmed["skipped"], serve.warmed
        if case in ("stopping", "interrupted", "exiting"):        # a server stopping: nothing to say
            assert serve.warmed["skipped"].startswith("interrupted"), serve.warmed


@pytest.mark.parametrize("flags,warm", [([], "1"), (["--no-warm"], "0")], ids=["default", "no-warm"])
def test_kvledger_dashboard_passes_the_warm_up_switch_to_its_server(flags, warm, tmp_path, monkeypatch):
    from dashboard.commands import dashboard as cmd
    from engine import osutil
    seen = {}
    monkeypatch.setattr(osutil, "run_child", lambda argv, env: seen.update(argv=argv, env=env) or 0)
    import argparse
    ap = argparse.ArgumentParser()
    cmd.add_arguments(ap)
    assert cmd.run(cmd.make_config(ap.parse_args(["--store", str(tmp_path), *flags]))) == 0
    assert seen["env"]["KVLEDGER_DASHBOARD_WARM"] == warm and seen["argv"][1:3] == ["-m", "dashboard.serve"]
