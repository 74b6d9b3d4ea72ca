"""An OTLP/HTTP receiver: ``POST /v1/traces`` and ``POST /v1/metrics``, protobuf or JSON bodies,
optionally gzip-compressed, decoded with the official ``opentelemetry-proto`` messages.

Spans land in the ``spans`` table (columns after the Collector's ClickHouse exporter) with the
typed columns filled from current GenAI semantic conventions and from vLLM's older names:

    input_tokens   gen_ai.usage.input_tokens   | gen_ai.usage.prompt_tokens
    output_tokens  gen_ai.usage.output_tokens  | gen_ai.usage.completion_tokens
    cached_tokens  gen_ai.usage.cache_read.input_tokens
    ttft_s         gen_ai.latency.time_to_first_token | kvledger.time_to_first_token
    request_id     gen_ai.request.id | gen_ai.response.id
    finish_reason  gen_ai.response.finish_reasons
    node           service.instance.id | host.name | service.name   (the instance)

The tenant comes from a span or resource attribute (``--tenant-attribute``) or an HTTP header
(``--tenant-header``), stored only as its keyed pseudonym. Every attribute is kept in the maps.
A body that does not decode -> 400 (OTLP's error shape), never a crash; a store writer that is
behind -> 503 with Retry-After (OTLP clients back off and retry) rather than unbounded memory.
Memory is bounded before decoding: a declared Content-Length over the limit is refused unread, the
body is read as a stream and refused the moment it passes the limit, gzip is inflated at most to
the limit (a bomb costs the limit, not its inflated size) - each a 413; JSON nested past Python's
recursion limit is a 400.
"""
from __future__ import annotations

import asyncio
import base64
import json
import operator
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fastapi import FastAPI, Request, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from engine.errors import KvledgerError
from telemetry.errors import StoreError
from telemetry.store.schema import empty, span_columns

