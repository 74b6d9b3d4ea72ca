"""``build``: the report as one JSON-ready dict (validated against ``report.schema.json``), its
sections laid out after GDPR Art. 33(3): (a) the nature of the breach, the categories and the
approximate numbers of accounts and records, (b) the contact point, (c) the likely consequences,
(d) the measures taken and proposed - then the evidence. Every number comes from ``Evidence``."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import NamedTuple

import jsonschema
import polars as pl

import forensics.report.sentences as say
from engine.errors import KvledgerError
from forensics.queries import open_forensics
from forensics.queries.duckdb import SQL_DIR, query_hashes
from forensics.report.evidence import Evidence, gather, rows

SCHEMA = Path(__file__).with_name("report.schema.json")
CWE = [{"id": "CWE-226", "name": "Sensitive Information in Resource Not Removed Before Reuse"},
       {"id": "CWE-908", "name": "Use of Uninitialized Resource"}]
UPSTREAM = ["SGLang v0.5.20: a rejected request is retired before bootstrap with its original error; admission "
            "queues check one terminal predicate",
            "decode verifies that the landed slot set equals the reserved set before generating",
            "per-transfer checksums in logical token order, verified before generation",
            "deferred release of transfer pages until in-flight writes drain",
            "read-time provenance check (generation + content tag per KV slot)"]
RECOMMENDATIONS = ["Size every node's KV pool to at least the advertised context length, or lower the context "
                   "(`kvledger preflight` exits non-zero otherwise).",
                   "Turn on every hardened guard and watch their liveness: a guard that is on but runs no checks "
                   "protects nothing.",
                   "Record page reads and writes in both policies: protection and recording are separate, and "
                   "forensics works only on what was recorded.",
                   "Alert on usage honesty (billed prompt tokens > prefilled + cached) and on TTFT below the "
                   "prefill floor: they were the visible symptoms of this incident."]
AWARE_WORDS = ("report", "declared", "aware")


class Event(NamedTuple):
    time: dt.datetime
    what: str


class ReportError(KvledgerError, ValueError):
    pass


def parse_event(text: str) -> Event:
    """'2026-09-01T10:00 report received' -> Event."""
    when, _, what = text.partition(" ")
    try:
        t = dt.datetime.fromisoformat(when)
    except ValueError:
        raise ValueError(f"event {text!r}: expected 'ISO-TIME what happened', e.g. '2026-09-01T10:00 report received'") from None
    if not what.strip():
        raise ValueError(f"event {text!r} says when but not what happened")
    return Event(t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t, what.strip())


def build(store: str | Path, start: dt.datetime | None = None, end: dt.datetime | None = None,
          events: list[Event] = (), include_excerpts: bool = False, run: str | None = None,
          allow_early_awareness: bool = False, allow_unverified: bool = False,
          anchor: str | Path | None = None, engine: dict | None = None) -> dict:
    """``engine``: open_forensics's engine arguments (engine, dsn, chdb_path); default DuckDB."""
    if start is not None and end is not None and start > end:
        raise ReportError(f"--from {say.iso(start)} is after --to {say.iso(end)}: the window would be empty")
    fx = open_forensics(store, run, allow_unverified=allow_unverified, anchor=anchor, **(engine or {}))
    e = gather(fx, start, end)
    report = {
        "title": "KV cache cross-request exposure - disclosure report",
        "generated_at": say.iso(dt.datetime.now(dt.timezone.utc).replace(tzinfo=None, microsecond=0)),
        "runs": rows(e["runs"]),
        "window": {"from": say.iso(start), "to": say.iso(end), "first_exposure": say.iso(e.first_read),
                   "last_exposure": say.iso(e.last_read)},
        "coverage": {"runs_without_ledger": e.coverage.without_ledger, "statements": e.coverage.sentences()},
        "what_happened": {"summary": say.summary(e), "cause": say.cause(e), "cwe": CWE if e.any_exposure else [],
                          "config_snapshots": rows(e["preflight"]), "over_pool_requests": rows(e["impact"])},
        "notification": {"controller": "[controller: legal name and address - fill in]",
                         "dpo_contact": "[data protection officer: name, email, phone - fill in]",
                         "supervisory_authority": "[lead supervisory authority - fill in]",
                         "note": "Placeholders to complete before this report is sent; kvledger does not know them."},
        "status_now": say.status_now(e),
        "measures": say.measures(e, events),
        "prevented": say.prevented(e),
        "counts": _counts(e),
        "data_categories": _categories(e),
        "likely_consequences": say.likely_consequences(e),
        "notifications": say.notices(e),
        "tenant_matrix": rows(e["tenants"]),
        "responses": rows(e["scores"]),
        "timeline": _timeline(e, events),
        "clock_72h": _clock(e, events, allow_early_awareness),
        "external_probes": rows(e["probes"]),
        "foreign_fleet": _fleet(e),
        "remediation": {"guards": rows(e["guards"]), "releases": rows(e["releases"]), "upstream_fixes": UPSTREAM},
        "recommendations": RECOMMENDATIONS,
        "provenance": _provenance(fx, store, run),
    }
    if include_excerpts:
        report["excerpts"] = {"note": "Redacted by construction: the store holds no plaintext, so an excerpt is "
                                      "the count of keyed n-grams (12 tokens each) of the donor's prompt found in "
                                      "the recipient's output, per response and donor; the text itself can be "
                                      "recovered only by the prompt's owner, who holds the n-gram key",
                              "pairs": rows(e["exposures"].select("response", "donor", "evidence", "shared_ngrams"))}
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    return report


