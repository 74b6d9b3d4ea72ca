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
"""
from __future__ import annotations

import base64
import gzip
import json
import time
import zlib

import pyarrow as pa
from fastapi import FastAPI, Request, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (ExportMetricsServiceRequest,
                                                                           ExportMetricsServiceResponse)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

MAX_BODY = 16 << 20            # bytes, after decompression
SPAN_COLS = ("Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
             "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
             "StatusMessage", "Events.Timestamp", "Events.Name", "Links.TraceId", "Links.SpanId", "incarnation", "node",
             "boot", "operation", "tenant_h", "scope_h", "input_tokens", "prefilled_tokens", "cached_tokens",
             "output_tokens", "ttft_s", "finish_reason", "error_type", "rejected_at", "request_id")
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


class BadBody(ValueError):
    pass


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


def parse(body: bytes, content_type: str, encoding: str, message):
    if encoding == "gzip":
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError, zlib.error) as e:
            raise BadBody(f"Content-Encoding gzip, but the body does not decompress: {e}") from None
    elif encoding not in ("", "identity"):
        raise BadBody(f"Content-Encoding {encoding!r} is not supported (gzip or none)")
    if len(body) > MAX_BODY:
        raise BadBody(f"body of {len(body)} bytes is over the {MAX_BODY}-byte limit")
    msg = message()
    if content_type.startswith("application/json"):
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadBody(f"not JSON: {e}") from None
        _hexify_ids(obj)
        try:
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
        except json_format.ParseError as e:
            raise BadBody(f"not an OTLP/JSON {message.__name__}: {e}") from None
    elif content_type.startswith("application/x-protobuf") or not content_type:
        try:
            msg.ParseFromString(body)
        except DecodeError as e:
            raise BadBody(f"not an OTLP protobuf {message.__name__}: {e}") from None
    else:
        raise BadBody(f"Content-Type {content_type!r}: send application/x-protobuf or application/json")
    return msg


def _first(a: dict, names: tuple) -> object:
    for n in names:
        v = a.get(n)
        if v is not None:
            return v
    return None


def span_rows(req: ExportTraceServiceRequest, boot: str, pseudonym, tenant_attribute: str | None,
              header_tenant: str | None) -> pa.Table:
    """Column by column, one comprehension per column over each scope's spans (a per-span loop
    with thirty appends was the receiver's bottleneck)."""
    cols: dict[str, list] = {c: [] for c in SPAN_COLS}
    for rs in req.resource_spans:
        res = _attrs(rs.resource.attributes)
        service = str(res.get("service.name", ""))
        node = str(res.get("service.instance.id") or res.get("host.name") or service)
        res_s = [(k, str(v)) for k, v in res.items()]
        run = str(res.get("kvledger.boot") or boot)
        res_tenant = res.get(tenant_attribute) if tenant_attribute else None
        for ss in rs.scope_spans:
            spans = list(ss.spans)
            n = len(spans)
            attrs = [_attrs(sp.attributes) for sp in spans]
            c = cols
            c["Timestamp"] += [sp.start_time_unix_nano for sp in spans]
            c["TraceId"] += [sp.trace_id.hex() for sp in spans]
            c["SpanId"] += [sp.span_id.hex() for sp in spans]
            c["ParentSpanId"] += [sp.parent_span_id.hex() for sp in spans]
            c["TraceState"] += [sp.trace_state for sp in spans]
            c["SpanName"] += [sp.name for sp in spans]
            c["SpanKind"] += [_KINDS.get(sp.kind, str(sp.kind)) for sp in spans]
            c["ServiceName"] += [service] * n
            c["ResourceAttributes"] += [res_s] * n
            c["ScopeName"] += [ss.scope.name] * n
            c["ScopeVersion"] += [ss.scope.version] * n
            c["SpanAttributes"] += [[(k, str(v)) for k, v in a.items()] for a in attrs]
            c["Duration"] += [max(0, sp.end_time_unix_nano - sp.start_time_unix_nano) for sp in spans]
            c["StatusCode"] += [_STATUS.get(sp.status.code, str(sp.status.code)) for sp in spans]
            c["StatusMessage"] += [sp.status.message for sp in spans]
            c["Events.Timestamp"] += [[e.time_unix_nano for e in sp.events] for sp in spans]
            c["Events.Name"] += [[e.name for e in sp.events] for sp in spans]
            c["Links.TraceId"] += [[ln.trace_id.hex() for ln in sp.links] for sp in spans]
            c["Links.SpanId"] += [[ln.span_id.hex() for ln in sp.links] for sp in spans]
            for col, names in _TYPED.items():
                vals = [_first(a, names) for a in attrs]
                if col in ("input_tokens", "output_tokens", "cached_tokens", "prefilled_tokens"):
                    vals = [None if v is None else int(v) for v in vals]
                elif col == "ttft_s":
                    vals = [None if v is None else float(v) for v in vals]
                else:
                    vals = [None if v is None else str(v) for v in vals]
                c[col] += vals
            c["operation"] += ["request" if v is not None else None for v in c["input_tokens"][-n:]] if n else []
            tenants = [a.get(tenant_attribute, res_tenant) if tenant_attribute else None for a in attrs]
            tenants = [t if t is not None else header_tenant for t in tenants]
            c["tenant_h"] += [None if t is None else pseudonym(str(t)) for t in tenants]
            c["node"] += [node] * n
            c["boot"] += [run] * n
            for col in ("incarnation", "scope_h", "rejected_at"):
                c[col] += [None] * n
    m = pa.map_(pa.string(), pa.string())
    types = {"Timestamp": pa.timestamp("ns"), "Events.Timestamp": pa.list_(pa.timestamp("ns")),
             "ResourceAttributes": m, "SpanAttributes": m, "ttft_s": pa.float64(), "Duration": pa.int64(),
             "incarnation": pa.int64(), "input_tokens": pa.int64(), "output_tokens": pa.int64(),
             "cached_tokens": pa.int64(), "prefilled_tokens": pa.int64(), "Links.TraceId": pa.list_(pa.string()),
             "Links.SpanId": pa.list_(pa.string()), "Events.Name": pa.list_(pa.string())}
    return pa.table({k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()})


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


