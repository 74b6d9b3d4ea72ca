"""OpenTelemetry for the engine: one TracerProvider and MeterProvider per node (``NodeTelemetry``),
spans and metric points exported into the store. The recorder that drives them is
``telemetry/recorder.py`` (``Telemetry``).

One trace per request incarnation: a root span ``{operation} {model}`` opened when the request
arrives (its trace and span ids go on every ledger row of that request) with children
``admission``, ``prefill`` (on the prefill node in disaggregated mode), ``kv_transfer`` and
``decode``, all in the same trace across nodes. Attributes follow the OpenTelemetry GenAI
semantic conventions pinned below (all still "development"); everything else is ``kvledger.*``.

Spans go through a ``BatchSpanProcessor`` (queue sized by ``span_queue_size``) to
``StoreSpanExporter``; the SDK drops spans silently when that queue is full, so spans ended and
spans exported are both counted and ``spans_dropped`` is exposed (and the SDK's own
``otel.sdk.processor.span.processed{error.type=queue_full}`` metric lands in the store).
With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) set and the optional exporter
installed (``pip install kvledger[otlp]``), spans also go to that collector.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Sequence

import pyarrow as pa
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (HistogramDataPoint, MetricExporter, MetricExportResult,
                                              MetricsData, NumberDataPoint, PeriodicExportingMetricReader)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GA
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE

from engine.semconv import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS  # noqa: F401 (tests read them here)
from telemetry.store import SegmentWriter
from telemetry.store.schema import arrow_schemas, collector_span_columns

SPAN_EXPORT_DELAY_MS = 500
SEMCONV_VERSION = "0.66b2"          # opentelemetry-semantic-conventions the attribute names come from
SCHEMA_URL = "https://opentelemetry.io/schemas/1.40.0"
PROVIDER = "kvledger"
OPERATION = "text_completion"
log = logging.getLogger("kvledger.telemetry")

_PROMOTED = {"kvledger.incarnation": "incarnation", "kvledger.node": "node", "kvledger.operation": "operation",
             "kvledger.tenant": "tenant_h", "kvledger.cache_scope": "scope_h",
             GA.GEN_AI_USAGE_INPUT_TOKENS: "input_tokens", "kvledger.prompt_tokens.prefilled": "prefilled_tokens",
             "gen_ai.usage.cache_read.input_tokens": "cached_tokens", GA.GEN_AI_USAGE_OUTPUT_TOKENS: "output_tokens",
             "kvledger.time_to_first_token": "ttft_s", GA.GEN_AI_RESPONSE_FINISH_REASONS: "finish_reason",
             ERROR_TYPE: "error_type", "kvledger.rejection.where": "rejected_at", "gen_ai.response.id": "request_id"}


def _s(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


class StoreSpanExporter(SpanExporter):
    """Spans -> the ``spans`` table (columns after the Collector's ClickHouse exporter)."""

    def __init__(self, writer: SegmentWriter):
        self.writer, self.exported = writer, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.writer.accepting:   # closed (an SDK thread restarted in a forked child) or failed: not exported
            return SpanExportResult.FAILURE
        cols: dict[str, list] = {k: [] for k in (*collector_span_columns(), *_PROMOTED.values())}
        resources: dict[int, tuple[str, list]] = {}      # a provider's resource: the same for all its spans
        promoted = [(key, cols[col].append) for key, col in _PROMOTED.items()]
        for sp in spans:
            a, ctx, scope, status = sp.attributes or {}, sp.context, sp.instrumentation_scope, sp.status
            res = resources.get(id(sp.resource))
            if res is None:
                ra = sp.resource.attributes
                res = resources[id(sp.resource)] = (str(ra.get("service.name", "")), [(k, _s(v)) for k, v in ra.items()])
            events, links = sp.events, sp.links
            cols["Timestamp"].append(sp.start_time)
            cols["TraceId"].append(f"{ctx.trace_id:032x}")
            cols["SpanId"].append(f"{ctx.span_id:016x}")
            cols["ParentSpanId"].append(f"{sp.parent.span_id:016x}" if sp.parent else "")
            cols["TraceState"].append(str(ctx.trace_state.to_header()))
            cols["SpanName"].append(sp.name)
            cols["SpanKind"].append(sp.kind.name)
            cols["ServiceName"].append(res[0])
            cols["ResourceAttributes"].append(res[1])
            cols["ScopeName"].append(scope.name if scope else "")
            cols["ScopeVersion"].append((scope.version or "") if scope else "")
            cols["SpanAttributes"].append([(k, _s(v)) for k, v in a.items()])
            cols["Duration"].append(sp.end_time - sp.start_time)
            cols["StatusCode"].append(status.status_code.name)
            cols["StatusMessage"].append(status.description or "")
            cols["Events.Timestamp"].append([e.timestamp for e in events])
            cols["Events.Name"].append([e.name for e in events])
            cols["Links.TraceId"].append([f"{ln.context.trace_id:032x}" for ln in links])
            cols["Links.SpanId"].append([f"{ln.context.span_id:016x}" for ln in links])
            for key, append in promoted:
                v = a.get(key)
                append(_s(v) if isinstance(v, (list, tuple)) else v)
        schema = arrow_schemas()["spans"]
        self.writer.submit("spans", pa.table({k: pa.array(v, schema.field(k).type) for k, v in cols.items()}))
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class StoreMetricExporter(MetricExporter):
    """Metric points -> the ``metrics`` table (cumulative temporality)."""

    def __init__(self, writer: SegmentWriter, node: str):
        super().__init__()
        self.writer, self.node = writer, node

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if not self.writer.accepting:
            return MetricExportResult.FAILURE
        rows: dict[str, list] = {k: [] for k in ("ts", "node", "name", "kind", "attributes", "value", "count", "sum",
                                                 "bucket_counts", "boundaries")}
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        hist = isinstance(p, HistogramDataPoint)
                        rows["ts"].append(p.time_unix_nano)
                        rows["node"].append(self.node)
                        rows["name"].append(m.name)
                        rows["kind"].append("histogram" if hist else type(m.data).__name__.lower())
                        rows["attributes"].append([(k, _s(v)) for k, v in (p.attributes or {}).items()])
                        rows["value"].append(float(p.value) if isinstance(p, NumberDataPoint) else None)
                        rows["count"].append(p.count if hist else None)
                        rows["sum"].append(float(p.sum) if hist else None)
                        rows["bucket_counts"].append(list(p.bucket_counts) if hist else None)
                        rows["boundaries"].append(list(p.explicit_bounds) if hist else None)
        if rows["ts"]:
            self.writer.submit("metrics", pa.table({
                **{k: v for k, v in rows.items() if k not in ("ts", "attributes")},
                "ts": pa.array(rows["ts"], pa.timestamp("ns")),
                "attributes": pa.array(rows["attributes"], pa.map_(pa.string(), pa.string()))}))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


class _EndedCounter(SpanProcessor):
    def __init__(self):
        self.ended = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.ended += 1


def otlp_processor() -> SpanProcessor | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_*ENDPOINT is set but the OTLP exporter is not installed "
                    "(pip install 'kvledger[otlp]'); spans go to the store only")
        return None
    return BatchSpanProcessor(OTLPSpanExporter())   # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_*