def _counts(e: Evidence) -> dict:
    cross, real, ttft, tr = e.cross, e.real, e["ttft"], e["transfers"]
    fleet_ttft, gaps = e["fleet_ttft"], e["gaps"]
    return {"affected_responses": len(e.responses(e.exposed)),
            "cross_tenant_responses": len(e.responses(cross)),
            "same_tenant_only_responses": len(e.own_only),
            "surfaced_responses": len(e.surfaced_cross | e.surfaced_own),
            "surfaced_cross_tenant_responses": len(e.surfaced_cross),
            "surfaced_own_tenant_responses": len(e.surfaced_own),
            "blocked_responses": len(e.responses(e.blocked)),
            "unfinished_responses": len(e.responses(e.exposed.filter(pl.col("response_state") != "finished")))
            if "response_state" in e.exposed.columns else 0,
            "donor_scopes": e.scopes(cross["donor"].to_list()),
            "recipient_scopes": e.scopes(cross["response"].to_list()),
            "recipient_tenants": cross["response_tenant"].drop_nulls().n_unique(),
            "donor_tenants": cross["donor_tenant"].drop_nulls().n_unique(),
            "donor_requests": real["donor"].n_unique() if real.height else 0,
            "foreign_tokens": int(real["foreign_tokens"].sum()) if real.height else 0,
            "usage_dishonest_responses": int(ttft["usage_dishonest"].sum()) if ttft.height else 0,
            "transfers_with_integrity_failures": int((~tr["integrity_ok"]).sum()) if tr.height else 0,
            "runs_without_ledger": len(e.coverage.without_ledger),
            "fleet_over_pool_requests": e["fleet_impact"].height,
            "fleet_below_ttft_floor_requests": fleet_ttft.filter(pl.col("below_floor")).height,
            "fleet_cache_hit_possible_requests": int(fleet_ttft["cache_hit_possible"].sum()) if fleet_ttft.height else 0,
            "fleet_detector_lines": e["canary"].height, "fleet_shared_block_hashes": e["cache_scopes"].height,
            "telemetry_gaps_unfilled": int((~gaps["filled"]).sum()) if gaps.height else 0}


def _categories(e: Evidence) -> list[str]:
    if not e.cross.height:
        return []
    return ["KV cache (attention keys and values) computed from other customers' prompts and outputs: may encode "
            "any content they sent, including personal data and credentials",
            "derived model outputs delivered to the wrong customer"]


