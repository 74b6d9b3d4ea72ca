"""``kvledger report``: the disclosure report (Markdown, HTML, PDF, JSON validated by its schema, CSV)."""
from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.commands.options import add_store, timestamp
from engine.errors import InputError
from forensics.commands.options import EngineChoice, add_engine_options, add_verify_options, engine_choice


@dataclass(frozen=True, slots=True)
class ReportConfig:
    store: str
    out: str
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    run: str | None = None
    events: tuple = ()                   # forensics.report.Event, parsed
    allow_unverified: bool = False
    anchor: str | None = None
    allow_early_awareness: bool = False
    include_excerpts: bool = False
    format: str = "all"
    engine: EngineChoice = EngineChoice()


def add_arguments(rp) -> None:
    add_store(rp, "the store to report on")
    rp.add_argument("--from", dest="start", type=timestamp, default=None, help="window start: ISO 8601 (UTC), or relative such as now-15m, 2h, 7d (default: the store's beginning)")
    rp.add_argument("--to", dest="end", type=timestamp, default=None, help="window end: ISO 8601 (UTC), or relative such as now-5m (default: now)")
    rp.add_argument("--out", required=True, help="output directory")
    rp.add_argument("--run", metavar="BOOT", default=None,
                    help="report on one run only (a boot id or a unique prefix; default: every run in the store)")
    rp.add_argument("--event", action="append", default=[], metavar="'TIME WHAT'",
                    help="an operator event for the timeline, e.g. '2026-09-01T10:00 report received' (repeatable; "
                         "a time without a zone is UTC); an event naming a report, declaration or awareness starts "
                         "the 72-hour clock")
    add_verify_options(rp, "report on a store that does not verify (the report says so on every page; exit 1)")
    rp.add_argument("--allow-early-awareness", action="store_true",
                    help="accept an awareness event earlier than the first foreign read (refused by default: "
                         "usually a wrong time or zone)")
    rp.add_argument("--format", choices=["all", "md", "html", "json", "pdf"], default="all",
                    help="all (default: report.md, report.html, report.json and the CSV tables), one of md, html, "
                         "json (with the CSVs), or pdf (everything plus report.pdf, printed by Chromium)")
    rp.add_argument("--include-excerpts", action="store_true",
                    help="add the keyed n-gram evidence per exposure (the store holds no plaintext)")
    add_engine_options(rp)


def make_config(a) -> ReportConfig:
    from forensics.report import parse_event
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise InputError(f"--out {a.out} exists and is not a directory (the report writes several files into one)")
    engine = engine_choice(a)
    try:
        events = tuple(parse_event(e) for e in a.event)
    except ValueError as e:
        raise InputError(str(e)) from None
    return ReportConfig(a.store, a.out, a.start, a.end, a.run, events, a.allow_unverified, a.anchor,
                        a.allow_early_awareness, a.include_excerpts, a.format, engine)


def run(c: ReportConfig) -> int:
    from forensics.report import build, write
    try:
        report = build(c.store, c.start, c.end, list(c.events), c.include_excerpts, run=c.run,
                       allow_early_awareness=c.allow_early_awareness, allow_unverified=c.allow_unverified,
                       anchor=c.anchor, engine=c.engine.kwargs())
    except ValueError as e:
        raise InputError(str(e)) from None
    if c.format == "pdf":
        from forensics.report.render import chromium
        chromium()                          # no Chromium: say so before anything is written
    for p in write(report, c.out, c.format):
        print(p)
    n = report["counts"]
    print(f"{n['affected_responses']} affected response(s) ({n['cross_tenant_responses']} another customer's KV, "
          f"{n['same_tenant_only_responses']} their own tenant's only), {n['recipient_tenants']} recipient and "
          f"{n['donor_tenants']} donor tenant(s); chain {'intact' if report['provenance']['chain_ok'] else 'BROKEN'}",
          file=sys.stderr)
    for s in report["coverage"]["statements"]:
        print(f"kvledger: warning: {s}", file=sys.stderr)
    return 0 if report["provenance"]["chain_ok"] else 1
