"""kvledger live exposure dashboard. Run: ``kvledger dashboard [--store PATH] [--port N]``.

Reads the store while the engine writes it (immutable segments, no lock), refreshing itself every
few seconds inside a fragment (no full-page rerun, nothing fades). Every panel's numbers come from
dashboard/data.py, i.e. from the same named queries ``kvledger forensics`` runs. The view - time
range, run, tenant, node, policy and section - lives in the URL's query parameters, so a link
shows the same view to the next person.
"""
from __future__ import annotations

import datetime as dt
import os
import re
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()       # this script run's start: the footer says how long the page took

import numpy as np
import pandas as pd
import polars as pl
import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dashboard.data import (BANNER, PAGE, PROTECTION, TIERS, TRANSFER_ORDER, Filters, Panels, Protection,  # noqa: E402
                            chart_points, first_rows, page_loaded)
from forensics.window import ago, parse_when, utcnow  # noqa: E402

page_loaded.set()          # (the server's warm-up leaves the page's queries to this page from now on)
STORE = os.environ.get("KVLEDGER_STORE", "./kvledger-store")
REFRESH = float(os.environ.get("KVLEDGER_REFRESH_S", "2"))
ENGINE = {"engine": os.environ.get("KVLEDGER_ENGINE", "duckdb"), "dsn": os.environ.get("KVLEDGER_DSN") or None,
          "chdb_path": os.environ.get("KVLEDGER_CHDB_PATH") or None}
RUN = os.environ.get("KVLEDGER_RUN") or None
ANCHOR = os.environ.get("KVLEDGER_ANCHOR") or None
ALLOW_UNVERIFIED = os.environ.get("KVLEDGER_ALLOW_UNVERIFIED") == "1"
RED, GREEN, AMBER = "#d62728", "#2ca02c", "#ff9f0e"
VIEWS = {"all": "everything", "exposure": "who read whose KV", "latency": "TTFT and billing",
         "integrity": "transfers, releases, guards, preflight", "fleet": "vLLM / SGLang fleet and probes"}
ROWS = 100      # a table shows the rows that matter first (red ones), at most this many (a coloured
                # table costs pandas' Styler ~1 ms a row to draw: 300 rows of four tables was ~1 s a refresh)
CHART_POINTS = 3000     # healthy requests drawn in the TTFT chart at most (anomalies: all)
SCORE_HELP = ("exposure score = KV tokens of other requests the response read, x10 if any of it surfaced in its "
              "output (README: Exposure score)")

st.set_page_config(page_title="kvledger - KV exposure", layout="wide")
# A refresh re-renders inside the fragment; Streamlit would fade every element until its new value
# arrives and spin its running widget: on a live view that reads as "broken" every few seconds.
# The previous value stays at full strength until the new one replaces it.
st.markdown(f"""<style>
[data-stale="true"], [data-stale="true"] * {{opacity: 1 !important; transition: none !important}}
[data-testid="stStatusWidget"] {{visibility: hidden}}
[class*="st-key-kpi-red"] {{border-left: 6px solid {RED}; background: {RED}14; padding-left: .6em; border-radius: 4px}}
[class*="st-key-kpi-amber"] {{border-left: 6px solid {AMBER}; background: {AMBER}14; padding-left: .6em; border-radius: 4px}}
[class*="st-key-kpi-ok"] {{border-left: 6px solid {GREEN}; padding-left: .6em; border-radius: 4px}}
</style>""", unsafe_allow_html=True)
st.title("kvledger: who read whose KV")
# refresh adapts: never faster than the page renders (a slower page gets a longer interval)
EVERY = st.session_state.setdefault("refresh_every", REFRESH)
st.caption(f"store `{STORE}`{f' - run `{RUN}`' if RUN else ''} - refreshes every {EVERY:g} s (at least "
           f"{REFRESH:g} s, never faster than the page renders) - tenants are store-keyed pseudonyms")

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


# ---- the view, in the URL ---------------------------------------------------------------------
QP = st.query_params


def url_state(key: str, value: str, default: str) -> None:
    """Keep the URL's query parameters equal to the view (a default leaves the parameter out)."""
    if value == default:
        QP.pop(key, None)
    elif QP.get(key) != value:
        QP[key] = value