def build_app(writer, tenant_attribute: str | None = "tenant.id", tenant_header: str | None = None) -> FastAPI:
    """The receiver as an ASGI app writing into ``writer`` (a telemetry.store.SegmentWriter)."""
    app = FastAPI(title="kvledger OTLP receiver", docs_url=None, redoc_url=None)
    app.state.received = {"spans": 0, "points": 0, "refused_bodies": 0, "throttled": 0}

    def error(status: int, text: str) -> Response:
        return Response(json.dumps({"code": 3 if status == 400 else 14, "message": text}), status,
                        media_type="application/json", headers={"Retry-After": "1"} if status == 503 else None)

    async def receive(request: Request, message, rows, response_cls, counter: str) -> Response:
        if writer.saturated:
            app.state.received["throttled"] += 1
            return error(503, "the store writer is behind; retry later")
        body = await request.body()
        ctype = request.headers.get("content-type", "")
        try:
            msg = parse(body, ctype, request.headers.get("content-encoding", ""), message)
            table = rows(msg, request)
        except BadBody as e:
            app.state.received["refused_bodies"] += 1
            return error(400, str(e))
        writer.submit("spans" if counter == "spans" else "metrics", table)
        app.state.received[counter] += table.num_rows
        out = response_cls()
        if ctype.startswith("application/json"):
            return Response(json_format.MessageToJson(out), media_type="application/json")
        return Response(out.SerializeToString(), media_type="application/x-protobuf")

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        header = request.headers.get(tenant_header) if tenant_header else None
        return await receive(request, ExportTraceServiceRequest,
                             lambda m, r: span_rows(m, writer.boot, writer.keys.pseudonym, tenant_attribute, header),
                             ExportTraceServiceResponse, "spans")

    @app.post("/v1/metrics")
    async def metrics(request: Request) -> Response:
        return await receive(request, ExportMetricsServiceRequest, lambda m, r: metric_rows(m, writer.boot),
                             ExportMetricsServiceResponse, "points")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "received": app.state.received, "written": dict(writer.rows_written),
                "time": time.time()}

    return app
