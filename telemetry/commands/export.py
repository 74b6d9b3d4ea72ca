"""``kvledger export``: the store into ClickHouse (a server, or embedded chdb), idempotent per
segment; ``--follow`` keeps copying a live store until SIGTERM/SIGINT."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from engine.commands.options import add_store
from engine.commands.options import check_range
from engine.errors import InputError


@dataclass(frozen=True, slots=True)
class ExportConfig:
    to: str | None
    store: str
    follow: bool = False
    interval: float = 2.0
    anchor: str | None = None
    print_ddl: bool = False
    database: str = "kvledger"
    cluster: str | None = None


def add_arguments(ex) -> None:
    ex.add_argument("--to", default=None, metavar="URL",
                    help="clickhouse://[USER[:PASSWORD]@]HOST[:8123]/DATABASE, clickhouses://... (HTTPS), or "
                         "chdb:DIR[?db=NAME] (embedded ClickHouse, database kvledger by default)")
    add_store(ex, "the store to copy")
    ex.add_argument("--follow", action="store_true",
                    help="keep copying new segments every --interval seconds until SIGTERM/SIGINT")
    ex.add_argument("--interval", type=float, default=2.0, help="--follow: seconds between passes (default 2)")
    ex.add_argument("--anchor", default=None, metavar="PATH", help="the anchor to verify against (see kvledger verify)")
    ex.add_argument("--print-ddl", action="store_true",
                    help="print the ClickHouse DDL (generated from schema.sql) and exit; nothing is copied")
    ex.add_argument("--database", default="kvledger", help="--print-ddl: the database name (default kvledger)")
    ex.add_argument("--cluster", default=None, metavar="NAME",
                    help="--print-ddl: the cluster variant (ReplicatedMergeTree shards behind Distributed tables)")


def make_config(a) -> ExportConfig:
    c = ExportConfig(a.to, a.store, a.follow, a.interval, a.anchor, a.print_ddl, a.database, a.cluster)
    if c.print_ddl:
        return c
    if not c.to:
        raise InputError("export needs --to clickhouse://HOST:8123/DATABASE (or chdb:PATH for embedded ClickHouse)")
    check_range("--interval", c.interval, 0.1, 86400, " seconds")
    if not (Path(c.store) / "chain").is_dir():
        raise InputError(f"no kvledger store at {c.store} (expected {c.store}/chain)")
    return c


def run(c: ExportConfig) -> int:
    from telemetry.clickhouse import connect, ddl
    if c.print_ddl:
        print(";\n\n".join(ddl(c.database, c.cluster)) + ";")
        return 0
    target = connect(c.to)
    try:
        return _copy(c, target)
    finally:
        target.close()


def _copy(c: ExportConfig, target) -> int:
    import signal
    import threading

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from telemetry.clickhouse import export
    err = Console(stderr=True)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)} if c.follow else {}
    cache: dict = {}
    try:
        while True:
            with Progress(TextColumn("export"), BarColumn(), MofNCompleteColumn(), TextColumn("segments"),
                          TextColumn("{task.fields[rows]:,} rows"), TimeRemainingColumn(), console=err,
                          transient=True) as bar:
                task = bar.add_task("export", total=None, rows=0)
                res = export(c.store, target, anchor=c.anchor, cache=cache,
                             progress=lambda done, total, rows: bar.update(task, completed=done, total=total, rows=rows))
            if res["segments"] or not c.follow:
                print(f"exported {res['segments']} segment(s), {res['rows']:,} rows of store {res['store_id']} to "
                      f"{target.url} ({res['skipped']} already there; head {res['head'][:16]} at seq {res['seq']})",
                      file=sys.stderr, flush=True)
            if not c.follow or stop.wait(c.interval):
                return 0
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