class NodeTelemetry:
    """One node's OpenTelemetry: its tracer and meter providers (resource: node, boot, role), the
    span exporter into the store, and the GenAI histograms and kvledger counters it records."""

    def __init__(self, tel, engine):
        node = engine.cfg.node_id
        res = Resource.create({"service.name": tel.service, "service.instance.id": f"{node}@{tel.boot}",
                               "kvledger.node": node, "kvledger.boot": tel.boot, "kvledger.role": engine.cfg.role})
        self.metric_reader = PeriodicExportingMetricReader(StoreMetricExporter(tel.writer, node),
                                                           export_interval_millis=tel.metric_interval * 1e3)
        self.meters = MeterProvider(resource=res, metric_readers=[self.metric_reader])
        self.tracers = TracerProvider(resource=res)
        self.ended = _EndedCounter()
        self.exporter = StoreSpanExporter(tel.writer)
        self.tracers.add_span_processor(self.ended)
        # the SDK's own queue metrics (otel.sdk.processor.span.processed{error.type=queue_full}) are
        # behind this switch; on unless the operator set it
        os.environ.setdefault("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
        # spans leave the SDK's queue every 0.5 s (its default, 5 s, would make them lag the page ledger
        # by that much more after a kill -9: a request's rows durable, its span not)
        self.tracers.add_span_processor(BatchSpanProcessor(
            self.exporter, max_queue_size=tel.span_queue_size, max_export_batch_size=min(512, tel.span_queue_size),
            schedule_delay_millis=SPAN_EXPORT_DELAY_MS, meter_provider=self.meters))
        if (otlp := otlp_processor()) is not None:
            self.tracers.add_span_processor(otlp)
        self.tracer = self.tracers.get_tracer("kvledger", tel.version, schema_url=SCHEMA_URL)
        m = self.meters.get_meter("kvledger", tel.version, schema_url=SCHEMA_URL)
        self.ttft = m.create_histogram("gen_ai.server.time_to_first_token", "s", "Time to generate first token",
                                       explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = m.create_histogram("gen_ai.server.time_per_output_token", "s",
                                       "Time per output token after the first", explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = m.create_histogram("gen_ai.server.request.duration", "s", "Generative AI server request duration",
                                           explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        # guards run every step: they bump a plain tally, read by the SDK at each collection (an
        # observable counter: the same cumulative sum, without an SDK call on the engine's path)
        self.guard_tally: dict[tuple[str, str], int] = {}
        self.guard_lock = threading.Lock()        # guards may run on the KV link's thread too
        self.guard_checks = m.create_observable_counter("kvledger.guard.checks", [self._observe_guards], "{check}",
                                                        "Checks each guard ran, by result")
        self.released = m.create_counter("kvledger.pages.released", "{page}", "Pages released, by kind and end")
        self.release_hold = m.create_histogram("kvledger.release.hold_duration", "s",
                                               "How long a deferred release held its pages")
        self.held_pages = m.create_up_down_counter("kvledger.release.held_pages", "{page}",
                                                   "Pages held by deferred releases right now")

    def _observe_guards(self, options: CallbackOptions) -> list[Observation]:
        with self.guard_lock:
            return [Observation(n, {"kvledger.guard": g, "result": r}) for (g, r), n in self.guard_tally.items()]
