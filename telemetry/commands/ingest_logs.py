"""``kvledger ingest-logs FILE --format vllm|sglang``: a foreign engine's capacity, KV canary and
KV checksum lines into a store."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.commands.options import add_store, check_writable_store
from engine.errors import InputError


@dataclass(frozen=True, slots=True)
class IngestConfig:
    file: str
    engine: str
    store: str = "kvledger-store"
    instance: str | None = None


def add_arguments(il) -> None:
    il.add_argument("file", help="the engine's log file")
    il.add_argument("--format", "--engine", dest="engine", required=True, choices=["vllm", "sglang"],
                    help="which engine's log format: vllm or sglang (--engine: the old name, kept; required)")
    add_store(il, "the store to write")
    il.add_argument("--instance", default=None,
                    help="the instance's name, as its spans' service.instance.id (default: the file's name "
                         "without extension)")


def make_config(a) -> IngestConfig:
    check_writable_store(a.store)
    if not Path(a.file).is_file():
        raise InputError(f"{a.file}: no such log file")
    return IngestConfig(a.file, a.engine, a.store, a.instance)


def run(c: IngestConfig) -> int:
    from telemetry.receivers.logs import ingest
    from telemetry.store import SegmentWriter
    writer = SegmentWriter(c.store)
    try:
        got = ingest(writer, c.file, c.engine, c.instance)
    finally:
        writer.close()
    print(f"kvledger ingest-logs: {c.file}: {got['capacity_lines']} capacity line(s), {got['canary_lines']} "
          f"KV canary line(s), {got['checksum_lines']} KV checksum line(s) into {c.store} (run {writer.boot})")
    return 0
