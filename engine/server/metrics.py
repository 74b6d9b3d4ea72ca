"""Prometheus metrics for ``/metrics`` (names after Prometheus conventions: ``_total`` counters,
``_seconds`` and ``_tokens`` units). Tenants appear as store-keyed pseudonyms, never in clear.

Counted where the engine does the work: foreign reads by an observer of every node's step (the read
check's findings: ``served`` when the node lets the read through, ``blocked`` when it fails the
request), pool pages, guard checks and unexported spans by a collector that reads them at scrape time.
The alert rules in ``telemetry/prometheus/kvledger-alerts.yml`` are written against these names.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.semconv import TTFT_BUCKETS

disable_created_metrics()      # no *_created series: they double every counter's lines for nothing here
PROMPT_BUCKETS = (64, 256, 1024, 4096, 16384, 65536)
HEALTHY_MIN_TOKENS, FLOOR_SLACK = 32, 0.5     # as forensics/sql/ttft.sql: $min_tokens, $slack


def prompt_bucket(n: int) -> str:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return str(b)
    return "+Inf"


class ServerMetrics:
    def __init__(self, pseudonym, policy: str, guards: dict[str, bool], telemetry=None, side: str = "both"):
        """``side``: "both" (one process), or the families one side of ``kvledger serve`` counts:
        "http" (responses and rejections, in the HTTP process) or "engine" (the rest)."""
        self.registry = r = CollectorRegistry()
        self.pseudonym, self.policy, self.guards, self.tel = pseudonym, policy, guards, telemetry
        if side in ("both", "http"):     # counted by the HTTP handlers
            self.rejections = Counter("kvledger_rejections", "Requests refused, by reason and where",
                                      ["reason", "where"], registry=r)
            self.http = Counter("kvledger_http_responses", "HTTP responses by route and status", ["route", "status"],
                                registry=r)
            self.rate_limited = Counter("kvledger_rate_limited", "Requests refused by their tenant's rate limit "
                                        "(limit: requests, tokens, parallel_requests)", ["tenant", "limit"], registry=r)
        if side == "http":
            return
        self.requests = Counter("kvledger_requests", "Requests finished, by tenant and outcome",
                                ["tenant", "outcome"], registry=r)
        self.billed = Counter("kvledger_prompt_tokens_billed", "Prompt tokens billed (usage.prompt_tokens)",
                              ["tenant"], registry=r)
        self.prefilled = Counter("kvledger_prompt_tokens_prefilled", "Prompt tokens whose KV was computed",
                                 ["tenant"], registry=r)
        self.cached = Counter("kvledger_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                              ["tenant"], registry=r)
        self.completion = Counter("kvledger_completion_tokens", "Completion tokens returned", ["tenant"], registry=r)
        self.ttft = Histogram("kvledger_time_to_first_token_seconds", "Time to first token, by prompt length bucket",
                              ["prompt_tokens"], buckets=TTFT_BUCKETS, registry=r)
        self.below_floor = Counter("kvledger_ttft_below_floor", "Responses answered faster than their billed prompt "
                                   "can be prefilled (the floor from healthy traffic)", ["tenant"], registry=r)
        self.foreign = Counter("kvledger_foreign_reads", "Reader-steps that read KV slots of another request "
                               "(served: let through; blocked: the read check failed the request)",
                               ["node", "outcome"], registry=r)
        self.queue = Gauge("kvledger_queue_depth", "Requests admitted and not finished", registry=r)
        self.nodes: list = []
        self._floor = None                # fastest seconds per prefilled token seen on healthy traffic
        self._lock = threading.Lock()
        r.register(_Live(self))

    def observe_node(self, engine) -> None:
        """Count foreign reads from a node's own step (its read check's findings), on the engine thread."""
        self.nodes.append(engine)
        outcome = "blocked" if engine.cfg.fail_on_violation else "served"

        def observe(eng, out) -> None:
            if out.read_check is not None and out.read_check.any_failed is not False:
                n = int((out.read_check.bad_slots.sum(1) > 0).sum())
                if n:
                    self.foreign.labels(eng.cfg.node_id, outcome).inc(n)
        engine.observers.append(observe)
        # every series the alerts read exists from the start at 0: Prometheus' increase() sees no
        # rise in a series whose first sample is already non-zero, so a first exposure would not fire
        for o in ("served", "blocked"):
            self.foreign.labels(engine.cfg.node_id, o)

    def known_tenants(self, tenants) -> None:
        """Start each tenant's usage and TTFT-floor series at 0 (the tenants of the API keys file),
        so the first over-billed request of a tenant is an increase the alerts see."""
        for tenant in tenants:
            t = self.pseudonym(tenant)
            for c in (self.billed, self.prefilled, self.cached, self.completion, self.below_floor):
                c.labels(t)

    def refused(self, tenant: str, limit: str) -> None:
        self.rate_limited.labels(self.pseudonym(tenant), limit).inc()

    def finished(self, req, outcome: str) -> None:
        t = self.pseudonym(req.tenant)
        self.requests.labels(t, outcome).inc()
        if req.error is not None:          # refused, aborted or failed: no usage was reported, nothing billed
            return
        self.billed.labels(t).inc(req.prompt_tokens_billed)
        self.prefilled.labels(t).inc(req.prefilled_tokens)
        self.cached.labels(t).inc(req.cached_tokens)
        self.completion.labels(t).inc(len(req.output_ids))
        if req.ttft is None:
            return
        self.ttft.labels(prompt_bucket(req.prompt_tokens_billed)).observe(req.ttft)
        uncached = req.prompt_tokens_billed - req.cached_tokens
        with self._lock:
            healthy = req.prompt_tokens_billed <= req.prefilled_tokens + req.cached_tokens
            if healthy and req.prefilled_tokens >= HEALTHY_MIN_TOKENS:
                rate = req.ttft / req.prefilled_tokens
                self._floor = rate if self._floor is None else min(self._floor, rate)
            if self._floor is not None and req.ttft < self._floor * uncached * FLOOR_SLACK:
                self.below_floor.labels(t).inc()


class _Live:
    """Read at scrape time: pool pages and capacity per node, guard switches and checks, spans not exported."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        pages = GaugeMetricFamily("kvledger_pool_pages", "KV pool pages by state", labels=["node", "state"])
        cap = GaugeMetricFamily("kvledger_pool_capacity_tokens", "KV pool capacity in tokens", labels=["node"])
        ctx = GaugeMetricFamily("kvledger_context_length_tokens", "Context length the node serves",
                                labels=["node"])
        for n in self.m.nodes:
            node = n.cfg.node_id
            free = n.allocator.num_free
            pages.add_metric([node, "free"], free)
            pages.add_metric([node, "used"], n.allocator.total - free)
            cap.add_metric([node], n.pool.capacity_tokens)
            ctx.add_metric([node], n.cfg.context_length)
        yield from (pages, cap, ctx)
        on = GaugeMetricFamily("kvledger_guard_enabled", "1 when the guard is on", labels=["guard", "policy"])
        for g, v in self.m.guards.items():
            on.add_metric([g, self.m.policy], 1 if v else 0)
        yield on
        checks = CounterMetricFamily("kvledger_guard_checks", "Checks each guard ran, by result",
                                     labels=["node", "guard", "result"])
        tel = self.m.tel
        if tel is not None:
            for node, tally in tel.guard_tallies().items():
                for (g, res), n in tally.items():
                    checks.add_metric([node, g, res], n)
        yield checks
        dropped = GaugeMetricFamily("kvledger_telemetry_spans_unexported", "Spans ended and not (yet) in the store: "
                                    "a few in flight; growing without bound means spans are dropped")
        dropped.add_metric([], tel.spans_unexported if tel is not None else 0)
        yield dropped
        up = GaugeMetricFamily("kvledger_store_writer_up", "1 while the store writer takes rows; 0 once it failed "
                               "(a full disk, a read-only mount): spans and the page ledger are then not recorded")
        writer = getattr(tel, "writer", None)
        up.add_metric([], 0 if writer is not None and writer.error is not None else 1)
        yield up
