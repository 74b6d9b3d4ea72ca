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
installed (``pip install kvledger[otlp]``), spans also go to that collector. Without one, a request's
spans skip the SDK: its root is a ``RowSpan`` (ids from the node's id generator, no SDK span, processor
or export thread) and ``SpanRows`` writes the rows the exporter would have made of it and of its
children (admission, prefill, decode) straight into the store.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Sequence

import pyarrow as pa
from opentelemetry import trace
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


def _span_columns() -> dict[str, list]:
    return {k: [] for k in (*collector_span_columns(), *_PROMOTED.values())}


def _resource_row(resource: Resource) -> tuple[str, list]:
    """A provider's resource as a span row carries it: (service name, attribute pairs)."""
    ra = resource.attributes
    return str(ra.get("service.name", "")), [(k, _s(v)) for k, v in ra.items()]


def _append_span(cols: dict[str, list], start: int, end: int, trace_id: int, span_id: int, parent_id: int | None,
                 trace_state: str, name: str, kind: str, res: tuple[str, list], scope: tuple[str, str], a,
                 status: tuple[str, str] = ("UNSET", ""), events=(), links=()) -> None:
    """One span's row into the ``spans`` columns (the Collector's ClickHouse exporter's, and the
    promoted attributes); ``a``: its attributes (a mapping)."""
    cols["Timestamp"].append(start)
    cols["TraceId"].append(f"{trace_id:032x}")
    cols["SpanId"].append(f"{span_id:016x}")
    cols["ParentSpanId"].append(f"{parent_id:016x}" if parent_id is not None else "")
    cols["TraceState"].append(trace_state)
    cols["SpanName"].append(name)
    cols["SpanKind"].append(kind)
    cols["ServiceName"].append(res[0])
    cols["ResourceAttributes"].append(res[1])
    cols["ScopeName"].append(scope[0])
    cols["ScopeVersion"].append(scope[1])
    cols["SpanAttributes"].append([(k, _s(v)) for k, v in a.items()])
    cols["Duration"].append(end - start)
    cols["StatusCode"].append(status[0])
    cols["StatusMessage"].append(status[1])
    cols["Events.Timestamp"].append([e.timestamp for e in events])
    cols["Events.Name"].append([e.name for e in events])
    cols["Links.TraceId"].append([f"{ln.context.trace_id:032x}" for ln in links])
    cols["Links.SpanId"].append([f"{ln.context.span_id:016x}" for ln in links])
    for key, col in _PROMOTED.items():
        v = a.get(key)
        cols[col].append(_s(v) if isinstance(v, (list, tuple)) else v)


def _spans_table(cols: dict[str, list]) -> pa.Table:
    schema = arrow_schemas()["spans"]
    return pa.table({k: pa.array(v, schema.field(k).type) for k, v in cols.items()})


