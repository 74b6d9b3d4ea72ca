"""kvledger live exposure dashboard. Run: ``kvledger dashboard [--store PATH] [--port N]``.

Reads the store while the engine writes it (immutable segments, no lock), refreshing itself every
few seconds. Every panel's numbers come from dashboard/data.py, i.e. from the same named queries
``kvledger forensics`` runs.
"""
from __future__ import annotations

import datetime as dt
import os
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()       # this script run's start: the footer says how long the page took

import altair as alt
import polars as pl
import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dashboard.data import TIERS, Filters, Panels  # noqa: E402

STORE = os.environ.get("KVLEDGER_STORE", "./kvledger-store")
REFRESH = float(os.environ.get("KVLEDGER_REFRESH_S", "2"))
ENGINE = {"engine": os.environ.get("KVLEDGER_ENGINE", "duckdb"), "dsn": os.environ.get("KVLEDGER_DSN") or None}
RED, GREEN, AMBER = "#d62728", "#2ca02c", "#ff9f0e"

st.set_page_config(page_title="kvledger - KV exposure", layout="wide")
st.title("kvledger: who read whose KV")
# refresh adapts: never faster than the page renders (a slower page gets a longer interval)
EVERY = st.session_state.setdefault("refresh_every", REFRESH)
st.caption(f"store `{STORE}` - refreshes every {EVERY:g} s (at least {REFRESH:g} s, never faster than the page "
           "renders) - tenants are store-keyed pseudonyms")
st.markdown(f"""<style>
[class*="st-key-kpi-red"] {{border-left: 6px solid {RED}; background: {RED}14; padding-left: .6em; border-radius: 4px}}
[class*="st-key-kpi-amber"] {{border-left: 6px solid {AMBER}; background: {AMBER}14; padding-left: .6em; border-radius: 4px}}
[class*="st-key-kpi-ok"] {{border-left: 6px solid {GREEN}; padding-left: .6em; border-radius: 4px}}
</style>""", unsafe_allow_html=True)

if not (Path(STORE) / "chain").is_dir():
    @st.fragment(run_every=REFRESH)
    def wait_for_store() -> None:
        """Keep looking: the engine may create the store after the dashboard started."""
        if (Path(STORE) / "chain").is_dir():
            st.rerun()
        st.error(f"No kvledger store at {STORE} yet. Start one with `kvledger replay glm53 --store {STORE}`; "
                 "this page picks it up by itself.")

    wait_for_store()
    st.stop()

SCORE_HELP = ("exposure score = KV tokens of other requests the response read, x10 if any of it surfaced in its "
              "output (README: Exposure score)")
WINDOWS = {"last 5 minutes": dt.timedelta(minutes=5), "last hour": dt.timedelta(hours=1), "last day": dt.timedelta(days=1)}


def window_start(window: str) -> dt.datetime | None:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) - WINDOWS[window] if window in WINDOWS else None


with st.sidebar:
    st.header("Filters")
    window = st.selectbox("Window", ["whole store", "last 5 minutes", "last hour", "last day"], key="window")
    meta = Panels(STORE, Filters(start=window_start(window)), engine=ENGINE)
    meta.prefetch()         # every query of the page at once, while the sidebar fills in
    tenant = st.selectbox("Tenant", ["all"] + meta.tenants(), key="tenant")
    node = st.selectbox("Node", ["all"] + meta.node_names(), key="node")
    policy = st.selectbox("Policy", ["all", "vulnerable", "hardened", "custom"], key="policy")

# the panels of this script run read the sidebar's snapshot (the store is opened once per run);
# the fragment's own reruns every REFRESH seconds open a fresh one
_THIS_RUN = {"snapshot": meta}


def filters(start: dt.datetime | None = None) -> Filters:
    """The sidebar's filters; the window starts now unless this run's snapshot fixed it (start)."""
    return Filters(start=start or window_start(window), tenant=None if tenant == "all" else tenant,
                   node=None if node == "all" else node, policy=None if policy == "all" else policy)


ROWS = 300      # a table shows the rows that matter first (red ones), at most this many
CHART_POINTS = 3000     # healthy requests drawn in the TTFT chart at most (anomalies: all)


