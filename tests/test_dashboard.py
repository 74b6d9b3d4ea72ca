"""The live dashboard: every panel renders on a store made by a real replay, its numbers equal
the forensic queries', filters narrow them, and a browser sees the exposure count appear and grow
while a replay writes in another process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.data import Filters, Panels
from forensics.queries.duckdb import Forensics

pytestmark = pytest.mark.xdist_group("glm53")
APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PANELS = ["Exposure score over time", "Donor -> recipient tenants", "Affected responses", "TTFT vs uncached prompt tokens",
          "Usage honesty", "Transfer integrity", "Deferred releases and held capacity", "Guard liveness",
          "Preflight per node", "Foreign fleet (vLLM / SGLang telemetry)", "External probes", "Export"]


def _app(store, monkeypatch) -> AppTest:
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _metrics(at) -> dict[str, int]:
    return {m.label: int(m.value) for m in at.metric}


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
    assert m["Surfaced"] == int(scores["surfaced"].sum())
    assert m["Donor tenants"] == ex.filter(pl.col("donor") != -1)["donor_tenant"].n_unique()
    assert m["Billed for more prompt than prefilled"] == int(ttft["usage_dishonest"].sum())
    assert m["Transfers failing integrity"] == int((~tr["integrity_ok"]).sum())
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
    at = AppTest.from_file(APP, default_timeout=60)
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
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            keep = os.environ.get("KVLEDGER_KEEP_SCREENSHOTS")       # to look at it, as a person would
            if keep:
                import shutil
                shutil.copy(tmp_path / "dashboard.png", Path(keep) / "dashboard.png")
            browser.close()
        assert overflow <= 0, f"the page is {overflow} px wider than a 1400 px window"
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
