"""``kvledger collect``'s own ``/metrics``: is the collector itself receiving, writing and
scraping? Read at scrape time from the receivers' counters (prometheus_client's custom-collector
form), so the shipped alerts (``KvledgerStoreWriterFailing``, ``KvledgerKVEventsLost``,
``KvledgerFleetScrapeFailing``) can say when telemetry is being lost - missing data is not a clean
bill, and an on-call view that cannot see it would be green over a hole."""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class CollectHealth:
    def __init__(self, writer, received: dict, subscribers=(), scrapers=(), grpc_counts: dict | None = None):
        self.writer, self.received, self.subs, self.scrapers = writer, received, list(subscribers), list(scrapers)
        self.grpc = grpc_counts

    def collect(self):
        up = GaugeMetricFamily("kvledger_store_writer_up", "1 while the store writer takes rows; 0 once it failed "
                               "(a full disk, a read-only mount)")
        up.add_metric([], 0 if self.writer.error is not None else 1)
        yield up
        got = CounterMetricFamily("kvledger_collect_received", "OTLP items written, by signal and protocol",
                                  labels=["signal", "protocol"])
        refused = CounterMetricFamily("kvledger_collect_refused", "OTLP bodies refused, by reason (bad_body: "
                                      "unreadable or over a limit; throttled: store behind; store_failed)",
                                      labels=["reason"])
        got.add_metric(["spans", "http"], self.received.get("spans", 0))
        got.add_metric(["points", "http"], self.received.get("points", 0))
        if self.grpc is not None:
            got.add_metric(["spans", "grpc"], self.grpc.get("spans", 0))
            got.add_metric(["points", "grpc"], self.grpc.get("points", 0))
        for reason, key in (("bad_body", "refused_bodies"), ("throttled", "throttled"), ("store_failed", "store_failed")):
            refused.add_metric([reason], self.received.get(key, 0) + (self.grpc or {}).get(key, 0))
        yield from (got, refused)
        lost = CounterMetricFamily("kvledger_kv_event_batches_lost", "KV event batches in sequence gaps the "
                                   "publisher's replay socket did not fill", labels=["source"])
        gaps = CounterMetricFamily("kvledger_kv_event_gaps", "Sequence gaps seen, filled or not", labels=["source"])
        batches = CounterMetricFamily("kvledger_kv_event_batches", "KV event batches received", labels=["source"])
        for s in self.subs:
            lost.add_metric([s.instance], sum(last - first + 1 for first, last, filled in s.gaps if not filled))
            gaps.add_metric([s.instance], len(s.gaps))
            batches.add_metric([s.instance], s.batches)
        yield from (lost, gaps, batches)
        target = GaugeMetricFamily("kvledger_scrape_target_up", "1 when collect's last scrape of the engine's "
                                   "/metrics succeeded", labels=["target"])
        fails = CounterMetricFamily("kvledger_scrape_failures", "Failed scrapes of the engine's /metrics",
                                    labels=["target"])
        for s in self.scrapers:
            target.add_metric([s.instance], 1 if s.last_ok else 0)
            fails.add_metric([s.instance], s.failures)
        yield from (target, fails)


def registry(health: CollectHealth) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(health)
    return r