def table(df: pl.DataFrame, red: str | None = None) -> None:
    """A table whose rows turn red where column `red` is true; red rows first, at most ROWS of them."""
    if red is not None and df.height:
        df = df.sort(red, descending=True, maintain_order=True)
    shown = df.head(ROWS)
    if red is not None and shown.height:
        pdf = shown.to_pandas().style.apply(
            lambda row: [f"background-color: {RED}33" if row[red] else ""] * len(row), axis=1)
    else:
        pdf = shown.to_pandas()
    st.dataframe(pdf, hide_index=True, width="stretch")
    if df.height > ROWS:
        st.caption(f"showing {ROWS} of {df.height} rows (use the filters, or `kvledger forensics` for all)")


def _switches(v) -> str:
    items = v.items() if isinstance(v, dict) else ((d["key"], d["value"]) for d in v)
    return ", ".join(f"{k}={'on' if on else 'off'}" for k, on in items)


def banner(p: Panels, t: dict) -> None:
    """The page's one-line state, loudest first: exposure, then lost telemetry, else all clear."""
    n, crit, high = t["affected_responses"], t["critical_responses"], t["high_responses"]
    window = "in this window" if p.f.start else "in the store"
    if crit or high:
        st.error(f"EXPOSURE {window}: {crit + high} response(s) read another customer's KV ({crit} critical: the "
                 f"donor's text surfaced in the output; {high} high). {t['donor_tenants']} donor and "
                 f"{t['recipient_tenants']} recipient tenant(s). Notify them (`kvledger report`).", icon=":material/error:")
    elif n:
        st.warning(f"{n} response(s) read KV that was not their own chain {window}, none of it another "
                   "customer's (same-tenant or unwritten slots).", icon=":material/warning:")
    else:
        st.success(f"No exposure {window}: no response read KV it did not write.", icon=":material/check_circle:")
    gaps = p.gaps()
    if gaps.height:
        st.warning(f"Telemetry gaps: {int(gaps['items'].sum())} item(s) lost in {gaps.height} gap(s) not filled - "
                   "missing data is not a clean bill (`kvledger forensics gaps`).", icon=":material/warning:")