def when(text: str, label: str | None = None) -> dt.datetime | None:
    """The time a sidebar field names (None: empty or unreadable); ``label``: say why in the
    sidebar (the script run only - a fragment rerun may not write outside its own body)."""
    if not text.strip():
        return None
    try:
        return parse_when(text)
    except ValueError as e:
        if label is not None:
            st.sidebar.error(f"{label}: {e}")
        return None


def open_panels(f: Filters, snap: "Panels | None" = None) -> Panels:
    """The store's panels, or the red banner with the reader's own words and nothing else: a store
    that cannot be read at all (an unreadable chain, a wrong --run, a missing anchor) is never a
    traceback."""
    from engine.errors import KvledgerError
    from forensics.queries.clickhouse import ClickHouseError
    try:
        return Panels(STORE, f, same_snapshot_as=snap, engine=ENGINE, run=RUN, anchor=ANCHOR)
    except (KvledgerError, ClickHouseError) as e:
        if RUN and "--run" in str(e):           # the store is fine: the run asked for is not in it
            st.error(f"Cannot show run {RUN!r}: {e}", icon=":material/error:")
        else:
            st.error(f"UNVERIFIED STORE - cannot read {STORE}: {e} (`kvledger verify` names the damage)",
                     icon=":material/error:")
        st.stop()


with st.sidebar:
    st.header("View")
    view = st.segmented_control("Section", list(VIEWS), default=QP.get("view") if QP.get("view") in VIEWS else "all", key="view",
                                help="; ".join(f"{k}: {v}" for k, v in VIEWS.items())) or "all"
    since = st.text_input("From", QP.get("from", ""), key="from", placeholder="store start",
                          help="ISO 8601 UTC (2026-09-01T12:00:00Z) or relative: now-15m, 2h, 7d; empty: the start")
    until = st.text_input("To", QP.get("to", ""), key="to", placeholder="now",
                          help="ISO 8601 UTC or relative (now-5m); empty: now")
    meta = open_panels(Filters(start=when(since, "From"), end=when(until, "To")))
    # the state line's queries at once, while the sidebar fills in (the rest after it) - those that need no
    # n-gram evidence only, where it is still to be built: the banner is drawn first without it (live())
    meta.prefetch(PROTECTION if meta.fx.evidence_pending() else BANNER)
    tenants, nodes = ["all"] + meta.tenants(), ["all"] + meta.node_names()
    pick = lambda k, opts: opts.index(QP.get(k)) if QP.get(k) in opts else 0  # noqa: E731
    tenant = st.selectbox("Tenant", tenants, index=pick("tenant", tenants), key="tenant")
    node = st.selectbox("Node", nodes, index=pick("node", nodes), key="node")
    policies = ["all", "vulnerable", "hardened", "custom"]
    policy = st.selectbox("Policy", policies, index=pick("policy", policies), key="policy")
    for k, v, d in (("view", view, "all"), ("from", since.strip(), ""), ("to", until.strip(), ""),
                    ("tenant", tenant, "all"), ("node", node, "all"), ("policy", policy, "all")):
        url_state(k, v, d)
    st.caption("This view is in the page's address: copy the link to share it.")

# the panels of this script run read the sidebar's snapshot (the store is opened once per run);
# the fragment's own reruns every REFRESH seconds open a fresh one
_THIS_RUN = {"snapshot": meta}


def filters(start: dt.datetime | None = None) -> Filters:
    """The sidebar's filters; a relative range is re-read from now on every refresh."""
    return Filters(start=start or when(since), end=when(until),
                   tenant=None if tenant == "all" else tenant,
                   node=None if node == "all" else node, policy=None if policy == "all" else policy)


