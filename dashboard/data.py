"""What each dashboard panel shows, as polars DataFrames from the same named queries that
``kvledger forensics`` runs (so every number on a panel equals the CLI's for the same window).
Filters (tenant, node, policy) narrow the query results; they never change the SQL."""
from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from forensics.queries import open_forensics
from forensics.queries.fleet import fleet_requests, fleet_tenants
from telemetry.store.chain import HashCache


@dataclass(frozen=True, slots=True)
class Filters:
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    tenant: str | None = None        # a tenant pseudonym (recipient or donor side)
    node: str | None = None
    policy: str | None = None


@dataclass(frozen=True, slots=True)
class Protection:
    """The live protection state of the latest run, apart from what has been exposed so far: an
    unprotected server is red before its first leak. ``state``: red (read check off, a pool below
    the context it serves, a guard off, or an unverified store), amber (degraded: telemetry lost,
    no page ledger, a guard on that never ran on traffic, no kvledger engine in the store), green
    (protected and clean)."""
    state: str
    reasons: tuple[str, ...]
    boot: str | None                         # the latest run
    last_foreign_read: dt.datetime | None    # the last read of another request's KV, any run (UTC)
    recent: dict[int, int]                   # minutes -> responses reading it in the last that many
    ongoing: bool                            # the last foreign read is recent (ONGOING)


ONGOING = dt.timedelta(minutes=5)           # a foreign read newer than this: exposure "ongoing"


def guard_switches(run: pl.DataFrame) -> pl.DataFrame:
    """One row per (node row, guard): ``_row``, ``node``, ``guard``, ``on`` - from a preflight frame
    whose ``guards`` is a map (a list of key/value structs, as DuckDB gives it) or a struct."""
    if isinstance(run.schema["guards"], pl.Struct):
        g = run.select("_row", "node", pl.col("guards").struct.unnest()).unpivot(index=["_row", "node"],
                                                                               variable_name="key", value_name="value")
    else:           # a map (polars' Map) or already its list of key/value structs
        dt_ = run.schema["guards"]
        col = pl.col("guards")
        if not isinstance(dt_, pl.List):
            col = col.cast(pl.List(pl.Struct({"key": getattr(dt_, "key", pl.String), "value": getattr(dt_, "value", pl.Boolean)})))
        g = run.select("_row", "node", col).explode("guards").unnest("guards")
    return (g.drop_nulls("key").select("_row", "node", guard=pl.col("key"), on=pl.col("value").fill_null(False)
                                       .cast(pl.Boolean)))


def _tenant_counts(real: pl.DataFrame) -> dict[str, int]:
    """Recipient and donor tenants of the pairs that read another request's KV (``real``: no
    unwritten slot, not blocked): cross-tenant only, as in the report."""
    cross = real.filter(~pl.col("same_tenant"))
    return {"recipient_tenants": cross["response_tenant"].n_unique() if cross.height else 0,
            "donor_tenants": cross["donor_tenant"].drop_nulls().n_unique() if cross.height else 0}