@st.fragment(run_every=EVERY)
def live() -> None:
    global _T0
    snap = _THIS_RUN.pop("snapshot", None)
    if snap is None:                        # a fragment rerun: time it from here, on a fresh snapshot
        _T0 = time.perf_counter()
    p = Panels(STORE, filters(snap.f.start if snap else None), same_snapshot_as=snap, engine=ENGINE)
    p.prefetch()
    if p.fx.unverified_note:
        st.error(p.fx.unverified_note + " (`kvledger verify` names the damage)", icon=":material/error:")
    t = p.totals()
    banner(p, t)
    cross = t["critical_responses"] + t["high_responses"]
    cols = st.columns(6)
    for c, (label, key, alert) in zip(cols, [
            ("Affected responses", "affected_responses", "red" if cross else "amber" if t["affected_responses"] else "ok"),
            ("Surfaced", "surfaced_responses", "red" if t["critical_responses"] else "ok"),
            ("Foreign KV tokens read", "foreign_tokens", "red" if cross else "amber" if t["foreign_tokens"] else "ok"),
            ("Recipient tenants", "recipient_tenants", "red" if t["recipient_tenants"] else "ok"),
            ("Donor tenants", "donor_tenants", "red" if t["donor_tenants"] else "ok"),
            ("Exposure score", "exposure_score", "red" if cross else "ok")]):
        with c.container(key=f"kpi-{alert}-{key}"):
            st.metric(label, t[key], help=SCORE_HELP if key == "exposure_score" else None)

    left, right = st.columns(2)
    with left:
        st.subheader("Exposure score over time")
        sot = p.score_over_time()
        if sot.is_empty():
            st.info("No exposure recorded in this window.")
        else:
            st.altair_chart(alt.Chart(sot.to_pandas()).mark_line(point=True, color=RED).encode(
                x=alt.X("time:T", title="first foreign read (UTC)", axis=alt.Axis(format="%H:%M:%S")),
                y=alt.Y("cumulative_score:Q", title="cumulative exposure score")), width="stretch")
    with right:
        st.subheader("Donor -> recipient tenants")
        tm, own = p.tenant_matrix(), p.same_tenant_reads()
        if own.height:
            st.caption(f"{int(own['responses'].sum())} response(s) read KV of their own tenant's other requests: not "
                       "another customer's data, left out of this map (the Affected responses table has them, tier "
                       "medium)")
        if tm.is_empty():
            st.info("No tenant read another tenant's KV in this window.")
        else:
            st.altair_chart(alt.Chart(tm.to_pandas()).mark_rect().encode(
                x=alt.X("recipient_tenant:N", title="recipient"), y=alt.Y("donor_tenant:N", title="donor"),
                color=alt.Color("foreign_tokens:Q", scale=alt.Scale(scheme="reds")),
                tooltip=["donor_tenant", "recipient_tenant", "responses", "foreign_tokens", "surfaced_responses"]),
                width="stretch")

    st.subheader("Affected responses")
    sc = p.scores()
    st.caption("Tier, most severe first: " + "; ".join(f"**{k}** - {v}" for k, v in TIERS.items())
               + ". The score ranks responses within a tier: " + SCORE_HELP)
    table(sc.with_columns(urgent=pl.col("tier").is_in(["critical", "high"])), "urgent")
    if sc.height:
        pick = st.selectbox("Drill down into response", sc["response"].to_list(), key="drill")
        st.caption("Pages it read, who wrote them, read vs surfaced")
        table(p.drill_down(pick))

    st.subheader("TTFT vs uncached prompt tokens")
    tt = p.ttft()
    if tt.is_empty():
        st.info("No request reached its first token in this window.")
    else:
        pts = tt.select("incarnation", "tenant_h", "prompt_tokens_billed", "prompt_tokens_prefilled", "service_ttft_s",
                        "ttft_floor_s", anomaly=pl.col("below_floor") | pl.col("usage_dishonest"),
                        uncached=pl.col("prompt_tokens_billed") - pl.col("prompt_tokens_cached"))
        healthy = pts.filter(~pl.col("anomaly"))
        if healthy.height > CHART_POINTS:       # every anomaly is drawn; healthy requests are sampled
            pts = pl.concat([pts.filter(pl.col("anomaly")), healthy.sample(CHART_POINTS, seed=0)])
            st.caption(f"every anomaly drawn; {CHART_POINTS} of {healthy.height} healthy requests sampled")
        floor = tt.group_by(uncached=pl.col("prompt_tokens_billed") - pl.col("prompt_tokens_cached")).agg(
            pl.col("ttft_floor_s").max()).sort("uncached")
        dots = alt.Chart(pts.to_pandas()).mark_circle(size=70).encode(
            x=alt.X("uncached:Q", title="billed uncached prompt tokens"), y=alt.Y("service_ttft_s:Q", title="TTFT minus queueing (s)"),
            color=alt.condition("datum.anomaly", alt.value(RED), alt.value(GREEN)),
            tooltip=["incarnation", "tenant_h", "prompt_tokens_billed", "prompt_tokens_prefilled", "service_ttft_s"])
        line = alt.Chart(floor.to_pandas()).mark_line(strokeDash=[4, 4], color="gray").encode(x="uncached:Q",
                                                                                             y="ttft_floor_s:Q")
        st.altair_chart(dots + line, width="stretch")

    st.subheader("Usage honesty")      # full width: these tables are wide
    uh = p.usage_honesty()
    st.metric("Billed for more prompt than prefilled", uh.height)
    table(uh)
    st.subheader("Transfer integrity")
    tr = p.transfers()
    st.metric("Transfers failing integrity", int((~tr["integrity_ok"]).sum()) if tr.height else 0)
    table(tr.select("incarnation", "src_node", "dst_node", "reserved", "landed", "checksum_ok", "integrity_ok",
                    "outcome", failing=~pl.col("integrity_ok")) if tr.height else tr, "failing" if tr.height else None)

    st.subheader("Deferred releases and held capacity")
    rel = p.releases()
    table(rel.with_columns(timed_out=pl.col("ended_by") == "timeout"), "timed_out")
    st.subheader("Guard liveness")
    g = p.guards()
    table(g, "idle_but_on")

    st.subheader("Preflight per node")
    pre = p.preflight()
    if pre.height:
        pre = pre.with_columns(pl.col("guards").map_elements(_switches, return_dtype=pl.String))
    table(pre.with_columns(small=~pl.col("pool_fits_context")), "small")

    st.subheader("Foreign fleet (vLLM / SGLang telemetry)")
    flagged, lines, ledger = p.fleet()
    if not ledger and (flagged.height or lines.height):
        st.warning("These engines keep no page ledger: which pages a response read, and whose they were, cannot "
                   "be shown. Below: their requests over the instance's KV pool or under the TTFT floor of their "
                   "length, and their own KV canary / checksum lines.")
    fr = p.fleet_requests()
    if fr.height:          # the incident's signal on any engine: TTFT that does not grow with the prompt
        pts = fr.select("instance", "request_id", "tenant_h", "uncached_tokens", "ttft_s", "ttft_expected_s",
                        flag=pl.col("below_floor") | pl.col("over_pool"))
        dots = alt.Chart(pts.to_pandas()).mark_circle(size=60).encode(
            x=alt.X("uncached_tokens:Q", title="billed uncached prompt tokens"), y=alt.Y("ttft_s:Q", title="TTFT (s)"),
            color=alt.condition("datum.flag", alt.value(RED), alt.value(GREEN)), shape="instance:N",
            tooltip=["instance", "request_id", "tenant_h", "uncached_tokens", "ttft_s", "ttft_expected_s"])
        fit = alt.Chart(pts.to_pandas()).mark_line(strokeDash=[4, 4], color="gray").encode(
            x="uncached_tokens:Q", y="ttft_expected_s:Q", detail="instance:N")
        st.altair_chart(dots + fit, width="stretch")
        st.caption("Foreign requests: TTFT against uncached prompt tokens, each instance's robust (Theil-Sen) fit "
                   "dashed; red: under the floor of its length or billed over the instance's pool. Per tenant:")
        table(p.fleet_tenants().with_columns(flagged=(pl.col("below_floor") + pl.col("over_pool")) > 0), "flagged")
    if flagged.is_empty() and lines.is_empty():
        st.info("No foreign request flagged and no detector line (`kvledger collect`, `kvledger ingest-logs`).")
    else:
        table(flagged.with_columns(flag=pl.col("below_floor") | pl.col("over_pool")), "flag")
        table(lines)

    st.subheader("External probes")
    pr = p.probes()
    if pr.is_empty():
        st.info("No `kvledger probe --store` run recorded in this store.")
    else:
        table(pr.select("ts", "base_url", "check", "verdict", "findings", "detail")
              .with_columns(finding=pl.col("verdict") == "finding"), "finding")
    took = time.perf_counter() - _T0
    st.caption(f"data as of {dt.datetime.now(dt.timezone.utc):%H:%M:%S} UTC - rendered in {took:.2f} s - next "
               f"refresh in {EVERY:g} s")
    need = max(REFRESH, round(1.5 * took + 0.5, 1))     # room to render, then to read it
    if need > EVERY or (EVERY > REFRESH and need < 0.5 * EVERY):
        st.session_state["refresh_every"] = need
    # the fragment's interval is fixed when the whole app runs: a timed rerun that finds it changed
    # reruns the app (never a run a person started: that would drop what they clicked)
    if snap is None and st.session_state["refresh_every"] != EVERY:
        st.rerun()


live()

st.subheader("Export")
if st.button("Build the disclosure report for this window", key="export"):
    import json

    from forensics.report import build, markdown
    f = filters()
    rep = build(STORE, f.start, f.end, allow_unverified=True)                 # built in memory: nothing is written beside the store
    st.download_button("report.md", markdown(rep), file_name="report.md", key="dl_md")
    st.download_button("report.json", json.dumps(rep, indent=2), file_name="report.json", key="dl_json")
    st.success(f"Report ready: {rep['counts']['affected_responses']} affected response(s).")
