"""``kvledger ingest-logs FILE --engine vllm|sglang``: a foreign engine's log into the store.

- capacity lines (the formats ``foreign_logs.py`` parses, thousands separators
  included) -> ``capacity``: what ``forensics fleet_impact`` compares billed prompts with;
- corruption detectors' lines -> ``engine_log_events``: a line naming the KV canary (SGLang's
  ``--kv-canary``) with a violation, mismatch or corruption, and a line naming a KV checksum
  (``--disaggregation-enable-kv-checksum``) with a mismatch or failure. These are matched by
  keywords, case-insensitively: the engines do not document one fixed wording for them (a stats
  line counting "0 violations" is not an event).
"""
from __future__ import annotations

import datetime as dt
import re
import time
from pathlib import Path

import pyarrow as pa

from engine.errors import InputError
from telemetry.receivers.foreign_logs import parse_sglang, parse_vllm

CANARY = re.compile(r"kv[ _-]?canary.*\b(violat\w*|mismatch\w*|corrupt\w*|fail\w*)", re.I)
CHECKSUM = re.compile(r"(kv[ _-]?)?checksum.*\b(mismatch\w*|fail\w*|corrupt\w*|invalid)", re.I)
QUIET = re.compile(r"\b0\s+(violations?|mismatch(es)?|failures?)\b", re.I)     # a stats line counting none
STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?)")
MAX_LINE = 500


def _when(line: str) -> int | None:
    if m := STAMP.search(line):
        try:
            t = dt.datetime.fromisoformat(m.group(1).replace(",", ".").replace(" ", "T"))
        except ValueError:
            return None
        return int(t.replace(tzinfo=dt.timezone.utc).timestamp() * 1e9)
    return None


def ingest(writer, path: str, engine: str, instance: str | None = None) -> dict:
    if engine not in ("vllm", "sglang"):
        raise InputError(f"--engine must be vllm or sglang, got {engine!r}")
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    name = instance or Path(path).stem
    caps = parse_vllm(text) if engine == "vllm" else parse_sglang(text)
    now = time.time_ns()
    if caps:
        many = len(caps) > 1
        writer.submit("capacity", pa.table({
            "instance": [f"{name}/{c.name}" if many else name for c in caps],
            "pool_tokens": pa.array([c.pool_tokens for c in caps], pa.int64()),
            "context_length": pa.array([c.context_length for c in caps], pa.int64()),
            "source": [f"{c.source}, {Path(path).name}" for c in caps],
            "ingested_at": pa.array([now] * len(caps), pa.timestamp("ns"))}))
    rows: dict[str, list] = {k: [] for k in ("instance", "kind", "line_no", "logged_at", "source_file", "line")}
    for i, line in enumerate(text.splitlines(), 1):
        kind = None if QUIET.search(line) else \
            "kv_canary" if CANARY.search(line) else "kv_checksum" if CHECKSUM.search(line) else None
        if kind:
            for k, v in (("instance", name), ("kind", kind), ("line_no", i), ("logged_at", _when(line)),
                         ("source_file", Path(path).name), ("line", line[:MAX_LINE])):
                rows[k].append(v)
    if rows["kind"]:
        writer.submit("engine_log_events", pa.table({
            **{k: rows[k] for k in ("instance", "kind", "source_file", "line")},
            "line_no": pa.array(rows["line_no"], pa.int64()),
            "logged_at": pa.array(rows["logged_at"], pa.timestamp("ns"))}))
    return {"capacity_lines": len(caps), "canary_lines": rows["kind"].count("kv_canary"),
            "checksum_lines": rows["kind"].count("kv_checksum")}
