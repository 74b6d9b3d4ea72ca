"""OpenTelemetry for the engine: one TracerProvider and MeterProvider per node, spans and metric
points exported into the store, and the recorder that the engine calls (``Telemetry``).

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
import time
from pathlib import Path
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
from opentelemetry.trace import Status, StatusCode

from engine.errors import InputError
from engine.recorder import Recorder, TransferRecord
from telemetry.keys import Keys
from telemetry.ledger import PageLedger, _perf_to_unix_ns, forget_oldest_half
from telemetry.store import FLUSH_INTERVAL, SegmentWriter

SPAN_EXPORT_DELAY_MS = 500
SEMCONV_VERSION = "0.66b2"          # opentelemetry-semantic-conventions the attribute names come from
SCHEMA_URL = "https://opentelemetry.io/schemas/1.40.0"
PROVIDER = "kvledger"
OPERATION = "text_completion"
log = logging.getLogger("kvledger.telemetry")

# bucket boundaries from the GenAI metrics spec
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
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
        cols: dict[str, list] = {k: [] for k in ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState",
                                                 "SpanName", "SpanKind", "ServiceName", "ResourceAttributes",
                                                 "ScopeName", "ScopeVersion", "SpanAttributes", "Duration",
                                                 "StatusCode", "StatusMessage", "Events.Timestamp", "Events.Name",
                                                 "Links.TraceId", "Links.SpanId", *_PROMOTED.values())}
        for sp in spans:
            a, res = dict(sp.attributes or {}), dict(sp.resource.attributes)
            cols["Timestamp"].append(sp.start_time)
            cols["TraceId"].append(f"{sp.context.trace_id:032x}")
            cols["SpanId"].append(f"{sp.context.span_id:016x}")
            cols["ParentSpanId"].append(f"{sp.parent.span_id:016x}" if sp.parent else "")
            cols["TraceState"].append(str(sp.context.trace_state.to_header()))
            cols["SpanName"].append(sp.name)
            cols["SpanKind"].append(sp.kind.name)
            cols["ServiceName"].append(str(res.get("service.name", "")))
            cols["ResourceAttributes"].append([(k, _s(v)) for k, v in res.items()])
            cols["ScopeName"].append(sp.instrumentation_scope.name if sp.instrumentation_scope else "")
            cols["ScopeVersion"].append((sp.instrumentation_scope.version or "") if sp.instrumentation_scope else "")
            cols["SpanAttributes"].append([(k, _s(v)) for k, v in a.items()])
            cols["Duration"].append(sp.end_time - sp.start_time)
            cols["StatusCode"].append(sp.status.status_code.name)
            cols["StatusMessage"].append(sp.status.description or "")
            cols["Events.Timestamp"].append([e.timestamp for e in sp.events])
            cols["Events.Name"].append([e.name for e in sp.events])
            cols["Links.TraceId"].append([f"{ln.context.trace_id:032x}" for ln in sp.links])
            cols["Links.SpanId"].append([f"{ln.context.span_id:016x}" for ln in sp.links])
            for key, col in _PROMOTED.items():
                v = a.get(key)
                cols[col].append(_s(v) if isinstance(v, (list, tuple)) else v)
        types = {"Timestamp": pa.timestamp("ns"), "Events.Timestamp": pa.list_(pa.timestamp("ns")),
                 "ResourceAttributes": pa.map_(pa.string(), pa.string()),
                 "SpanAttributes": pa.map_(pa.string(), pa.string()), "ttft_s": pa.float64()}
        self.writer.submit("spans", pa.table({k: pa.array(v, types.get(k)) for k, v in cols.items()}))
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


def _otlp_processor() -> SpanProcessor | None:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_*ENDPOINT is set but the OTLP exporter is not installed "
                    "(pip install 'kvledger[otlp]'); spans go to the store only")
        return None
    return BatchSpanProcessor(OTLPSpanExporter())   # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_*


class _Node:
    def __init__(self, tel: "Telemetry", engine):
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
        if (otlp := _otlp_processor()) is not None:
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


class Telemetry(Recorder):
    """Spans, metrics and the page ledger of every node of one deployment, into one store."""

    def __init__(self, store: str | Path, *, policy: str = "", guards: dict[str, bool] | None = None,
                 isolation_level: str = "tenant", model_name: str = "", service: str = "kvledger",
                 flush_interval: float | None = None, span_queue_size: int = 8192, metric_interval: float = 5.0,
                 record_ledger: bool = True, coalesce: bool = True, boot: str | None = None,
                 writer_priority: str | None = None):
        from importlib.metadata import PackageNotFoundError, version
        try:
            self.version = version("kvledger")
        except PackageNotFoundError:
            self.version = "0+unknown"
        # the store's writer thread runs under SCHED_IDLE unless told otherwise (KVLEDGER_WRITER_PRIORITY=
        # normal): it uses the gaps between the engine's steps first (bench/telemetry.py calibrates what
        # that saves); a flush overdue because the cores were never idle is raised to normal priority by
        # the engine's next step (SegmentWriter.nudge), so the flush interval stays the durability window
        priority = writer_priority or os.environ.get("KVLEDGER_WRITER_PRIORITY", "idle")
        if priority not in ("idle", "normal"):
            raise InputError(f"KVLEDGER_WRITER_PRIORITY / writer priority must be idle or normal, got {priority!r}")
        self.writer = SegmentWriter(store, flush_interval=FLUSH_INTERVAL if flush_interval is None else flush_interval,
                                    boot=boot, idle_priority=priority == "idle")
        # this start of the deployment: every row it writes carries it (store.py fills the column)
        self.boot = self.writer.boot
        self.keys: Keys = self.writer.keys
        self.policy, self.guards, self.isolation_level = policy, guards, isolation_level
        self.model_name, self.service = model_name, service
        self.span_queue_size, self.metric_interval = span_queue_size, metric_interval
        self.ledger = PageLedger(self.writer, self.keys, self.span_ids, coalesce) if record_ledger else None
        self.nodes: dict[str, _Node] = {}
        self._roots: dict[int, trace.Span] = {}
        self._ids: dict[int, tuple[str, str]] = {}    # incarnation -> (trace id, span id), kept after the request
        self.ids_cap = 1 << 20                          # ends (late ledger rows still name its trace), bounded
        self._rejections: dict[int, tuple[str, BaseException]] = {}
        self._transfers: dict[int, TransferRecord] = {}
        # every signed chain head also leaves as telemetry - a span `kvledger.anchor` to the OTLP
        # collector when one is configured, so a collector or SIEM keeps a copy outside the machine.
        # Not into the store itself: it holds the chain already, and a span per flush would make
        # every flush write another segment, forever, on an idle store.
        self._store_tracers = None
        if (otlp := _otlp_processor()) is not None:
            ident = self.writer.wkeys.identity
            self._store_tracers = TracerProvider(resource=Resource.create({
                "service.name": service, "kvledger.store_id": ident.store_id, "kvledger.boot": self.boot,
                "kvledger.store.key_fingerprint": ident.fingerprint}))
            self._store_tracers.add_span_processor(otlp)
            self._anchor_tracer = self._store_tracers.get_tracer("kvledger.store", self.version, schema_url=SCHEMA_URL)
            self.writer.on_anchor.append(self._anchor_span)

    # ---- helpers ----------------------------------------------------------------------------------
    def _anchor_span(self, entry: dict) -> None:
        if self._store_tracers is None:          # shut down: the seal goes to the anchor and seal.json only
            return
        span = self._anchor_tracer.start_span("kvledger.anchor", attributes={
            "kvledger.operation": "anchor", "kvledger.store_id": entry["store_id"], "kvledger.anchor.seq": entry["seq"],
            "kvledger.anchor.head": entry["head"], "kvledger.anchor.seal": entry["seal"],
            "kvledger.anchor.signature": entry["signature"], "kvledger.store.key_fingerprint": entry["fingerprint"]})
        span.end()

    def span_ids(self, incarnation: int) -> tuple[str | None, str | None]:
        return self._ids.get(incarnation, (None, None))

    def _node(self, engine) -> _Node:
        return self.nodes[engine.cfg.node_id]

    def _model(self, engine) -> str:
        return self.model_name or getattr(engine.model, "name", type(engine.model).__name__)

    def _child(self, engine, req, name: str, start: float | None, end: float | None, **attrs) -> None:
        root = self._roots.get(req.incarnation)
        if root is None or start is None or end is None:
            return
        span = self._node(engine).tracer.start_span(
            f"{name} {self._model(engine)}", context=trace.set_span_in_context(root),
            start_time=_perf_to_unix_ns(start),
            attributes={"kvledger.operation": name, "kvledger.node": engine.cfg.node_id,
                        "kvledger.incarnation": req.incarnation, **attrs})
        span.end(end_time=_perf_to_unix_ns(end))

    # ---- the recorder contract -------------------------------------------------------------------------
    def node_started(self, engine) -> None:
        cfg = engine.cfg
        self.nodes[cfg.node_id] = _Node(self, engine)
        guards = self.guards if self.guards is not None else {"read_check": cfg.fail_on_violation}
        self.writer.submit("config_snapshots", pa.table({
            "node": [cfg.node_id], "role": [cfg.role], "ts": pa.array([time.time_ns()], pa.timestamp("ns")),
            "pool_tokens": [engine.pool.capacity_tokens], "context_length": [cfg.context_length],
            "advertised_context": [engine.preflight.advertised_context], "page_size": [cfg.page_size],
            "pool_fits_context": [engine.preflight.fits], "preflight_action": [engine.preflight.action],
            "policy": [self.policy or "unspecified"],
            "guards": pa.array([list(guards.items())], pa.map_(pa.string(), pa.bool_())),
            "isolation_level": [cfg.isolation_level if cfg.prefix_cache else self.isolation_level], "model": [self._model(engine)],
            "kv_format_version": [cfg.kv_format_version], "kvledger_version": [self.version]}))

    def request_arrived(self, engine, req) -> None:
        if self.ledger is not None:
            self.ledger.on_arrived(req)
        if req.incarnation in self._roots:          # the prefill half of a disaggregated request
            req.on_finish.append(lambda r: self._child(engine, r, "prefill", r.prefill_started_at, r.first_token_at,
                                                       **{"kvledger.prompt_tokens.prefilled": r.prefilled_tokens}))
            return
        model = self._model(engine)
        root = self._node(engine).tracer.start_span(
            f"{OPERATION} {model}", kind=trace.SpanKind.SERVER, start_time=_perf_to_unix_ns(req.arrival),
            attributes={GA.GEN_AI_OPERATION_NAME: OPERATION, GA.GEN_AI_PROVIDER_NAME: PROVIDER,
                        GA.GEN_AI_REQUEST_MODEL: model, GA.GEN_AI_RESPONSE_ID: str(req.incarnation),
                        "kvledger.operation": "request", "kvledger.incarnation": req.incarnation,
                        "kvledger.node": engine.cfg.node_id, "kvledger.tenant": self.keys.pseudonym(req.tenant),
                        "kvledger.cache_scope": self.keys.pseudonym(req.scope),
                        "kvledger.prompt_tokens.received": len(req.prompt_ids)})
        ctx = root.get_span_context()
        self._roots[req.incarnation] = root
        forget_oldest_half(self._ids, self.ids_cap)     # past 1 Mi requests, the oldest lose their ids on late rows
        self._ids[req.incarnation] = (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
        req.on_finish.append(lambda r: self.request_finished(engine, r))

    def step(self, engine, out) -> None:
        if self.ledger is not None:
            self.ledger.on_step(engine, out)

    def pages_moved(self, engine, req, path, pages, positions) -> None:
        if self.ledger is not None:
            self.ledger.on_moved(engine, req, path, pages, positions)

    def pages_released(self, engine, req, pages, kind="immediate", ended_by="immediate", hold_ns=0) -> None:
        self._node(engine).released.add(len(pages), {"kind": kind, "ended_by": ended_by})
        if kind == "deferred":
            self._node(engine).release_hold.record(hold_ns / 1e9, {"ended_by": ended_by})
            self._node(engine).held_pages.add(-len(pages))
        if self.ledger is not None:
            self.ledger.on_release(engine, req, pages, kind, ended_by, hold_ns)

    def pages_held(self, engine, req, pages, why) -> None:
        self._node(engine).held_pages.add(len(pages))

    def transfer_landed(self, engine, rec: TransferRecord) -> None:
        forget_oldest_half(self._transfers, self.ids_cap)   # dropped when the request ends; a late one is bounded
        self._transfers[rec.incarnation] = rec
        if self.ledger is not None:
            self.ledger.on_transfer(engine, rec)
        root = self._roots.get(rec.incarnation)
        if root is not None:
            self._child(engine, _Inc(rec.incarnation), "kv_transfer", rec.submitted_at, rec.landed_at, **{
                "kvledger.transfer.id": rec.transfer_id, "kvledger.transfer.src_node": rec.src_node,
                "kvledger.slots.reserved": rec.reserved.numel(), "kvledger.slots.sent": rec.sent.numel(),
                "kvledger.slots.landed": rec.landed.numel(),
                "kvledger.checksum.verified": rec.checksum_dst is not None,
                "kvledger.checksum.ok": rec.checksum_dst == rec.checksum_src if rec.checksum_dst else False,
                "kvledger.transfer.outcome": rec.outcome})

    def guard_checked(self, engine, guard, failed, count=1) -> None:
        if count:
            node, key = self._node(engine), (guard, "fail" if failed else "pass")
            with node.guard_lock:
                node.guard_tally[key] = node.guard_tally.get(key, 0) + count

    def rejected(self, engine, req, where, error) -> None:
        forget_oldest_half(self._rejections, self.ids_cap)
        self._rejections[req.incarnation] = (where, error)

    def request_finished(self, engine, req) -> None:
        rec = self._transfers.pop(req.incarnation, None)        # used by the root span below, then dropped
        rejection = self._rejections.pop(req.incarnation, None)
        root = self._roots.get(req.incarnation)
        if root is None:
            return
        if self.ledger is not None:
            self.ledger.on_finished(req)
        node = self._node(engine)
        end = req.finished_at
        a: dict = {GA.GEN_AI_USAGE_INPUT_TOKENS: req.prompt_tokens_billed, GA.GEN_AI_USAGE_OUTPUT_TOKENS: len(req.output_ids),
                   "gen_ai.usage.cache_read.input_tokens": req.cached_tokens, GA.GEN_AI_RESPONSE_FINISH_REASONS: [req.finish_reason],
                   "kvledger.prompt_tokens.prefilled": req.prefilled_tokens,
                   "kvledger.preemptions": req.preemptions}
        if req.ttft is not None:
            a["kvledger.time_to_first_token"] = req.ttft
        if rec is not None:
            a.update({"kvledger.slots.reserved": rec.reserved.numel(), "kvledger.slots.landed": rec.landed.numel()})
        metric_attrs = {GA.GEN_AI_OPERATION_NAME: OPERATION, GA.GEN_AI_PROVIDER_NAME: PROVIDER,
                        GA.GEN_AI_REQUEST_MODEL: self._model(engine)}
        if req.error is not None:
            a[ERROR_TYPE] = metric_attrs[ERROR_TYPE] = type(req.error).__name__
            root.set_status(Status(StatusCode.ERROR, str(req.error)))
            if rejection is not None:
                where, err = rejection
                a["kvledger.rejection.where"], a["kvledger.rejection.reason"] = where, str(err)
                root.add_event("rejected", {"kvledger.rejection.where": where}, timestamp=_perf_to_unix_ns(end))
        root.set_attributes(a)
        first_work = min((t for t in (req.prefill_started_at, req.transfer_started_at) if t is not None), default=end)
        self._child(engine, req, "admission", req.arrival, first_work)
        if engine.cfg.role == "unified":
            self._child(engine, req, "prefill", req.prefill_started_at, req.first_token_at or end,
                        **{"kvledger.prompt_tokens.prefilled": req.prefilled_tokens})
        if req.first_token_at is not None and len(req.output_ids) > 1:
            self._child(engine, req, "decode", req.first_token_at, end)
        root.end(end_time=_perf_to_unix_ns(end))
        if req.ttft is not None:
            node.ttft.record(req.ttft, metric_attrs)
            if len(req.output_ids) > 1:
                node.tpot.record((end - req.first_token_at) / (len(req.output_ids) - 1), metric_attrs)
        node.duration.record(end - req.arrival, metric_attrs)
        self._roots.pop(req.incarnation, None)   # ids stay: late ledger rows still name the trace

    # ---- shutdown ---------------------------------------------------------------------------------------
    @property
    def spans_ended(self) -> int:
        return sum(n.ended.ended for n in self.nodes.values())

    @property
    def spans_exported(self) -> int:
        return sum(n.exporter.exported for n in self.nodes.values())

    def close(self) -> dict:
        """Flush spans, metrics and the ledger; returns counts (spans_dropped: lost to a full queue).
        Closing twice is harmless (the second call only returns the counts)."""
        if self.writer.closed:
            return self._counts()
        for n in self.nodes.values():
            n.tracers.force_flush()
            n.tracers.shutdown()
            n.meters.force_flush()
            n.meters.shutdown()
        self.writer.flush()                     # its anchor span ends before the anchor tracer shuts down
        tracers, self._store_tracers = self._store_tracers, None
        if tracers is not None:
            tracers.force_flush()
            tracers.shutdown()
        self.writer.close()
        return self._counts()

    def _counts(self) -> dict:
        return {"boot": self.boot, "spans_ended": self.spans_ended, "spans_exported": self.spans_exported,
                "spans_dropped": self.spans_ended - self.spans_exported, "segments": self.writer.segments_written,
                "rows": dict(self.writer.rows_written), "writer_priority": self.writer.priority,
                "ledger_waited_s": self.ledger.waited_s if self.ledger is not None else 0.0}


class _Inc:
    """The few request fields a child span needs when only the incarnation is at hand."""
    __slots__ = ("incarnation",)

    def __init__(self, incarnation: int):
        self.incarnation = incarnation