MAX_BODY = 16 << 20            # bytes, after decompression
_TYPED = {   # column: attribute names, first present wins
    "input_tokens": ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
    "output_tokens": ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
    "cached_tokens": ("gen_ai.usage.cache_read.input_tokens",),
    "prefilled_tokens": ("kvledger.prompt_tokens.prefilled",),
    "ttft_s": ("gen_ai.latency.time_to_first_token", "kvledger.time_to_first_token"),
    "request_id": ("gen_ai.request.id", "gen_ai.response.id"),
    "finish_reason": ("gen_ai.response.finish_reasons",),
    "error_type": ("error.type",),
}
_KINDS = {0: "SPAN_KIND_UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


class BadBody(KvledgerError, ValueError):
    status = 400


class TooLarge(BadBody):
    status = 413


def inflate(body: bytes, limit: int) -> bytes:
    """gzip (one member or several) inflated to at most ``limit`` bytes: TooLarge past it, BadBody
    when it is not gzip or is cut short."""
    out, data = [], body
    size = 0
    try:
        while data:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            chunk = d.decompress(data, limit - size + 1)
            size += len(chunk)
            if size > limit or d.unconsumed_tail:
                raise TooLarge(f"the gzip body inflates past the {limit}-byte limit")
            out.append(chunk)
            if not d.eof:
                raise BadBody("Content-Encoding gzip, but the body is cut short")
            data = d.unused_data
    except zlib.error as e:
        raise BadBody(f"Content-Encoding gzip, but the body does not decompress: {e}") from None
    return b"".join(out)


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return ",".join(str(_value(x)) for x in v.array_value.values)
    if kind == "kvlist_value":
        return json.dumps({kv.key: _value(kv.value) for kv in v.kvlist_value.values})
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def _attrs(kvs) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _hexify_ids(obj) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping wants base64: convert."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                try:
                    obj[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise BadBody(f"{k} {v!r} is not hex") from None
            else:
                _hexify_ids(v)
    elif isinstance(obj, list):
        for x in obj:
            _hexify_ids(x)


def parse(body: bytes, content_type: str, encoding: str, message, limit: int = MAX_BODY):
    if encoding == "gzip":
        body = inflate(body, limit)
    elif encoding not in ("", "identity"):
        raise BadBody(f"Content-Encoding {encoding!r} is not supported (gzip or none)")
    if len(body) > limit:
        raise TooLarge(f"body of {len(body)} bytes is over the {limit}-byte limit")
    msg = message()
    if content_type.startswith("application/json"):
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadBody(f"not JSON: {e}") from None
        except RecursionError:
            raise BadBody("JSON nested too deep (past Python's recursion limit): not an OTLP body") from None
        _hexify_ids(obj)
        try:
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
        except json_format.ParseError as e:
            raise BadBody(f"not an OTLP/JSON {message.__name__}: {e}") from None
        except RecursionError:
            raise BadBody("JSON nested too deep: not an OTLP body") from None
    elif content_type.startswith("application/x-protobuf") or not content_type:
        try:
            msg.ParseFromString(body)
        except DecodeError as e:
            raise BadBody(f"not an OTLP protobuf {message.__name__}: {e}") from None
    else:
        raise BadBody(f"Content-Type {content_type!r}: send application/x-protobuf or application/json")
    return msg


_SIMPLE = frozenset(("string_value", "int_value", "double_value", "bool_value"))
_SPAN_FIELDS = operator.attrgetter("start_time_unix_nano", "end_time_unix_nano", "trace_id", "span_id",
                                   "parent_span_id", "trace_state", "name", "kind", "status", "attributes",
                                   "events", "links")
_KIND_NAMES = pa.array([_KINDS[k] for k in range(len(_KINDS))])
_INT_COLS = ("input_tokens", "output_tokens", "cached_tokens", "prefilled_tokens")


def _hex_ids(ids: list[bytes]) -> pa.Array:
    """Binary ids -> their lowercase hex as one Arrow string column, with no per-id Python string."""
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    offsets = np.zeros(len(ids) + 1, np.int32)
    np.cumsum(lens * 2, out=offsets[1:])
    return pa.StringArray.from_buffers(len(ids), pa.py_buffer(offsets), pa.py_buffer(b"".join(ids).hex().encode()))


def _list_offsets(counts) -> pa.Array:
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.array(offsets)


def _pick(n: int, owner: np.ndarray, keys: np.ndarray, values: np.ndarray, names: tuple) -> np.ndarray:
    """Per span, the value of the first of ``names`` it carries (None where it carries none)."""
    out = np.full(n, None, object)
    for name in reversed(names):             # later assignments win: the first name is assigned last
        hit = np.flatnonzero(keys == name)
        if len(hit):
            out[owner[hit]] = values[hit]
    return out


def _typed(values: np.ndarray, kind: type, arrow: pa.DataType) -> pa.Array:
    try:
        return pa.array(values, arrow, from_pandas=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError):      # e.g. a token count sent as a string
        return pa.array([None if v is None else kind(v) for v in values], arrow)


def _attr_columns(containers: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]:
    """Every attribute of every item, flattened: (owner index, keys, values, values as text, counts)."""
    counts = np.fromiter(map(len, containers), np.int64, len(containers))
    kvs = [kv for c in containers for kv in c]
    keys = [kv.key for kv in kvs]
    anys = [kv.value for kv in kvs]
    kinds = [v.WhichOneof("value") for v in anys]
    vals = [getattr(v, k) if k in _SIMPLE else _value(v) for v, k in zip(anys, kinds)]
    values = np.empty(len(vals), object)
    values[:] = vals
    owner = np.repeat(np.arange(len(containers)), counts)
    return owner, np.array(keys, object), values, list(map(str, vals)), counts


def _map_column(owner: np.ndarray, keys: np.ndarray, text: list[str], counts: np.ndarray) -> pa.Array:
    key_arr = pa.array(keys, pa.string())
    codes = key_arr.dictionary_encode().indices.to_numpy(zero_copy_only=False).astype(np.int64)
    if len(np.unique(owner * (int(codes.max(initial=0)) + 1) + codes)) != len(codes):
        # a key repeated within one span: keep it once, at its first place, with its last value (a dict's way)
        first: dict = {}
        for i, ok in enumerate(zip(owner.tolist(), keys.tolist())):
            first.setdefault(ok, [i, i])[1] = i
        keep = sorted(first.values())
        owner = owner[[a for a, _ in keep]]
        key_arr = pa.array([keys[a] for a, _ in keep], pa.string())
        text = [text[b] for _, b in keep]
        counts = np.bincount(owner, minlength=len(counts))
    return pa.MapArray.from_arrays(_list_offsets(counts), key_arr, pa.array(text, pa.string()))


def span_rows(req: ExportTraceServiceRequest, boot: str, pseudonym, tenant_attribute: str | None,
              header_tenant: str | None) -> pa.Table:
    """Column by column: one C-level attribute fetch per span, then numpy and Arrow over the columns
    (ids hexed in one call, attributes flattened once and the typed columns picked from them).
    ``pseudonym`` None leaves the tenants in clear (a decoder process, which never holds the key:
    its parent calls ``with_pseudonyms``)."""
    table = _span_rows(req, boot, tenant_attribute, header_tenant)
    return table if pseudonym is None else with_pseudonyms(table, pseudonym)


def with_pseudonyms(table: pa.Table, pseudonym) -> pa.Table:
    """``tenant_h`` from clear tenant names to their keyed pseudonyms, one HMAC per distinct tenant."""
    i = table.schema.get_field_index("tenant_h")
    enc = table.column(i).combine_chunks().dictionary_encode()
    names = pa.array([pseudonym(t) for t in enc.dictionary.to_pylist()], pa.string())
    return table.set_column(i, "tenant_h", names.take(enc.indices))


def _span_rows(req: ExportTraceServiceRequest, boot: str, tenant_attribute: str | None,
               header_tenant: str | None) -> pa.Table:
    parts = []
    for rs in req.resource_spans:
        res = _attrs(rs.resource.attributes)
        service = str(res.get("service.name", ""))
        node = str(res.get("service.instance.id") or res.get("host.name") or service)
        res_keys, res_text = list(res), [str(v) for v in res.values()]
        run = str(res.get("kvledger.boot") or boot)
        res_tenant = res.get(tenant_attribute) if tenant_attribute else None
        for ss in rs.scope_spans:
            fields = list(map(_SPAN_FIELDS, ss.spans))
            n = len(fields)
            if not n:
                continue
            (start, end, trace, span, parent, state, name, kind, status, attrs, events, links) = zip(*fields)
            owner, keys, values, text, counts = _attr_columns(attrs)
            start = np.fromiter(start, np.int64, n)
            kind = np.fromiter(kind, np.int64, n)
            c = {"Timestamp": pa.array(start, pa.timestamp("ns")), "TraceId": _hex_ids(trace), "SpanId": _hex_ids(span),
                 "ParentSpanId": _hex_ids(parent), "TraceState": pa.array(state, pa.string()),
                 "SpanName": pa.array(name, pa.string()),
                 "SpanKind": (_KIND_NAMES.take(pa.array(kind)) if kind.max() < len(_KINDS) and kind.min() >= 0 else
                              pa.array([_KINDS.get(k, str(k)) for k in kind.tolist()])),
                 "ServiceName": pa.array([service] * n, pa.string()),
                 "ResourceAttributes": pa.MapArray.from_arrays(
                     _list_offsets(np.full(n, len(res_keys))), pa.array(res_keys * n, pa.string()),
                     pa.array(res_text * n, pa.string())),
                 "ScopeName": pa.array([ss.scope.name] * n, pa.string()),
                 "ScopeVersion": pa.array([ss.scope.version] * n, pa.string()),
                 "SpanAttributes": _map_column(owner, keys, text, counts),
                 "Duration": pa.array(np.maximum(0, np.fromiter(end, np.int64, n) - start)),
                 "StatusCode": pa.array([_STATUS.get(s.code, str(s.code)) for s in status], pa.string()),
                 "StatusMessage": pa.array([s.message for s in status], pa.string())}
            if any(events):
                c["Events.Timestamp"] = pa.array([[e.time_unix_nano for e in ev] for ev in events],
                                                 pa.list_(pa.timestamp("ns")))
                c["Events.Name"] = pa.array([[e.name for e in ev] for ev in events], pa.list_(pa.string()))
            else:
                c["Events.Timestamp"] = pa.ListArray.from_arrays(_list_offsets(np.zeros(n, np.int64)),
                                                                 pa.array([], pa.timestamp("ns")))
                c["Events.Name"] = pa.ListArray.from_arrays(_list_offsets(np.zeros(n, np.int64)), pa.array([], pa.string()))
            if any(links):
                c["Links.TraceId"] = pa.array([[ln.trace_id.hex() for ln in lk] for lk in links], pa.list_(pa.string()))
                c["Links.SpanId"] = pa.array([[ln.span_id.hex() for ln in lk] for lk in links], pa.list_(pa.string()))
            else:
                empty = pa.ListArray.from_arrays(_list_offsets(np.zeros(n, np.int64)), pa.array([], pa.string()))
                c["Links.TraceId"] = c["Links.SpanId"] = empty
            for col, names in _TYPED.items():
                picked = _pick(n, owner, keys, values, names)
                c[col] = (_typed(picked, int, pa.int64()) if col in _INT_COLS else
                          _typed(picked, float, pa.float64()) if col == "ttft_s" else
                          pa.array([None if v is None else str(v) for v in picked], pa.string()))
            c["operation"] = pc.if_else(pc.is_null(c["input_tokens"]), pa.scalar(None, pa.string()), "request")
            tenants = _pick(n, owner, keys, values, (tenant_attribute,)) if tenant_attribute else np.full(n, None, object)
            fallback = res_tenant if res_tenant is not None else header_tenant
            if fallback is not None:
                tenants[np.equal(tenants, None)] = fallback
            c["tenant_h"] = pa.array([None if t is None else str(t) for t in tenants.tolist()], pa.string())
            c["node"] = pa.array([node] * n, pa.string())
            c["boot"] = pa.array([run] * n, pa.string())
            c["incarnation"] = pa.nulls(n, pa.int64())
            c["scope_h"] = c["rejected_at"] = pa.nulls(n, pa.string())
            parts.append(pa.table({k: c[k] for k in span_columns()}))
    if not parts:
        return _empty_spans()
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _empty_spans() -> pa.Table:
    return empty("spans")


def metric_rows(req: ExportMetricsServiceRequest, boot: str) -> pa.Table:
    cols: dict[str, list] = {c: [] for c in ("ts", "node", "boot", "name", "kind", "attributes", "value", "count",
                                              "sum", "bucket_counts", "boundaries")}
    for rm in req.resource_metrics:
        res = _attrs(rm.resource.attributes)
        node = str(res.get("service.instance.id") or res.get("host.name") or res.get("service.name", ""))
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                points = getattr(m, kind).data_points if kind else []
                for p in points:
                    cols["ts"].append(p.time_unix_nano)
                    cols["node"].append(node)
                    cols["boot"].append(str(res.get("kvledger.boot") or boot))
                    cols["name"].append(m.name)
                    cols["kind"].append({"sum": "sum", "gauge": "gauge"}.get(kind, "histogram"))
                    cols["attributes"].append([(k, str(v)) for k, v in _attrs(p.attributes).items()])
                    hist = kind in ("histogram", "exponential_histogram")
                    num = None if hist else (p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int))
                    cols["value"].append(num)
                    cols["count"].append(p.count if hist else None)
                    cols["sum"].append(p.sum if hist else None)
                    cols["bucket_counts"].append(list(p.bucket_counts) if kind == "histogram" else None)
                    cols["boundaries"].append(list(p.explicit_bounds) if kind == "histogram" else None)
    types = {"ts": pa.timestamp("ns"), "attributes": pa.map_(pa.string(), pa.string()), "value": pa.float64(),
             "count": pa.int64(), "sum": pa.float64(), "bucket_counts": pa.list_(pa.int64()),
             "boundaries": pa.list_(pa.float64())}
    return pa.table({k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()})


def decode(kind: str, body: bytes, content_type: str, encoding: str, boot: str, tenant_attribute: str | None,
           header_tenant: str | None) -> pa.Table:
    """An OTLP body to its rows (``kind`` traces|metrics), tenants in clear; BadBody if it does not
    decode. Module-level and free of the store's key, so a decoder process can run it."""
    if kind == "traces":
        msg = parse(body, content_type, encoding, ExportTraceServiceRequest)
        return span_rows(msg, boot, None, tenant_attribute, header_tenant)
    return metric_rows(parse(body, content_type, encoding, ExportMetricsServiceRequest), boot)


class Decoders:
    """Bodies of ``min_bytes`` or more decode on a pool of ``workers`` processes (spawned on the first
    such body), smaller ones on the event loop: protobuf to Arrow is Python-bound, and one GIL would
    cap the receiver at one core however many senders a fleet has. At most ``2 x workers`` bodies
    wait for the pool at once; beyond that the receiver answers 503 (OTLP senders back off)."""

    def __init__(self, workers: int = 0, min_bytes: int = 64 << 10):
        self.workers, self.min_bytes = workers, min_bytes
        self.pool = None
        self.in_flight = 0
        self.offloaded = 0

    def full(self, size: int) -> bool:
        return self.workers > 0 and size >= self.min_bytes and self.in_flight >= 2 * self.workers

    async def __call__(self, *args) -> pa.Table:
        body = args[1]
        if self.workers <= 0 or len(body) < self.min_bytes:
            return decode(*args)
        import asyncio
        from concurrent.futures.process import BrokenProcessPool
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        self.in_flight += 1
        try:
            self.offloaded += 1
            return await asyncio.get_running_loop().run_in_executor(self.pool, decode, *args)
        except BrokenProcessPool:        # a decoder died (OOM-killed...): this body is answered 503, the next gets a new pool
            self.pool = None
            raise
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


COMMIT_TIMEOUT = 30.0      # seconds a post waits for its rows to be durable before a 503 (the sender retries)


def build_app(writer, tenant_attribute: str | None = "tenant.id", tenant_header: str | None = None,
              decode_workers: int = 0, own_metrics_registry=None) -> FastAPI:
    """The receiver as an ASGI app writing into ``writer`` (a telemetry.store.SegmentWriter);
    ``decode_workers`` processes decode big bodies (0: all on the event loop). ``own_metrics_registry``: a
    prometheus_client registry served at ``/metrics`` (collect's own health, receivers.health)."""
    from concurrent.futures.process import BrokenProcessPool
    from contextlib import asynccontextmanager

    decoders = Decoders(decode_workers)

    @asynccontextmanager
    async def lifespan(app):
        yield
        decoders.close()

    app = FastAPI(title="kvledger OTLP receiver", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.received = {"spans": 0, "points": 0, "refused_bodies": 0, "throttled": 0, "store_failed": 0}
    app.state.decoders = decoders

    def error(status: int, text: str) -> Response:
        return Response(json.dumps({"code": {400: 3, 413: 8}.get(status, 14), "message": text}), status,
                        media_type="application/json", headers={"Retry-After": "1"} if status == 503 else None)

    async def read(request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise TooLarge(f"a body of {declared} bytes is over the {MAX_BODY}-byte limit")
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY:
                raise TooLarge(f"the body is over the {MAX_BODY}-byte limit")
            chunks.append(part)
        return b"".join(chunks)

    async def receive(request: Request, kind: str, response_cls, counter: str) -> Response:
        try:
            body = await read(request)
        except TooLarge as e:
            app.state.received["refused_bodies"] += 1
            return error(413, str(e))
        if writer.error is not None:          # never acknowledge what cannot be made durable
            app.state.received["store_failed"] += 1
            return error(503, f"the store cannot be written ({writer.error}); retry later")
        if writer.saturated or decoders.full(len(body)):
            app.state.received["throttled"] += 1
            return error(503, "the store writer is behind; retry later" if writer.saturated else
                         "every decoder is busy; retry later")
        ctype = request.headers.get("content-type", "")
        header = request.headers.get(tenant_header) if tenant_header else None
        try:
            table = await decoders(kind, body, ctype, request.headers.get("content-encoding", ""), writer.boot,
                                   tenant_attribute, header)
        except BadBody as e:
            app.state.received["refused_bodies"] += 1
            return error(e.status, str(e))
        except BrokenProcessPool:
            app.state.received["throttled"] += 1
            return error(503, "a decoder process died; retry")
        if kind == "traces":
            table = with_pseudonyms(table, writer.keys.pseudonym)
        if writer.saturated:        # filled while this body was decoded: a full queue would block the event loop
            app.state.received["throttled"] += 1
            return error(503, "the store writer is behind; retry later")
        try:        # acknowledged only once durable (group commit): a full disk is a 503, never a lost 200
            ticket = writer.commit("spans" if counter == "spans" else "metrics", table)
        except StoreError as e:
            app.state.received["store_failed"] += 1
            return error(503, f"the store cannot be written ({e}); retry later")
        if not await asyncio.to_thread(ticket.wait, COMMIT_TIMEOUT):
            app.state.received["store_failed"] += 1
            why = ticket.error or writer.error or f"not on disk within {COMMIT_TIMEOUT:g} s"
            return error(503, f"the store cannot be written ({why}); retry later")
        app.state.received[counter] += table.num_rows
        out = response_cls()
        if ctype.startswith("application/json"):
            return Response(json_format.MessageToJson(out), media_type="application/json")
        return Response(out.SerializeToString(), media_type="application/x-protobuf")

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        return await receive(request, "traces", ExportTraceServiceResponse, "spans")

    @app.post("/v1/metrics")
    async def metrics(request: Request) -> Response:
        return await receive(request, "metrics", ExportMetricsServiceResponse, "points")

    if own_metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def own_metrics() -> Response:
            return Response(generate_latest(own_metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        """200 while the store takes rows; 503 naming why once its writer has failed (a full disk...)."""
        failed = writer.error is not None
        body = {"status": "failing" if failed else "ok", "received": app.state.received,
                "written": dict(writer.rows_written), "decoded_in_workers": decoders.offloaded, "time": time.time()}
        if failed:
            body["store_error"] = str(writer.error)
        return Response(json.dumps(body), 503 if failed else 200, media_type="application/json")

    return app