def _listed(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# what this dashboard process has verified (segment hashes, signatures, anchor lines), per store:
# verify's cache, kept on disk too (telemetry.store.chain.HashCache: a restarted dashboard does not
# hash a 100 M-row store's segments again - ~25 s at 110 M rows on this 2-core machine)
VERIFIED: dict[str, HashCache] = {}


def verified(store: str | Path) -> HashCache:
    """This process's verification cache of the store at this path (loaded from disk once)."""
    key = str(Path(store).resolve())
    if key not in VERIFIED:
        VERIFIED[key] = HashCache(store)
    return VERIFIED[key]

# the queries the state line (banner and tiles) needs: run first, so the page's state is drawn
# before the sections' own queries run; PROTECTION: those of them that need no n-gram evidence
PROTECTION = ("served", "guards", "preflight", "gaps")
BANNER = ("exposures", "scores", *PROTECTION)
# set at the first page load (script run) in this process: the server's warm-up (dashboard/serve.py)
# then leaves the page's named queries to the page rather than run them beside it
page_loaded = threading.Event()
# the named queries one dashboard page runs
PAGE = ("exposures", "scores", "tenants", "ttft", "transfers", "releases", "guards", "preflight", "probes",
        "fleet_ttft", "fleet_impact", "canary", "gaps")

# queries whose rows the page orders itself, and only the rows it shows: run without their closing
# ORDER BY (forensics.queries.base.without_order). Their orders, where the page needs one:
# TRANSFER_ORDER the rows of the transfers table (integrity_section), ttft's dishonest rows in
# usage_honesty(). At 121 M read rows each returns 391 K rows, and sorting them was about half of
# each query (one-off: ttft 0.23 -> 0.12 s, transfers 0.15 -> 0.05 s)
UNORDERED = ("ttft", "transfers")
TRANSFER_ORDER = ["ts_submit", "transfer_id", "incarnation"]     # transfers.sql's own
# the TTFT chart's points in one order whatever order ttft's rows came in (chart_points)
DRAW_ORDER = ["incarnation", "service_ttft_s", "prompt_tokens_billed", "prompt_tokens_prefilled", "tenant_h"]

# Severity tiers of an affected response, most severe first: what the on-call engineer does about it.
# The raw exposure score still ranks responses inside a tier.
TIERS = {
    "critical": "another customer's prompt text appeared in the response's output: notify both tenants now",
    "high": "the response attended over another customer's KV: notify both tenants",
    "medium": "it read KV of its own tenant's other requests only: tell that tenant; no other customer involved",
    "low": "it read KV slots nobody wrote: no one's data left; an integrity fault to fix",
}


def first_rows(df: pl.DataFrame, limit: int, red: str | None = None, order: list[str] | None = None) -> pl.DataFrame:
    """The rows a table shows: at most ``limit``, those where column ``red`` is true first. ``order``:
    ``df``'s rows are in no set order (an UNORDERED query's) - both parts are taken by these columns
    ascending, nulls last, as the query's ORDER BY had them, each picked without sorting the whole
    frame (bottom_k); without it, ``df``'s own order (a stable sort on ``red`` alone)."""
    if order is None:
        if red is not None and df.height:
            df = df.sort(red, descending=True, maintain_order=True)
        return df.head(limit)
    picked: list[pl.DataFrame] = []
    for part in ([df.filter(pl.col(red)), df.filter(~pl.col(red))] if red is not None and df.height else [df]):
        k = limit - sum(p.height for p in picked)
        if k > 0 and part.height:
            picked.append((part if part.height <= k else part.bottom_k(k, by=order)).sort(order, nulls_last=True))
    return pl.concat(picked) if picked else df.head(0)


def chart_points(tt: pl.DataFrame, limit: int) -> tuple[pl.DataFrame, int]:
    """The TTFT chart's points from ttft's rows: every anomaly (under the TTFT floor or billed for
    more prompt than prefilled), and at most ``limit`` healthy requests - those of least hash of
    their incarnation, so the same ones whatever order the rows came in (ttft is UNORDERED) - in
    one drawing order (DRAW_ORDER, anomalies last: on top); and how many healthy requests there were."""
    pts = tt.select("incarnation", "tenant_h", "prompt_tokens_billed", "prompt_tokens_prefilled", "service_ttft_s",
                    "ttft_floor_s", anomaly=pl.col("below_floor") | pl.col("usage_dishonest"),
                    uncached=pl.col("prompt_tokens_billed") - pl.col("prompt_tokens_cached"))
    healthy = pts.filter(~pl.col("anomaly"))
    if healthy.height > limit:
        # the sample's rows all lie at or under the limit-th least hash: picked by the hash alone
        # first, the six-key pick then runs over those few (this function at 391 K rows 22-54 ->
        # 12-20 ms, one-off, 3 calls each: the six-key pick over every row was 14-26 ms of it)
        h = healthy.select(pl.col("incarnation").hash(seed=0)).to_series()
        few = healthy.filter(h <= h.bottom_k(limit).max())
        pts = pl.concat([pts.filter(pl.col("anomaly")),
                         few.bottom_k(limit, by=[pl.col("incarnation").hash(seed=0), *DRAW_ORDER])])
    return pts.sort("anomaly", *DRAW_ORDER, nulls_last=True), healthy.height


class Panels:
    """One snapshot of the store (re-open it to see newer segments)."""

    def __init__(self, store: str | Path, f: Filters = Filters(), same_snapshot_as: "Panels | None" = None,
                 engine: dict | None = None, run: str | None = None, anchor: str | None = None):
        """same_snapshot_as: share that Panels' snapshot and query results (one script run opens
        the store once; filters other than the window apply afterwards, in polars). engine:
        open_forensics's engine arguments (default DuckDB; the app takes them from KVLEDGER_ENGINE,
        KVLEDGER_DSN)."""
        self.f = f
        if same_snapshot_as is None:
            # verified on every snapshot, incrementally (segments already hashed are not hashed again);
            # a store that does not verify is still shown, under the banner unverified_note names
            self.fx, self._memo = open_forensics(store, run, allow_unverified=True, cache=verified(store), anchor=anchor,
                                                 **(engine or {})), {}
        else:
            self.fx, self._memo = same_snapshot_as.fx, same_snapshot_as._memo

    def _q(self, name: str, whole: bool = False) -> pl.DataFrame:
        """A named query over this snapshot and window (``whole``: the whole store), run once
        (panels share results: scores need the exposures, usage honesty the TTFT rows, node names
        the preflight)."""
        start, end = (None, None) if whole else (self.f.start, self.f.end)
        key = (name, start, end)
        if key not in self._memo:
            self._memo[key] = self.fx.queries([name], start, end, workers=1, unordered=UNORDERED)[name]
        return self._memo[key]

    def prefetch(self, names: tuple[str, ...] = PAGE) -> None:
        """Run the page's queries for this window at once (side by side, one cursor each) so the
        panels read results instead of waiting on each query in turn."""
        todo = [n for n in names if (n, self.f.start, self.f.end) not in self._memo]
        if todo:
            for n, df in self.fx.queries(todo, self.f.start, self.f.end, unordered=UNORDERED).items():
                self._memo[(n, self.f.start, self.f.end)] = df

    def _tenant(self, df: pl.DataFrame, *cols: str) -> pl.DataFrame:
        if self.f.tenant is None or df.is_empty():
            return df
        return df.filter(pl.any_horizontal([pl.col(c) == self.f.tenant for c in cols]))

    def _node(self, df: pl.DataFrame, col: str) -> pl.DataFrame:
        return df if self.f.node is None or df.is_empty() else df.filter(pl.col(col) == self.f.node)

    def nodes_in_policy(self) -> set[str] | None:
        if self.f.policy is None:
            return None
        pre = self._q("preflight")
        return set(pre.filter(pl.col("policy") == self.f.policy)["node"])

    # ---- panels ------------------------------------------------------------------------------------
    def exposures(self) -> pl.DataFrame:
        df = self._tenant(self._q("exposures"), "response_tenant", "donor_tenant")
        keep = self.nodes_in_policy()
        if self.f.node is not None or keep is not None:
            nodes = {self.f.node} if self.f.node else keep
            if self.f.node and keep is not None:
                nodes &= keep
            df = df.filter(pl.col("node_pages").list.eval(pl.element().str.split(":").list.first().is_in(list(nodes)))
                           .list.any())
        return df

    def scores(self) -> pl.DataFrame:
        """The affected responses with their severity tier (TIERS), most severe first, then by score."""
        ex = self.exposures()
        sc = self._q("scores").filter(pl.col("response").is_in(ex["response"].unique().to_list()))
        real = ex.filter(pl.col("evidence") != "blocked")
        other = (pl.col("donor") != -1) & ~pl.col("same_tenant")
        per = real.group_by("response").agg(
            crit=(other & (pl.col("evidence") == "surfaced")).any(), cross=other.any(),
            own=((pl.col("donor") != -1) & pl.col("same_tenant")).any())
        tier = (pl.when(pl.col("crit")).then(pl.lit("critical")).when(pl.col("cross")).then(pl.lit("high"))
                .when(pl.col("own")).then(pl.lit("medium")).otherwise(pl.lit("low")))
        rank = {t: i for i, t in enumerate(TIERS)}
        out = sc.join(per.select("response", tier=tier), on="response", how="left")
        return (out.with_columns(_rank=pl.col("tier").replace_strict(rank, default=len(rank)))
                .sort(["_rank", "score"], descending=[False, True], maintain_order=True).drop("_rank")
                .select("response", "tier", *[c for c in sc.columns if c != "response"]))

    def totals(self) -> dict[str, int]:
        ex, sc = self.exposures(), self.scores()
        real = ex.filter((pl.col("donor") != -1) & (pl.col("evidence") != "blocked"))
        tiers = {f"{t}_responses": int((sc["tier"] == t).sum()) if sc.height else 0 for t in TIERS}
        return {"affected_responses": sc.height,
                "surfaced_responses": int(sc["surfaced"].sum()) if sc.height else 0,
                "foreign_tokens": int(real["foreign_tokens"].sum()) if real.height else 0,
                **_tenant_counts(real), "exposure_score": int(sc["score"].sum()) if sc.height else 0,
                **tiers, "cross_responses": tiers["critical_responses"] + tiers["high_responses"]}

    def _early(self, whole: bool = False) -> pl.DataFrame | None:
        """early_pairs over this window (``whole``: the whole store), run once."""
        start, end = (None, None) if whole else (self.f.start, self.f.end)
        key = ("early_pairs", start, end)
        if key not in self._memo:
            self._memo[key] = self.fx.early_pairs(start, end)
        return self._memo[key]

    def early(self) -> dict[str, int] | None:
        """What the banner can say before the n-gram evidence is built - a first render with nothing
        kept spends seconds on it at 100 M+ rows, and all else the banner needs a fraction of one:
        totals' affected responses, responses that read another customer's KV (``cross_responses``:
        critical and high together - the evidence is what tells them apart) and tenant counts, the
        same numbers totals() gives once it is built (tests/test_dashboard.py). None where the
        evidence is at hand already or the engine cannot say it earlier: the banner waits for totals."""
        if not self.fx.evidence_pending() or (ex := self._early()) is None:
            return None
        ex = self._tenant(ex, "response_tenant", "donor_tenant")
        keep = self.nodes_in_policy()
        if self.f.node is not None or keep is not None:
            nodes = {self.f.node} if self.f.node else keep
            if self.f.node and keep is not None:
                nodes &= keep
            ex = ex.filter(pl.col("nodes").list.eval(pl.element().is_in(list(nodes))).list.any())
        live = ex.filter(~pl.col("blocked"))
        real = live.filter(pl.col("donor") != -1)
        cross = real.filter(~pl.col("same_tenant"))
        return {"affected_responses": live["response"].n_unique(), "cross_responses": cross["response"].n_unique(),
                **_tenant_counts(real)}

    def gaps(self) -> pl.DataFrame:
        """Telemetry the collector knows it lost and could not fill: missing data, not a clean bill."""
        g = self._q("gaps")
        return g.filter(~pl.col("filled")) if g.height else g

    def score_over_time(self, every: str = "1s") -> pl.DataFrame:
        sc = self.scores()
        if sc.is_empty():
            return pl.DataFrame({"time": [], "score": [], "cumulative_score": []},
                                schema={"time": pl.Datetime("ns"), "score": pl.Int64, "cumulative_score": pl.Int64})
        return (sc.sort("first_read").group_by_dynamic("first_read", every=every).agg(pl.col("score").sum())
                .rename({"first_read": "time"}).with_columns(cumulative_score=pl.col("score").cum_sum()))

    def drill_down(self, response: int) -> pl.DataFrame:
        return self.exposures().filter(pl.col("response") == response).select(
            "donor", "donor_tenant", "kinds", "evidence", "shared_ngrams", "pages", "node_pages", "foreign_tokens",
            "attention_mass", "first_step", "last_step")

    def tenant_matrix(self) -> pl.DataFrame:
        """Donor -> recipient tenants, cross-tenant only: a tenant's own requests reading each other's
        KV is not another customer's data (same_tenant_reads() has those)."""
        tm = self._tenant(self._q("tenants"), "donor_tenant", "recipient_tenant")
        return tm.filter((pl.col("donor_kind") == "tenant") & ~pl.col("same_tenant")) if tm.height else tm

    def same_tenant_reads(self) -> pl.DataFrame:
        tm = self._tenant(self._q("tenants"), "donor_tenant", "recipient_tenant")
        return tm.filter((pl.col("donor_kind") == "tenant") & pl.col("same_tenant")) if tm.height else tm

    def not_a_tenant_reads(self) -> pl.DataFrame:
        """Reads of slots that are no tenant's: unwritten (nobody's data), or written by a request
        whose row is not in the store yet (unrecorded: still running, or cut off)."""
        tm = self._tenant(self._q("tenants"), "recipient_tenant")
        return tm.filter(pl.col("donor_kind") != "tenant") if tm.height else tm

    def ttft(self) -> pl.DataFrame:
        """ttft.sql's rows of this window and filters, in no set order (UNORDERED)."""
        return self._node(self._tenant(self._q("ttft"), "tenant_h"), "node")

    def usage_honesty(self) -> pl.DataFrame:
        """The requests billed for more prompt than they prefilled, in ttft.sql's order (under the
        floor first, then by arrival)."""
        return self.ttft().filter(pl.col("usage_dishonest")).sort(
            ["below_floor", "arrived_at", "incarnation"], descending=[True, False, False], nulls_last=True).select(
            "incarnation", "tenant_h", "prompt_tokens_billed", "prompt_tokens_prefilled", "prompt_tokens_cached",
            "ttft_s", "arrived_at")

    def transfers(self) -> pl.DataFrame:
        """transfers.sql's rows of this window and node, in no set order (UNORDERED: TRANSFER_ORDER
        is theirs)."""
        df = self._q("transfers")
        if self.f.node is not None and not df.is_empty():
            df = df.filter((pl.col("src_node") == self.f.node) | (pl.col("dst_node") == self.f.node))
        return df

    def releases(self) -> pl.DataFrame:
        return self._node(self._q("releases"), "node")

    def guards(self) -> pl.DataFrame:
        return self._q("guards")

    def fleet(self) -> tuple[pl.DataFrame, pl.DataFrame, bool]:
        """Foreign engines' requests flagged over their pool or under their TTFT floor, their
        detector lines, and whether this store has any page ledger at all."""
        ttft, impact = self._q("fleet_ttft"), self._q("fleet_impact")
        over = set(impact["request_id"].to_list())
        flagged = ttft.filter(pl.col("below_floor") | pl.col("request_id").is_in(list(over))).select(
            "instance", "request_id", "prompt_tokens_billed", "ttft_s", "ttft_floor_s", "below_floor",
            over_pool=pl.col("request_id").is_in(list(over)))
        ledger = self.fx.rows("page_reads") > 0
        return flagged, self._q("canary"), ledger

    def fleet_requests(self) -> pl.DataFrame:
        """Every foreign request span of the window with its flags (the TTFT chart's points)."""
        return self._tenant(fleet_requests(self._q("fleet_ttft"), self._q("fleet_impact")), "tenant_h")

    def fleet_tenants(self) -> pl.DataFrame:
        """forensics.queries.fleet.fleet_tenants over this window and tenant filter."""
        r = self.fleet_requests()
        return fleet_tenants(r.drop("over_pool"), r.filter(pl.col("over_pool")))

    def probes(self) -> pl.DataFrame:
        """External probe runs recorded in the store (not windowed: a probe is a test, not traffic)."""
        return self._q("probes")

    def preflight(self) -> pl.DataFrame:
        df = self._node(self._q("preflight"), "node")
        return df if self.f.policy is None else df.filter(pl.col("policy") == self.f.policy)

    def protection(self, now: dt.datetime | None = None, early: bool = False) -> Protection:
        """The latest run's protection state and the exposure clock (never windowed: a window that
        shows nothing does not make an unprotected server safe); ``early``: the clock from early_pairs
        (the same reads, before the n-gram evidence is built - see early())."""
        from forensics.window import utcnow
        now = now or utcnow()
        red, amber = [], []
        if self.fx.unverified_note:
            red.append("the store does not verify")
        pre = self._q("preflight")
        boot = None
        if pre.is_empty():
            amber.append("no kvledger engine has written this store: its protection is unknown")
        else:
            boot = pre.sort("snapshot_at")["boot"][-1]
            run = pre.filter(pl.col("boot") == boot).with_row_index("_row")
            # in columns: a fleet's latest run has a row per node (thousands), never a Python loop over them
            g = guard_switches(run)
            checked = set(g.filter((pl.col("guard") == "read_check") & pl.col("on"))["_row"].to_list())
            no_check = run.filter(~pl.col("_row").is_in(list(checked)))["node"].to_list()
            small = (run.filter(pl.col("served_context") > pl.col("pool_tokens"))
                     .select(pl.format("{} ({} < {} tokens)", "node", "pool_tokens", "served_context"))
                     .to_series().to_list())
            off = {k: v for k, v in g.filter(~pl.col("on") & (pl.col("guard") != "read_check"))
                   .group_by("guard", maintain_order=True).agg(pl.col("node")).iter_rows()}
            if no_check:
                red.append(f"read check off on {_listed(no_check)}")
            if small:
                red.append(f"KV pool smaller than the context it serves on {_listed(small)}")
            if off:
                red.append(f"{len(off)} guard(s) off ({_listed(sorted(off), 4)})")
            if not self.fx.rows("page_reads") and not self.fx.rows("page_writes"):
                amber.append("no page ledger: who read whose KV cannot be established")
            g = self._q("guards")
            served = int(self._q("served")["served"][0]) if not pre.is_empty() else 0    # = ttft's rows
            idle = g.filter(pl.col("idle_but_on"))["guard"].to_list() if g.height and served else []
            if idle:
                amber.append(f"guard(s) on but never run on {served} request(s): {', '.join(idle[:3])}")
        gaps = self._q("gaps", whole=True)
        lost = gaps.filter(~pl.col("filled")) if gaps.height else gaps
        if lost.height:
            amber.append(f"telemetry lost: {int(lost['items'].sum())} item(s) in {lost.height} gap(s)")
        if early and (ex := self._early(whole=True)) is not None:
            real = ex.filter((pl.col("donor") != -1) & ~pl.col("blocked"))
        else:
            ex = self._q("exposures", whole=True)
            real = ex.filter((pl.col("donor") != -1) & (pl.col("evidence") != "blocked")) if ex.height else ex
        last = real["last_read"].max() if real.height else None
        recent = {m: real.filter(pl.col("last_read") >= now - dt.timedelta(minutes=m))["response"].n_unique()
                  if real.height else 0 for m in (5, 60)}
        state = "red" if red else "amber" if amber else "green"
        return Protection(state, tuple(red + amber), boot, last, recent,
                          last is not None and now - last <= ONGOING)

    def tenants(self) -> list[str]:
        return self.fx.tenant_names()

    def node_names(self) -> list[str]:
        return sorted(self._q("preflight")["node"].to_list())

    def time_range(self) -> tuple[dt.datetime | None, dt.datetime | None]:
        r = self.fx.requests()
        return (r["arrived_at"].min(), r["finished_at"].max()) if r.height else (None, None)