def table(df: pl.DataFrame, red: str | None = None, shown_as=None, order: list[str] | None = None) -> None:
    """A table whose rows turn red where column `red` is true; red rows first, at most ROWS of them
    (``shown_as``: how those rows are written for the eye, applied to them alone). ``order``: rows
    in no set order (an UNORDERED query's), shown by these columns ascending, nulls last, as the
    query's ORDER BY had them - the first ROWS picked without sorting the whole frame."""
    shown = first_rows(df, ROWS, red, order)
    if shown_as is not None and shown.height:
        shown = shown_as(shown)
    pdf = shown.to_pandas()
    if red is not None and shown.height and shown[red].any():
        # the rows' colours as one frame of CSS, computed in columns (a per-row apply was ~0.1 s a
        # table at 300 rows); no styler at all where nothing is red
        css = np.where(pdf[red].to_numpy(dtype=bool)[:, None], f"background-color: {RED}33", "")
        styles = pd.DataFrame(np.broadcast_to(css, pdf.shape), index=pdf.index, columns=pdf.columns)
        pdf = pdf.style.apply(lambda _: styles, axis=None)
    st.dataframe(pdf, hide_index=True, width="stretch")
    if df.height > ROWS:
        st.caption(f"showing {ROWS} of {df.height} rows (use the filters, or `kvledger forensics` for all)")


_TYPES = {"Q": "quantitative", "N": "nominal", "T": "temporal"}


def chart(spec: dict, data: pl.DataFrame | None = None, **datasets: pl.DataFrame) -> None:
    """A Vega-Lite chart of ``spec`` over ``data`` (or over ``datasets`` its layers name), the frames
    handed to Streamlit as they are (Arrow). Written as the spec itself, not through altair, which
    checked every chart against Vega-Lite's JSON schema and went through pandas: a first page's
    drawing after its queries took 0.24-0.29 s this way, 0.30-0.32 s through altair (121 M read
    rows' store, 2 page loads each, interleaved; this machine)."""
    spec = dict(spec)
    if data is not None:
        spec["data"] = {"values": data}
    if datasets:
        spec["datasets"] = datasets
    st.vega_lite_chart(spec, width="stretch")


def _axis(field: str, kind: str, title: str | None = None, **more) -> dict:
    """A Vega-Lite encoding channel: the field, its type (Q, N, T as in altair's shorthand), title."""
    return {"field": field, "type": _TYPES[kind], **({"title": title} if title else {}), **more}


def _flag(col: str) -> dict:
    """A mark coloured red where the boolean field ``col`` is true, else green."""
    return {"condition": {"test": f"datum.{col}", "value": RED}, "value": GREEN}


def _tooltip(df: pl.DataFrame, *cols: str) -> list[dict]:
    """Tooltip channels for these columns of ``df``, each typed from its dtype."""
    return [_axis(c, "Q" if df.schema[c].is_numeric() else "T" if df.schema[c].is_temporal() else "N") for c in cols]


def _switches(v) -> str:
    items = v.items() if isinstance(v, dict) else ((d["key"], d["value"]) for d in v)
    return ", ".join(f"{k}={'on' if on else 'off'}" for k, on in items)


# ---- the state line ---------------------------------------------------------------------------
def clock(pr: Protection) -> str:
    if pr.last_foreign_read is None:
        return "no foreign read recorded"
    return (f"{'ONGOING' if pr.ongoing else 'past'}: last foreign read {pr.last_foreign_read:%Y-%m-%d %H:%M:%S} "
            f"UTC ({ago(pr.last_foreign_read)}); {pr.recent[5]} response(s) in the last 5 min, {pr.recent[60]} in "
            "the last 60")


