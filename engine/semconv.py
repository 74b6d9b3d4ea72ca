"""Histogram boundaries of the OpenTelemetry GenAI semantic conventions (metrics spec, "development"),
defined once: the recorder's OTel histograms (``telemetry/otel.py``) and the server's Prometheus
histograms (``engine/server/metrics.py``) both bucket with these, so a dashboard over either agrees."""

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
