"""``Telemetry``: the engine's recorder. It turns what the engine tells it (``engine/recorder.py``,
the contract) into spans and metrics (``otel.py``), page-ledger rows (``ledger.py``) and config
snapshots, all into one store (``telemetry/store``), for every node of one deployment.

The engine never builds one: the command that runs the engine opens it and hands it down, or hands
down ``recording(store, ...)``, the factory a replay or an engine process opens it with once it
knows its policy, guards and model.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GA
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import Status, StatusCode

from engine.errors import InputError
from engine.recorder import LandedRecords, Recorder, RecorderFactory, TransferRecord
from telemetry.ledger import PageLedger, forget_oldest_half, perf_to_unix_ns
from telemetry.otel import OPERATION, PROVIDER, SCHEMA_URL, NodeTelemetry, RowSpan, SpanRows, otlp_processor
from telemetry.store import FLUSH_INTERVAL, SegmentWriter, StoreError
from telemetry.store.keys import Keys

log = logging.getLogger("kvledger.telemetry")


def recording(store: str | Path, **options) -> RecorderFactory:
    """The factory that opens a ``Telemetry`` on ``store`` once the caller knows its labels (policy,
    guards, model name, isolation level). Picklable: an engine process can be handed it."""
    return functools.partial(Telemetry, store, **options)


class Telemetry(Recorder):
    """Spans, metrics and the page ledger of every node of one deployment, into one store."""

    def __init__(self, store: str | Path, *, policy: str = "", guards: dict[str, bool] | None = None,
                 isolation_level: str = "tenant", model_name: str = "", service: str = "kvledger",
                 flush_interval: float | None = None, span_queue_size: int = 8192, metric_interval: float = 5.0,
                 record_ledger: bool = True, coalesce: bool = True, boot: str | None = None,
                 writer_priority: str | None = None, exposure_index: bool = True):
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
        # exposure_index: the ledger writer keeps the exposure index beside the ledger (readers answer from it;
        # without it they run the as-of join over the whole ledger)
        self.ledger = PageLedger(self.writer, self.keys, self.span_ids, coalesce, exposure_index) if record_ledger else None
        self.nodes: dict[str, NodeTelemetry] = {}
        self._roots: dict[int, trace.Span] = {}
        self._ids: dict[int, tuple[str, str]] = {}    # incarnation -> (trace id, span id), kept after the request
        self.ids_cap = 1 << 20                          # ends (late ledger rows still name its trace), bounded
        self._rejections: dict[int, tuple[str, BaseException]] = {}
        self._transfers: dict[int, TransferRecord] = {}
        # finished requests whose spans the store writer's thread ends (request_finished)
        self._finishing: collections.deque = collections.deque()
        self._child_rows = SpanRows()       # their spans, where written as rows (NodeTelemetry.direct)
        self._finish_lock = threading.Lock()
        self._finish_queued = False
        # the rows are taken once a flush, not each time the writer ends a batch of requests' spans: a
        # spans table made of a few requests' rows at a time cost about as much as its rows (pyarrow's
        # per-column costs), ~1 ms a call beside the tiny decode
        self.writer.add_drain(self._drain_spans)
        # every signed chain head also leaves as telemetry - a span `kvledger.anchor` to the OTLP
        # collector when one is configured, so a collector or SIEM keeps a copy outside the machine.
        # Not into the store itself: it holds the chain already, and a span per flush would make
        # every flush write another segment, forever, on an idle store.
        self._store_tracers = None
        if (otlp := otlp_processor()) is not None:
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

    def _node(self, engine) -> NodeTelemetry:
        return self.nodes[engine.cfg.node_id]

    def _model(self, engine) -> str:
        return self.model_name or getattr(engine.model, "name", type(engine.model).__name__)

    def _child(self, engine, req, name: str, start: float | None, end: float | None, root=None, parent=None,
               rows: SpanRows | None = None, **attrs) -> None:
        """``parent``: the root's context, made once by a caller that ends several children; ``rows``:
        the span written as a row there instead of through the SDK (the node's ``direct``)."""
        root = root or self._roots.get(req.incarnation)
        if root is None or start is None or end is None:
            return
        if rows is not None:
            rows.add(self._node(engine), root.get_span_context(), f"{name} {self._model(engine)}",
                     perf_to_unix_ns(start), perf_to_unix_ns(end),
                     {"kvledger.operation": name, "kvledger.node": engine.cfg.node_id,
                      "kvledger.incarnation": req.incarnation, **attrs})
            return
        span = self._node(engine).tracer.start_span(
            f"{name} {self._model(engine)}", context=parent or trace.set_span_in_context(root),
            start_time=perf_to_unix_ns(start),
            attributes={"kvledger.operation": name, "kvledger.node": engine.cfg.node_id,
                        "kvledger.incarnation": req.incarnation, **attrs})
        span.end(end_time=perf_to_unix_ns(end))

    # ---- the recorder contract -------------------------------------------------------------------------
    def node_started(self, engine) -> None:
        cfg = engine.cfg
        self.nodes[cfg.node_id] = NodeTelemetry(self, engine)
        guards = self.guards if self.guards is not None else {"read_check": cfg.fail_on_violation}
        self.writer.submit("config_snapshots", pa.table({
            "node": [cfg.node_id], "role": [cfg.role], "ts": pa.array([time.time_ns()], pa.timestamp("ns")),
            "pool_tokens": [engine.pool.capacity_tokens], "context_length": [cfg.context_length],
            "advertised_context": [engine.preflight.advertised_context], "page_size": [cfg.page_size],
            "pool_fits_context": [engine.preflight.fits], "preflight_action": [engine.preflight.action],
            "policy": [self.policy or "unspecified"],
            "guards": pa.array([list(guards.items())], pa.map_(pa.string(), pa.bool_())),
            "isolation_level": [cfg.isolation_level if cfg.prefix_cache else self.isolation_level], "model": [self._model(engine)],
            "kv_format_version": [cfg.kv_format_version], "kvledger_version": [self.version],
            "page_ledger": [self.ledger is not None],
            "exposure_index": [self.ledger is not None and self.ledger.index_on]}))

    def request_arrived(self, engine, req) -> None:
        if self.ledger is not None:
            self.ledger.on_arrived(engine, req)
        if req.incarnation in self._roots:          # the prefill half of a disaggregated request
            req.on_finish.append(lambda r: self._child(engine, r, "prefill", r.prefill_started_at, r.first_token_at,
                                                       **{"kvledger.prompt_tokens.prefilled": r.prefilled_tokens}))
            return
        model, node = self._model(engine), self._node(engine)
        attrs = {GA.GEN_AI_OPERATION_NAME: OPERATION, GA.GEN_AI_PROVIDER_NAME: PROVIDER,
                 GA.GEN_AI_REQUEST_MODEL: model, GA.GEN_AI_RESPONSE_ID: str(req.incarnation),
                 "kvledger.operation": "request", "kvledger.incarnation": req.incarnation,
                 "kvledger.node": engine.cfg.node_id, "kvledger.tenant": self.keys.pseudonym(req.tenant),
                 "kvledger.cache_scope": self.keys.pseudonym(req.scope),
                 "kvledger.prompt_tokens.received": len(req.prompt_ids)}
        if node.direct:             # the store is the only destination: a row, no SDK span (otel.RowSpan)
            root = RowSpan(node, self._child_rows, f"{OPERATION} {model}", "SERVER", perf_to_unix_ns(req.arrival),
                           attrs)
        else:
            root = node.tracer.start_span(f"{OPERATION} {model}", kind=trace.SpanKind.SERVER,
                                          start_time=perf_to_unix_ns(req.arrival), attributes=attrs)
        ctx = root.get_span_context()
        self._roots[req.incarnation] = root
        forget_oldest_half(self._ids, self.ids_cap)     # past 1 Mi requests, the oldest lose their ids on late rows
        self._ids[req.incarnation] = (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
        req.on_finish.append(lambda r: self.request_finished(engine, r))
        if self.ledger is not None:
            self.ledger.on_streaming(req, getattr(engine, "tokenizer", None))

    def step(self, engine, out) -> None:
        if self.ledger is not None:
            self.ledger.on_step(engine, out)

    def pages_moved(self, engine, req, path, pages, positions) -> None:
        if self.ledger is not None:
            self.ledger.on_moved(engine, req, path, pages, positions)

    def pages_released(self, engine, req, pages, kind="immediate", ended_by="immediate", hold_ns=0) -> None:
        self._node(engine).count_release(len(pages), kind, ended_by)
        if kind == "deferred":
            self._node(engine).release_hold.record(hold_ns / 1e9, {"ended_by": ended_by})
            self._node(engine).held_pages.add(-len(pages))
        if self.ledger is not None:
            self.ledger.on_release(engine, req, pages, kind, ended_by, hold_ns)

    def pages_held(self, engine, req, pages, why) -> None:
        self._node(engine).held_pages.add(len(pages))

    def records_landed(self, engine, landed: LandedRecords) -> None:
        if self.ledger is not None:
            self.ledger.on_landed(engine, landed)

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
        """Engine thread: the request's fields copied (``_Ended``), the ledger's copies of its token
        lists taken, and the rest - the root span's attributes, its children, the histograms, about
        0.4 ms a request in the SDK - handed to the store writer's thread (idle priority: it runs in
        the engine's gaps), in batches. ``close`` finishes what is still queued before the SDK's
        providers shut down, so no span is lost to the hand-over."""
        rec = self._transfers.pop(req.incarnation, None)        # used by the root span, then dropped
        rejection = self._rejections.pop(req.incarnation, None)
        root = self._roots.pop(req.incarnation, None)           # ids stay: late ledger rows still name the trace
        if root is None:
            return
        if self.ledger is not None:
            self.ledger.on_finished(req, getattr(engine, "tokenizer", None))
        self._finishing.append((engine, root, rec, rejection, _Ended(req)))
        if not self.writer.accepting:          # closed or failed: nothing would run the queue - finish here
            self._finish_spans()
        elif not self._finish_queued:
            self._finish_queued = True
            self.writer.submit_lazy(self._finish_spans)

    def _finish_spans(self) -> list:
        """The store writer's thread (or ``close``): end every queued request's spans. A failure is
        logged and the rest go on - it must not fail the writer, which holds the ledger too. The
        spans written as rows wait in ``_child_rows`` for the next flush (``_drain_spans``); where the
        writer no longer accepts they are dropped here (counted: ended, not exported). Returns no rows
        (the writer's lazy-build contract: (table, rows) pairs)."""
        with self._finish_lock:
            self._finish_queued = False         # before draining: a request queued from now on queues a new call
            while self._finishing:
                item = self._finishing.popleft()
                try:
                    self._end_request(*item)
                except Exception:               # noqa: BLE001 - one request's spans, not the store
                    log.exception("ending request %s's spans failed", item[4].incarnation)
            if not self.writer.accepting:
                self._child_rows.take(handed_over=False)
        return []

    def _drain_spans(self) -> list:
        """The store writer's thread, before every flush: the spans written as rows since the last."""
        with self._finish_lock:
            rows = self._child_rows.take()
        return [] if rows is None else [("spans", rows)]

    def _end_request(self, engine, root, rec: TransferRecord | None, rejection, req: "_Ended") -> None:
        node = self._node(engine)
        end = req.finished_at
        a: dict = {GA.GEN_AI_USAGE_INPUT_TOKENS: req.prompt_tokens_billed, GA.GEN_AI_USAGE_OUTPUT_TOKENS: req.output_tokens,
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
                root.add_event("rejected", {"kvledger.rejection.where": where}, timestamp=perf_to_unix_ns(end))
        root.set_attributes(a)
        first_work = min((t for t in (req.prefill_started_at, req.transfer_started_at) if t is not None), default=end)
        # children as rows where the store is their only destination, else through the SDK
        rows = self._child_rows if node.direct else None
        parent = None if rows is not None else trace.set_span_in_context(root)
        self._child(engine, req, "admission", req.arrival, first_work, root=root, parent=parent, rows=rows)
        if engine.cfg.role == "unified":
            self._child(engine, req, "prefill", req.prefill_started_at, req.first_token_at or end, root=root,
                        parent=parent, rows=rows, **{"kvledger.prompt_tokens.prefilled": req.prefilled_tokens})
        if req.first_token_at is not None and req.output_tokens > 1:
            self._child(engine, req, "decode", req.first_token_at, end, root=root, parent=parent, rows=rows)
        root.end(end_time=perf_to_unix_ns(end))
        if req.ttft is not None:
            node.ttft.record(req.ttft, metric_attrs)
            if req.output_tokens > 1:
                node.tpot.record((end - req.first_token_at) / (req.output_tokens - 1), metric_attrs)
        node.duration.record(end - req.arrival, metric_attrs)

    # ---- what a server reads back (engine.recorder.RunRecorder) ----------------------------------------
    def pseudonym(self, name: str) -> str:
        return self.keys.pseudonym(name)

    def guard_tallies(self) -> dict[str, dict[tuple[str, str], int]]:
        out = {}
        for node, state in list(self.nodes.items()):
            with state.guard_lock:
                out[node] = dict(state.guard_tally)
        return out

    @property
    def spans_unexported(self) -> int:
        return self.spans_ended - self.spans_exported

    # ---- shutdown ---------------------------------------------------------------------------------------
    @property
    def spans_ended(self) -> int:
        return sum(n.ended.ended + n.direct_ended for n in self.nodes.values())

    @property
    def spans_exported(self) -> int:
        return sum(n.exporter.exported + n.direct_exported for n in self.nodes.values())

    def close(self) -> dict:
        """Flush spans, metrics and the ledger; returns counts (spans_dropped: lost to a full queue).
        Closing twice is harmless (the second call only returns the counts)."""
        if self.writer.closed:
            return self._counts()
        error: StoreError | None = None         # a failed writer: everything is still shut down, then raised
        self._finish_spans()        # the requests the writer's thread has not ended yet (their rows: the flush's)
        for n in self.nodes.values():           # (their exporters report a failed writer as a failure)
            n.tracers.force_flush()
            n.tracers.shutdown()
            n.meters.force_flush()
            n.meters.shutdown()
        try:
            if error is None:
                self.writer.flush()             # its anchor span ends before the anchor tracer shuts down
        except StoreError as e:
            error = e
        tracers, self._store_tracers = self._store_tracers, None
        if tracers is not None:
            tracers.force_flush()
            tracers.shutdown()
        try:
            self.writer.close()                 # its thread and the store's lock released even where it failed
        except StoreError as e:
            error = error or e
        if error is not None:
            raise error
        return self._counts()

    def _counts(self) -> dict:
        return {"boot": self.boot, "spans_ended": self.spans_ended, "spans_exported": self.spans_exported,
                "spans_dropped": self.spans_ended - self.spans_exported, "segments": self.writer.segments_written,
                "rows": dict(self.writer.rows_written), "writer_priority": self.writer.priority,
                "ledger_waited_s": self.ledger.waited_s if self.ledger is not None else 0.0,
                "index_cpu_s": self.ledger.index_cpu_s if self.ledger is not None else 0.0}


class _Inc:
    """The few request fields a child span needs when only the incarnation is at hand."""
    __slots__ = ("incarnation",)

    def __init__(self, incarnation: int):
        self.incarnation = incarnation


class _Ended:
    """What the spans and histograms of a finished request need, copied on the engine thread (the
    request object stays the engine's)."""
    __slots__ = ("incarnation", "prompt_tokens_billed", "output_tokens", "cached_tokens", "finish_reason",
                 "prefilled_tokens", "preemptions", "ttft", "error", "arrival", "prefill_started_at",
                 "transfer_started_at", "first_token_at", "finished_at")

    def __init__(self, req):
        for k in self.__slots__:
            if k != "output_tokens":
                setattr(self, k, getattr(req, k))
        self.output_tokens = len(req.output_ids)