def banner(p: Panels, t: dict, pr: Protection) -> None:
    """The page's state, loudest first: a store that does not verify, exposure, an unprotected or
    degraded server, lost telemetry; green only when protected and clean. ``t``: totals(), or early()
    (no critical / high split yet: the n-gram evidence is still being built, and the banner says so)."""
    n, cross = t["affected_responses"], t["cross_responses"]
    window = "in this window" if p.f.start or p.f.end else "in the store"
    unprotected = [r for r in pr.reasons if r != "the store does not verify"]
    if cross:
        split = (f"{t['critical_responses']} critical: the donor's text surfaced in the output; {t['high_responses']} "
                 "high" if "critical_responses" in t else "critical where the donor's text surfaced in the output: "
                 "still being checked")
        st.error(f"EXPOSURE {window}: {cross} response(s) read another customer's KV ({split}). {t['donor_tenants']} "
                 f"donor and {t['recipient_tenants']} recipient tenant(s). Notify them (`kvledger report`). "
                 f"{clock(pr)}.", icon=":material/error:")
    if pr.state == "red" and unprotected:
        st.error("UNPROTECTED: the latest run can expose one request's KV to another - " + "; ".join(
            r for r in unprotected[:4]) + ". `kvledger preflight` and `--policy hardened` turn the guards on.",
            icon=":material/gpp_bad:")
    elif pr.state == "amber":
        st.warning("DEGRADED: " + "; ".join(pr.reasons) + " - missing data is not a clean bill.",
                   icon=":material/warning:")
    if not cross:
        if n:
            st.warning(f"{n} response(s) read KV that was not their own chain {window}, none of it another "
                       "customer's (same-tenant or unwritten slots).", icon=":material/warning:")
        elif pr.state == "green":
            st.success(f"Protected and clean {window}: every guard on, every pool fits its context, no response "
                       f"read KV it did not write ({clock(pr)}).", icon=":material/check_circle:")


def tiles(t: dict, pr: Protection) -> None:
    cross = t["critical_responses"] + t["high_responses"]
    prot = {"red": "red", "amber": "amber", "green": "ok"}[pr.state]
    last = ago(pr.last_foreign_read) if pr.last_foreign_read else "never"
    cells = [("Protection", pr.state.upper() if pr.state != "green" else "OK", prot, None),
             ("Last foreign read", last, "red" if pr.ongoing else "amber" if pr.last_foreign_read else "ok",
              "the last read of another request's KV, whole store, any run"),
             ("Exposed, last 5 min", pr.recent[5], "red" if pr.recent[5] else "ok", None),
             ("Affected responses", t["affected_responses"], "red" if cross else "amber" if t["affected_responses"]
              else "ok", None),
             ("Surfaced, other customers'", t["critical_responses"], "red" if t["critical_responses"] else "ok",
              f"responses whose output repeated another customer's prompt text; "
              f"{t['surfaced_responses'] - t['critical_responses']} more repeated only their own tenant's"),
             ("Foreign KV tokens read", t["foreign_tokens"], "red" if cross else "amber" if t["foreign_tokens"]
              else "ok", None),
             ("Recipient tenants", t["recipient_tenants"], "red" if t["recipient_tenants"] else "ok", None),
             ("Donor tenants", t["donor_tenants"], "red" if t["donor_tenants"] else "ok", None),
             ("Exposure score", t["exposure_score"], "red" if cross else "ok", SCORE_HELP)]
    for row in (cells[:3], cells[3:6], cells[6:]):
        for c, (label, value, alert, help_) in zip(st.columns(3), row):
            with c.container(key=f"kpi-{alert}-{re.sub(r'[^A-Za-z0-9]+', '_', label)}"):
                st.metric(label, value, help=help_)