def _timeline(e: Evidence, events) -> list[dict]:
    out = [{"time": say.iso(r["snapshot_at"]), "source": "store", "event": f"node {r['node']} (run {r['boot']}) "
            f"started: pool {r['pool_tokens']} tokens vs context {r['advertised_context']} "
            f"({r['preflight_action']}), policy {r['policy']}"}
           for r in e["preflight"].iter_rows(named=True)]
    if e.first_read is not None:
        out.append({"time": say.iso(e.first_read), "source": "store", "event": "first foreign KV read"})
        out.append({"time": say.iso(e.last_read), "source": "store", "event": "last foreign KV read"})
    out += [{"time": say.iso(ev.time), "source": "operator", "event": ev.what} for ev in events]
    return sorted(out, key=lambda x: x["time"])


def _clock(e: Evidence, events, allow_early: bool) -> dict:
    """The 72-hour clock runs from awareness of a breach: none when the store shows none."""
    if not e.any_exposure:
        return {"became_aware": None, "deadline": None,
                "note": "This store shows no exposure of one customer's data to another: no 72-hour notification "
                        "clock is started by it (GDPR Art. 33(1) applies once a breach is known)."
                        if not e.coverage.none else
                        "No page ledger was recorded: whether a breach happened cannot be established from this "
                        "store, so it starts no clock; assess it from other evidence."}
    aware = min((ev.time for ev in events if any(k in ev.what.lower() for k in AWARE_WORDS)), default=None)
    first = e.first_read
    if aware is not None and first is not None and aware < first and not allow_early:
        raise ReportError(f"awareness event at {say.iso(aware)} is before the first foreign read ({say.iso(first)}): "
                          "nobody can become aware of a breach before it happens; check the event's time and zone "
                          "(times without a zone are UTC), or pass --allow-early-awareness if it is right")
    return {"became_aware": say.iso(aware), "deadline": say.iso(aware + dt.timedelta(hours=72)) if aware else None,
            "note": "GDPR Art. 33(1): notify the supervisory authority within 72 hours of becoming aware"}


def _fleet(e: Evidence) -> dict:
    fleet_ttft, detectors, shared = e["fleet_ttft"], e["canary"], e["cache_scopes"]
    has_ledger = e["runs"].height > 0 and not e.coverage.none
    slow = fleet_ttft.filter(pl.col("below_floor"))
    return {"note": ("" if has_ledger or not (fleet_ttft.height or detectors.height or shared.height) else
                     "This store holds telemetry from engines that keep no page ledger (vLLM, SGLang via kvledger "
                     "collect / ingest-logs): which pages a response read, and whose they were, cannot be "
                     "established from it. What it can show is below: requests billed for more prompt than their "
                     "instance's KV pool, requests answered faster than their prompt can be prefilled, the "
                     "engines' own corruption detectors, and block hashes shared across cache scopes."),
            "over_pool_requests": rows(e["fleet_impact"]),
            "below_ttft_floor_requests": rows(slow.select("instance", "request_id", "tenant_h", "prompt_tokens_billed",
                                                          "ttft_s", "ttft_floor_s", "arrived_at")),
            "detector_lines": rows(detectors), "shared_block_hashes": rows(shared), "telemetry_gaps": rows(e["gaps"])}


def _provenance(fx, store, run) -> dict:
    v = fx.verdict
    return {"store": str(store), "run": run, "chain_ok": v.ok, "chain_head": v.head, "chain_seq": v.seq,
            "signing_key": v.fingerprint, "anchor": v.anchor, "anchored_seq": v.anchor_seq, "sealed": v.sealed,
            "segments": v.segments, "rows": v.rows, "first_broken_link": v.broken, "unverified": fx.unverified_note,
            "kvledger_version": _version(), "engine": fx.engine, "answered_from": fx.source,
            "query_sha256": query_hashes(SQL_DIR if fx.engine == "duckdb" else SQL_DIR / "clickhouse")}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvledger")
    except PackageNotFoundError:
        return "0+unknown"