class StoreSpanExporter(SpanExporter):
    """Spans -> the ``spans`` table (columns after the Collector's ClickHouse exporter)."""

    def __init__(self, writer: SegmentWriter):
        self.writer, self.exported = writer, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.writer.accepting:   # closed (an SDK thread restarted in a forked child) or failed: not exported
            return SpanExportResult.FAILURE
        cols = _span_columns()
        resources: dict[int, tuple[str, list]] = {}      # a provider's resource: the same for all its spans
        for sp in spans:
            ctx, scope, status = sp.context, sp.instrumentation_scope, sp.status
            res = resources.get(id(sp.resource))
            if res is None:
                res = resources[id(sp.resource)] = _resource_row(sp.resource)
            _append_span(cols, sp.start_time, sp.end_time, ctx.trace_id, ctx.span_id,
                         sp.parent.span_id if sp.parent else None, str(ctx.trace_state.to_header()), sp.name,
                         sp.kind.name, res, (scope.name, scope.version or "") if scope else ("", ""),
                         sp.attributes or {}, (status.status_code.name, status.description or ""), sp.events, sp.links)
        self.writer.submit("spans", _spans_table(cols))
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class SpanRows:
    """Spans written as rows straight into the ``spans`` columns - no SDK span object, processor or
    export thread - where the store is their only destination (no OTLP collector configured): a
    request's root (``RowSpan``) and its child spans (``Telemetry._end_request``), each row what
    StoreSpanExporter makes of the same span through the SDK (tests/test_telemetry.py holds the two
    equal). One thread builds them (the store writer's); counted as ended when added, as exported
    when taken."""

    def __init__(self):
        self.cols, self.n, self.by_node = _span_columns(), 0, {}
        self.kids: list[tuple] = []         # child spans (``add``), made columns at ``take``

    def add(self, node: "NodeTelemetry", parent, name: str, start: int, end: int, attrs: dict) -> None:
        """A child of ``parent`` (a span context) on ``node``, from ``start`` to ``end`` (ns since the
        epoch), kind INTERNAL, status UNSET, its id from the node's tracer provider's id generator.
        Kept as one tuple until ``take`` makes every child's columns at once (``_children_table``: the
        same row as ``add_span``'s, without a Python list append per column and row)."""
        self.kids.append((node, parent.trace_id, node.tracers.id_generator.generate_span_id(), parent.span_id,
                          parent.trace_state, name, start, end, attrs))
        node.direct_ended += 1
        self.by_node[node] = self.by_node.get(node, 0) + 1
        self.n += 1

    def add_span(self, node: "NodeTelemetry", start: int, end: int, trace_id: int, span_id: int,
                 parent_id: int | None, trace_state: str, name: str, kind: str, attrs,
                 status: tuple[str, str] = ("UNSET", ""), events=()) -> None:
        """One span's row (a root: ``parent_id`` None), counted as ended on ``node``."""
        _append_span(self.cols, start, end, trace_id, span_id, parent_id, trace_state, name, kind, node.resource_row,
                     node.scope, attrs, status, events)
        node.direct_ended += 1
        self.by_node[node] = self.by_node.get(node, 0) + 1
        self.n += 1

    def take(self, handed_over: bool = True) -> pa.Table | None:
        """The rows so far (None: none), counted as exported where ``handed_over`` (the caller gives
        them to the store's writer; False: the writer no longer accepts - they are dropped)."""
        parts = [] if self.n == len(self.kids) else [_spans_table(self.cols)]
        if self.kids:
            parts.append(_children_table(self.kids))
        table = None if not parts else parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        if handed_over:
            for node, k in self.by_node.items():
                node.direct_exported += k
        self.cols, self.n, self.by_node, self.kids = _span_columns(), 0, {}, []
        return table


def _children_table(kids: list[tuple]) -> pa.Table:
    """``SpanRows.add``'s child spans as the ``spans`` columns ``_append_span`` makes of each (kind
    INTERNAL, status UNSET, no events or links): a row's own values in one pass, its node's resource
    and scope taken per node, the constant columns repeated in Arrow."""
    n = len(kids)
    ts, dur, tid, sid, pid, state, names, at, keys, vals = [], [], [], [], [], [], [], [], [], []
    offsets = [0]
    nodes: dict = {}
    promoted: dict[str, list] = {}          # the promoted attributes' columns the children set (others: NULL)
    parent = None
    for i, (node, trace_id, span_id, parent_id, trace_state, name, start, end, a) in enumerate(kids):
        if (parent_id, trace_id) != parent:     # a request's children follow each other: its ids made once
            parent = (parent_id, trace_id)
            t, p, st = f"{trace_id:032x}", f"{parent_id:016x}", str(trace_state.to_header())
        ts.append(start)
        dur.append(end - start)
        tid.append(t)
        sid.append(f"{span_id:016x}")
        pid.append(p)
        state.append(st)
        names.append(name)
        at.append(nodes.setdefault(node, len(nodes)))
        for k, v in a.items():
            keys.append(k)
            listed = isinstance(v, (list, tuple))
            vals.append(_s(v) if listed else str(v))
            col = _PROMOTED.get(k)
            if col is not None:
                if col not in promoted:
                    promoted[col] = [None] * n
                promoted[col][i] = _s(v) if listed else v
        offsets.append(len(keys))
    schema = arrow_schemas()["spans"]
    typ = schema.field
    at = pa.array(at, pa.int32())
    per_node = {"ServiceName": [nd.resource_row[0] for nd in nodes], "ResourceAttributes": [nd.resource_row[1] for nd in nodes],
                "ScopeName": [nd.scope[0] for nd in nodes], "ScopeVersion": [nd.scope[1] for nd in nodes]}
    const = {"SpanKind": "INTERNAL", "StatusCode": "UNSET", "StatusMessage": ""}
    own = {"Timestamp": ts, "TraceId": tid, "SpanId": sid, "ParentSpanId": pid, "TraceState": state, "SpanName": names,
           "Duration": dur, **promoted}
    cols = {}
    for k in _span_columns():
        if k in own:
            cols[k] = pa.array(own[k], typ(k).type)
        elif k in per_node:
            cols[k] = pa.array(per_node[k], typ(k).type).take(at)
        elif k in _PROMOTED.values():
            cols[k] = pa.nulls(n, typ(k).type)
        elif k in const:
            cols[k] = pa.repeat(pa.scalar(const[k], typ(k).type), n)
        elif k == "SpanAttributes":
            cols[k] = pa.MapArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(keys, pa.string()),
                                              pa.array(vals, pa.string())).cast(typ(k).type)
        else:                                   # Events.*, Links.*: none
            cols[k] = pa.array([[]] * n, typ(k).type)
    return pa.table(cols)