# ---- sections ---------------------------------------------------------------------------------
def exposure_section(p: Panels) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Exposure score over time")
        sot = p.score_over_time()
        if sot.is_empty():
            st.info("No exposure recorded in this window.")
        else:
            chart({"mark": {"type": "line", "point": {"color": RED}, "color": RED}, "encoding": {
                "x": _axis("time", "T", "first foreign read (UTC)", axis={"format": "%H:%M:%S", "tickMinStep": 1000}),
                "y": _axis("cumulative_score", "Q", "cumulative exposure score")}}, data=sot)
    with right:
        st.subheader("Donor -> recipient tenants")
        tm, own, nobody = p.tenant_matrix(), p.same_tenant_reads(), p.not_a_tenant_reads()
        if own.height:
            st.caption(f"{int(own['responses'].sum())} response(s) read KV of their own tenant's other requests: not "
                       "another customer's data, left out of this map (the Affected responses table has them, tier "
                       "medium)")
        if nobody.height:
            kinds = nobody.group_by("donor_kind").agg(pl.col("responses").sum()).sort("donor_kind")
            words = {"unwritten": "slots nobody wrote (no one's data)",
                     "unrecorded": "KV of requests not yet recorded (still running, or cut off)"}
            st.caption("Not a tenant, left out of this map: " + "; ".join(
                f"{r['responses']} response(s) read {words.get(r['donor_kind'], r['donor_kind'])}"
                for r in kinds.iter_rows(named=True)))
        if tm.is_empty():
            st.info("No tenant read another tenant's KV in this window.")
        else:
            chart({"mark": "rect", "encoding": {
                "x": _axis("recipient_tenant", "N", "recipient"), "y": _axis("donor_tenant", "N", "donor"),
                "color": _axis("foreign_tokens", "Q", scale={"scheme": "reds"}),
                "tooltip": _tooltip(tm, "donor_tenant", "recipient_tenant", "responses", "foreign_tokens",
                                    "surfaced_responses")}}, data=tm)

    st.subheader("Affected responses")
    sc = p.scores()
    st.caption("Tier, most severe first: " + "; ".join(f"**{k}** - {v}" for k, v in TIERS.items())
               + ". The score ranks responses within a tier: " + SCORE_HELP)
    table(sc.with_columns(urgent=pl.col("tier").is_in(["critical", "high"])), "urgent")
    if sc.height:
        pick = st.selectbox("Drill down into response", sc["response"].to_list(), key="drill")
        st.caption("Pages it read, who wrote them, read vs surfaced")
        table(p.drill_down(pick))


def latency_section(p: Panels) -> None:
    st.subheader("TTFT vs uncached prompt tokens")
    tt = p.ttft()
    if tt.is_empty():
        st.info("No request reached its first token in this window.")
    else:
        pts, healthy = chart_points(tt, CHART_POINTS)
        if healthy > CHART_POINTS:
            st.caption(f"every anomaly drawn; {CHART_POINTS} of {healthy} healthy requests sampled")
        floor = tt.group_by(uncached=pl.col("prompt_tokens_billed") - pl.col("prompt_tokens_cached")).agg(
            pl.col("ttft_floor_s").max()).sort("uncached")
        chart({"layer": [
            {"data": {"name": "dots"}, "mark": {"type": "circle", "size": 70}, "encoding": {
                "x": _axis("uncached", "Q", "billed uncached prompt tokens"),
                "y": _axis("service_ttft_s", "Q", "TTFT minus queueing (s)"), "color": _flag("anomaly"),
                "tooltip": _tooltip(pts, "incarnation", "tenant_h", "prompt_tokens_billed", "prompt_tokens_prefilled",
                                    "service_ttft_s")}},
            {"data": {"name": "floor"}, "mark": {"type": "line", "strokeDash": [4, 4], "color": "gray"},
             "encoding": {"x": _axis("uncached", "Q"), "y": _axis("ttft_floor_s", "Q")}}]}, dots=pts, floor=floor)

    st.subheader("Usage honesty")      # full width: these tables are wide
    uh = p.usage_honesty()
    st.metric("Billed for more prompt than prefilled", uh.height)
    table(uh)


def integrity_section(p: Panels) -> None:
    st.subheader("Transfer integrity")
    tr = p.transfers()
    st.metric("Transfers failing integrity", int((~tr["integrity_ok"]).sum()) if tr.height else 0)
    table(tr.select("incarnation", "src_node", "dst_node", "reserved", "landed", "checksum_ok", "integrity_ok",
                    "outcome", *TRANSFER_ORDER[:2], failing=~pl.col("integrity_ok")) if tr.height else tr,
          "failing" if tr.height else None, lambda shown: shown.drop(TRANSFER_ORDER[:2]),
          order=TRANSFER_ORDER if tr.height else None)

    st.subheader("Deferred releases and held capacity")
    rel = p.releases()
    table(rel.with_columns(timed_out=pl.col("ended_by") == "timeout"), "timed_out")
    st.subheader("Guard liveness")
    table(p.guards(), "idle_but_on")

    st.subheader("Preflight per node")
    pre = p.preflight()
    table(pre.with_columns(small=~pl.col("pool_fits_context")), "small",
          lambda shown: shown.with_columns(pl.col("guards").map_elements(_switches, return_dtype=pl.String)))


