"""The OTLP/gRPC receiver (port 4317, the Collector's default): ``TraceService/Export`` and
``MetricsService/Export`` through grpcio with the official ``opentelemetry-proto`` services, into the
same rows as OTLP/HTTP (``otlp.span_rows``, ``otlp.metric_rows``).

vLLM's ``--otlp-traces-endpoint`` exports over gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
says ``http/protobuf``. The tenant may come from a span or resource attribute or from a request
metadata key (``--tenant-header``, as HTTP). A message over ``otlp.MAX_BODY`` bytes (after
decompression) is refused by grpcio itself (RESOURCE_EXHAUSTED) before it is decoded; a store writer
that is behind answers UNAVAILABLE, which OTLP exporters retry with back-off.
"""
from __future__ import annotations

from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from telemetry.errors import StoreError
from telemetry.receivers.otlp import COMMIT_TIMEOUT, MAX_BODY, metric_rows, span_rows


class _Receiver:
    def __init__(self, writer, tenant_attribute: str | None, tenant_header: str | None, received: dict):
        self.writer, self.tenant_attribute, self.received = writer, tenant_attribute, received
        self.tenant_header = tenant_header.lower() if tenant_header else None

    def _admit(self, context) -> None:
        if self.writer.error is not None:
            self.received["store_failed"] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be written ({self.writer.error}); retry later")
        if self.writer.saturated:
            self.received["throttled"] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "the store writer is behind; retry later")

    def _submit(self, context, table_name: str, table) -> None:
        try:        # acknowledged only once durable (group commit, as over HTTP)
            ticket = self.writer.commit(table_name, table)
        except StoreError as e:
            self.received["store_failed"] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be written ({e}); retry later")
        if not ticket.wait(COMMIT_TIMEOUT):
            self.received["store_failed"] += 1
            why = ticket.error or self.writer.error or f"not on disk within {COMMIT_TIMEOUT:g} s"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be written ({why}); retry later")

    def _header_tenant(self, context) -> str | None:
        if self.tenant_header is None:
            return None
        return next((v for k, v in context.invocation_metadata() if k == self.tenant_header), None)


class _Traces(_Receiver, trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):  # noqa: N802 - the service's own method name
        self._admit(context)
        table = span_rows(request, self.writer.boot, self.writer.keys.pseudonym, self.tenant_attribute,
                          self._header_tenant(context))
        self._submit(context, "spans", table)
        self.received["spans"] += table.num_rows
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(_Receiver, metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(self, request, context):  # noqa: N802
        self._admit(context)
        table = metric_rows(request, self.writer.boot)
        self._submit(context, "metrics", table)
        self.received["points"] += table.num_rows
        return metrics_service_pb2.ExportMetricsServiceResponse()


def serve_grpc(writer, host: str, port: int, tenant_attribute: str | None = "tenant.id",
               tenant_header: str | None = None, workers: int = 4) -> tuple[grpc.Server, int, dict]:
    """A started gRPC server on host:port (0: any free port): (server, the port bound, counters).
    Raises OSError when the port cannot be bound."""
    received = {"spans": 0, "points": 0, "throttled": 0, "store_failed": 0}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvledger-otlp-grpc"),
                         options=[("grpc.max_receive_message_length", MAX_BODY), ("grpc.so_reuseport", 0)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
        _Traces(writer, tenant_attribute, tenant_header, received), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
        _Metrics(writer, tenant_attribute, tenant_header, received), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"the OTLP/gRPC receiver could not listen on {address} ({e})") from None
    if not bound:
        raise OSError(f"the OTLP/gRPC receiver could not listen on {address} (in use?)")
    server.start()
    return server, bound, received
