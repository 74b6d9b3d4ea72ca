"""Receivers for telemetry a foreign fleet already emits (vLLM, SGLang): OTLP/HTTP spans
(``otlp.py``) and KV cache events over ZMQ (``kv_events.py``), into the same store."""