def fleet_section(p: Panels) -> None:
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
        chart({"data": {"name": "pts"}, "layer": [
            {"mark": {"type": "circle", "size": 60}, "encoding": {
                "x": _axis("uncached_tokens", "Q", "billed uncached prompt tokens"), "y": _axis("ttft_s", "Q", "TTFT (s)"),
                "color": _flag("flag"), "shape": _axis("instance", "N"),
                "tooltip": _tooltip(pts, "instance", "request_id", "tenant_h", "uncached_tokens", "ttft_s",
                                    "ttft_expected_s")}},
            {"mark": {"type": "line", "strokeDash": [4, 4], "color": "gray"}, "encoding": {
                "x": _axis("uncached_tokens", "Q"), "y": _axis("ttft_expected_s", "Q"), "detail": _axis("instance", "N")}}]},
              pts=pts)
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


SECTIONS = {"exposure": exposure_section, "latency": latency_section, "integrity": integrity_section,
            "fleet": fleet_section}


def adapt_refresh(took: float, timed: bool) -> None:
    """Never refresh faster than the page renders; the fragment's interval is fixed when the whole
    app runs, so a timed rerun that finds it changed reruns the app (never a run a person started:
    that would drop what they clicked)."""
    need = max(REFRESH, round(1.5 * took + 0.5, 1))     # room to render, then to read it
    if need > EVERY or (EVERY > REFRESH and need < 0.5 * EVERY):
        st.session_state["refresh_every"] = need
    if timed and st.session_state["refresh_every"] != EVERY:
        st.rerun()


@st.fragment(run_every=EVERY)
def live() -> None:
    global _T0
    snap = _THIS_RUN.pop("snapshot", None)
    if snap is None:                        # a fragment rerun: time it from here, on a fresh snapshot
        _T0 = time.perf_counter()
    p = open_panels(filters(snap.f.start if snap else None), snap)
    if p.fx.unverified_note:
        st.error(p.fx.unverified_note + " (`kvledger verify` names the damage)", icon=":material/error:")
        if not ALLOW_UNVERIFIED:
            st.error("Refusing to show numbers from a store that does not verify, as every reader does. Start the "
                     "dashboard with `--allow-unverified` to see them under this banner.", icon=":material/block:")
            return
    state = st.empty()
    # where the n-gram evidence is still to be built (a first render with nothing kept: seconds at 100 M+
    # rows), the banner first says what the exposure index already knows, then becomes the whole one
    if (early := p.early()) is not None:
        p.prefetch(PROTECTION)
        with state.container():
            banner(p, early, p.protection(early=True))
        st.session_state["early_banner_s"] = time.perf_counter() - _T0     # (bench/dashboard.py reads it)
    # the banner's queries; while the evidence is built for them, those of the page that read none of it
    p.prefetch(BANNER if early is None else tuple(dict.fromkeys(BANNER + PAGE)))
    pr, t = p.protection(), p.totals()
    with state.container():
        banner(p, t, pr)
    tiles(t, pr)
    st.session_state["state_line_s"] = time.perf_counter() - _T0     # the state drawn (bench/dashboard.py reads it)
    p.prefetch()            # the sections' queries at once
    for name, section in SECTIONS.items():
        if view in ("all", name):
            section(p)
    took = time.perf_counter() - _T0
    st.caption(f"data as of {utcnow():%H:%M:%S} UTC - rendered in {took:.2f} s - next refresh in {EVERY:g} s")
    adapt_refresh(took, snap is None)


live()

st.subheader("Export")
if st.button("Build the disclosure report for this window", key="export"):
    import json

    from forensics.report import build, markdown
    from telemetry.errors import StoreError
    f = filters()
    try:        # built in memory: nothing is written beside the store
        rep = build(STORE, f.start, f.end, allow_unverified=ALLOW_UNVERIFIED, anchor=ANCHOR)
    except StoreError as e:
        st.error(f"No report: {e}", icon=":material/block:")
    else:
        st.download_button("report.md", markdown(rep), file_name="report.md", key="dl_md")
        st.download_button("report.json", json.dumps(rep, indent=2), file_name="report.json", key="dl_json")
        st.success(f"Report ready: {rep['counts']['affected_responses']} affected response(s).")