class _Event:
    """A span event as ``_append_span`` reads it (the SDK's ``Event``: name and time)."""
    __slots__ = ("name", "timestamp", "attributes")

    def __init__(self, name: str, attributes, timestamp: int):
        self.name, self.attributes, self.timestamp = name, attributes, timestamp


class RowSpan(trace.NonRecordingSpan):
    """A request's root span where the store is the spans' only destination: no SDK span object, no
    sampler, processor, queue or export thread. Started on the engine's thread (its ids from the node's
    id generator, as the SDK's would be: every ledger row of the request names them), ended on the
    store writer's (``Telemetry._end_request``), where its row goes into ``rows`` - what
    StoreSpanExporter makes of the same span through the SDK (tests/test_telemetry.py holds the two
    equal). A child started through the SDK under it (``trace.set_span_in_context``) is its child."""

    def __init__(self, node: "NodeTelemetry", rows: SpanRows, name: str, kind: str, start: int, attributes: dict):
        ids = node.tracers.id_generator
        super().__init__(trace.SpanContext(ids.generate_trace_id(), ids.generate_span_id(), is_remote=False,
                                           trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
        self.node, self.rows, self.name, self.kind, self.start = node, rows, name, kind, start
        self.attributes, self.status, self.events, self.ended = attributes, ("UNSET", ""), [], False

    def set_attributes(self, attributes) -> None:
        if self.ended:                            # the SDK ignores (and warns of) calls on an ended span
            return
        for k, v in attributes.items():           # the SDK's order: a key set again moves to the end
            self.attributes.pop(k, None)
            self.attributes[k] = v

    def set_attribute(self, key: str, value) -> None:
        self.set_attributes({key: value})

    def set_status(self, status, description: str | None = None) -> None:
        code = status.status_code if isinstance(status, trace.Status) else status
        desc = (status.description if isinstance(status, trace.Status) else description) or ""
        if not self.ended and self.status[0] != "OK":      # the SDK's rule: OK is final, UNSET changes nothing
            if code is trace.StatusCode.OK:
                self.status = ("OK", "")
            elif code is trace.StatusCode.ERROR:
                self.status = ("ERROR", desc)

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        if not self.ended:
            self.events.append(_Event(name, attributes or {},
                                      timestamp if timestamp is not None else time.time_ns()))

    def is_recording(self) -> bool:
        return not self.ended

    def end(self, end_time: int | None = None) -> None:
        """The row, once (a second end is ignored, as the SDK ignores it)."""
        if self.ended:
            return
        self.ended = True
        ctx = self.get_span_context()
        self.rows.add_span(self.node, self.start, end_time if end_time is not None else time.time_ns(), ctx.trace_id,
                           ctx.span_id, None, "", self.name, self.kind, self.attributes, self.status, self.events)


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
        # where the store is the spans' only destination, a request's root (RowSpan) and its child spans
        # are written as rows (SpanRows) rather than built and exported through the SDK: bench/telemetry.py
        self.direct = otlp is None
        self.direct_ended = self.direct_exported = 0        # those rows (SpanRows), beside the SDK's counts
        self.resource_row, self.scope = _resource_row(res), ("kvledger", tel.version)
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
        # releases, one per finished request: the same plain tally (an SDK counter's add is ~80 us with
        # its attribute set), under the same lock
        self.release_tally: dict[tuple[str, str], int] = {}
        self.released = m.create_observable_counter("kvledger.pages.released", [self._observe_releases], "{page}",
                                                    "Pages released, by kind and end")
        self.release_hold = m.create_histogram("kvledger.release.hold_duration", "s",
                                               "How long a deferred release held its pages")
        self.held_pages = m.create_up_down_counter("kvledger.release.held_pages", "{page}",
                                                   "Pages held by deferred releases right now")

    def _observe_guards(self, options: CallbackOptions) -> list[Observation]:
        with self.guard_lock:
            return [Observation(n, {"kvledger.guard": g, "result": r}) for (g, r), n in self.guard_tally.items()]

    def _observe_releases(self, options: CallbackOptions) -> list[Observation]:
        with self.guard_lock:
            return [Observation(n, {"kind": k, "ended_by": e}) for (k, e), n in self.release_tally.items()]

    def count_release(self, pages: int, kind: str, ended_by: str) -> None:
        key = (kind, ended_by)
        with self.guard_lock:
            self.release_tally[key] = self.release_tally.get(key, 0) + pages
