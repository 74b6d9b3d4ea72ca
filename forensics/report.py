"""The disclosure report: Markdown, HTML, JSON (validated against ``report.schema.json``) and CSV.

Structure after GDPR Art. 33(3) - nature of the breach, categories and approximate numbers of
data subjects and records, likely consequences, measures taken - and after the incident report
this project is built around (what happened and why, exact window, counts, timeline, remediation,
recommendations). Every number comes from the named queries over the store; provenance records
the store's chain head and the SHA-256 of every query file. No leaked content and no canary is
ever included: the store holds none; ``--include-excerpts`` adds the keyed n-gram evidence only.
"""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import NamedTuple

import jsonschema
import polars as pl
from markdown_it import MarkdownIt

from engine.errors import KvledgerError
from forensics.output import CSV_TIME, json_rows
from forensics.queries.clickhouse import open_forensics
from forensics.queries.duckdb import SQL_DIR, query_hashes

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


class Event(NamedTuple):
    time: dt.datetime
    what: str


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


def _rows(df: pl.DataFrame) -> list[dict]:
    return json.loads(json_rows(df))


class ReportError(KvledgerError, ValueError):
    pass


def build(store: str | Path, start: dt.datetime | None = None, end: dt.datetime | None = None,
          events: list[Event] = (), include_excerpts: bool = False, run: str | None = None,
          allow_early_awareness: bool = False, allow_unverified: bool = False,
          anchor: str | Path | None = None, engine: dict | None = None) -> dict:
    """``engine``: open_forensics's engine arguments (engine, dsn, chdb_path); default DuckDB."""
    if start is not None and end is not None and start > end:
        raise ReportError(f"--from {_iso(start)} is after --to {_iso(end)}: the window would be empty")
    fx = open_forensics(store, run, allow_unverified=allow_unverified, anchor=anchor, **(engine or {}))
    v = fx.verdict
    runs = fx.query("runs")
    ex = fx.query("exposures", start, end)
    scores = fx.query("scores", start, end)
    tenants = fx.query("tenants", start, end)
    pre = fx.query("preflight")
    guards = fx.query("guards")
    impact = fx.query("impact", start, end)
    ttft = fx.query("ttft", start, end)
    transfers = fx.query("transfers", start, end)
    releases = fx.query("releases", start, end)
    probes = fx.query("probes")
    fleet_impact = fx.query("fleet_impact", start, end)
    fleet_ttft = fx.query("fleet_ttft", start, end)
    fleet_slow = fleet_ttft.filter(pl.col("below_floor"))
    detectors = fx.query("canary")
    shared_blocks = fx.query("cache_scopes")
    gaps = fx.query("gaps")
    has_ledger = fx.rows("page_reads") > 0
    exposed = ex.filter(pl.col("severity") != "blocked")          # blocked reads returned nothing: no exposure
    blocked = ex.filter(pl.col("severity") == "blocked")
    real = exposed.filter(pl.col("donor") != -1)
    cross = real.filter(~pl.col("same_tenant"))                    # another customer's KV
    own = real.filter(pl.col("same_tenant"))                       # the tenant's own other requests' KV
    recipients = sorted(set(cross["response_tenant"].drop_nulls()))
    donors = sorted(set(cross["donor_tenant"].drop_nulls()))
    first = exposed["first_read"].min() if exposed.height else None
    last = exposed["last_read"].max() if exposed.height else None
    notify = []
    for t in donors:
        rows = cross.filter(pl.col("donor_tenant") == t)
        notify.append({"tenant": t, "role": "donor", "responses": rows["response"].n_unique(),
                       "statement": f"Your data was exposed to {rows['response'].n_unique()} response(s) of other "
                                    f"customers ({int(rows['foreign_tokens'].sum())} tokens of KV cache)."})
    for t in recipients:
        rows = cross.filter(pl.col("response_tenant") == t)
        notify.append({"tenant": t, "role": "recipient", "responses": rows["response"].n_unique(),
                       "statement": f"{rows['response'].n_unique()} of your responses were computed over other "
                                    f"customers' data ({int(rows['foreign_tokens'].sum())} tokens); their content "
                                    f"may not reflect your prompt."})
    for t in sorted(set(own["response_tenant"].drop_nulls())):
        rows = own.filter(pl.col("response_tenant") == t)
        notify.append({"tenant": t, "role": "same-tenant", "responses": rows["response"].n_unique(),
                       "statement": f"{rows['response'].n_unique()} of your responses were computed over KV cache of "
                                    f"{rows['donor'].n_unique()} other request(s) of your own "
                                    f"({int(rows['foreign_tokens'].sum())} tokens): no other customer's data was "
                                    f"involved, but those responses may mix content of your different requests."})
    timeline = [{"time": _iso(r["snapshot_at"]), "source": "store", "event": f"node {r['node']} (run {r['boot']}) "
                 f"started: pool {r['pool_tokens']} tokens vs context {r['advertised_context']} "
                 f"({r['preflight_action']}), policy {r['policy']}"}
                for r in pre.iter_rows(named=True)]
    if first is not None:
        timeline.append({"time": _iso(first), "source": "store", "event": "first foreign KV read"})
        timeline.append({"time": _iso(last), "source": "store", "event": "last foreign KV read"})
    timeline += [{"time": _iso(e.time), "source": "operator", "event": e.what} for e in events]
    timeline.sort(key=lambda e: e["time"])
    aware = min((e.time for e in events if any(k in e.what.lower() for k in ("report", "declared", "aware"))),
                default=None)
    if aware is not None and first is not None and aware < first and not allow_early_awareness:
        raise ReportError(f"awareness event at {_iso(aware)} is before the first foreign read ({_iso(first)}): "
                          "nobody can become aware of a breach before it happens; check the event's time and zone "
                          "(times without a zone are UTC), or pass --allow-early-awareness if it is right")
    clock = {"became_aware": _iso(aware),
             "deadline": _iso(aware + dt.timedelta(hours=72)) if aware else None,
             "note": "GDPR Art. 33(1): notify the supervisory authority within 72 hours of becoming aware"}
    small_pools = [r for r in pre.iter_rows(named=True) if not r["pool_fits_context"]]
    status = _status_now(runs, pre)
    req = fx.requests()
    scopes = lambda ids: req.filter(pl.col("incarnation").is_in(list(ids)))["scope_h"].drop_nulls().n_unique()  # noqa: E731
    measures = [{"time": _iso(r["snapshot_at"]), "measure": f"node {r['node']} (run {r['boot']}) running under policy "
                 f"{r['policy']}; guards on: {', '.join(g for g, on in _guard_items(r['guards']) if on) or 'none'}"}
                for r in pre.iter_rows(named=True)]
    measures += [{"time": _iso(e.time), "measure": e.what} for e in events]
    measures.sort(key=lambda m: m["time"])
    report = {
        "title": "KV cache cross-request exposure - disclosure report",
        "generated_at": _iso(dt.datetime.now(dt.timezone.utc).replace(tzinfo=None, microsecond=0)),
        "runs": _rows(runs),
        "window": {"from": _iso(start), "to": _iso(end), "first_exposure": _iso(first), "last_exposure": _iso(last)},
        "what_happened": {
            "summary": (f"{scores.height} response(s) read KV cache slots written by other requests "
                        f"({int(real['foreign_tokens'].sum()) if real.height else 0} tokens from "
                        f"{real['donor'].n_unique() if real.height else 0} donor request(s); "
                        f"{cross['response'].n_unique()} of them read another customer's KV, "
                        f"{own.filter(~pl.col('response').is_in(cross['response'].implode()))['response'].n_unique()} "
                        f"only their own tenant's). "
                        + (f"The read check stopped {blocked['response'].n_unique()} more before they returned "
                           "anything (blocked: not an exposure). " if blocked.height else "")
                        + (f"{len(small_pools)} node(s) had a KV pool smaller than the context length "
                           f"({', '.join(r['node'] for r in small_pools)}): prompts longer than the pool took a "
                           "reject path that let decode attend over pages it had reserved but never received."
                           if small_pools else "Every node's pool fits its context length.")),
            "cwe": CWE,
            "config_snapshots": _rows(pre),
            "over_pool_requests": _rows(impact),
        },
        "notification": {"controller": "[controller: legal name and address - fill in]",
                         "dpo_contact": "[data protection officer: name, email, phone - fill in]",
                         "supervisory_authority": "[lead supervisory authority - fill in]",
                         "note": "Placeholders to complete before this report is sent; kvledger does not know them."},
        "status_now": status,
        "measures": measures,
        "counts": {"affected_responses": scores.height,
                   "donor_scopes": scopes(cross["donor"].to_list()) if cross.height else 0,
                   "recipient_scopes": scopes(cross["response"].to_list()) if cross.height else 0,
                   "surfaced_responses": int(scores["surfaced"].sum()) if scores.height else 0,
                   "recipient_tenants": len(recipients), "donor_tenants": len(donors),
                   "cross_tenant_responses": cross["response"].n_unique(),
                   "same_tenant_only_responses": own.filter(
                       ~pl.col("response").is_in(cross["response"].implode()))["response"].n_unique(),
                   "blocked_responses": blocked["response"].n_unique(),
                   "donor_requests": real["donor"].n_unique() if real.height else 0,
                   "foreign_tokens": int(real["foreign_tokens"].sum()) if real.height else 0,
                   "usage_dishonest_responses": int(ttft["usage_dishonest"].sum()) if ttft.height else 0,
                   "transfers_with_integrity_failures": int((~transfers["integrity_ok"]).sum()) if transfers.height else 0,
                   "fleet_over_pool_requests": fleet_impact.height, "fleet_below_ttft_floor_requests": fleet_slow.height,
                   "fleet_cache_hit_possible_requests": int(fleet_ttft["cache_hit_possible"].sum()) if fleet_ttft.height
                   else 0,
                   "fleet_detector_lines": detectors.height, "fleet_shared_block_hashes": shared_blocks.height,
                   "telemetry_gaps_unfilled": int((~gaps["filled"]).sum()) if gaps.height else 0},
        "data_categories": ["KV cache (attention keys and values) computed from other customers' prompts and "
                            "outputs: may encode any content they sent, including personal data and credentials",
                            "derived model outputs delivered to the wrong customer"],
        "likely_consequences": "Recipients' responses may contain fragments of donors' prompts (see severity: "
                               "'surfaced' means a keyed n-gram of the donor's prompt appears in the output).",
        "notifications": notify,
        "tenant_matrix": _rows(tenants),
        "responses": _rows(scores),
        "timeline": timeline,
        "clock_72h": clock,
        "external_probes": _rows(probes),
        "foreign_fleet": {
            "note": ("" if has_ledger or not (fleet_ttft.height or detectors.height or shared_blocks.height) else
                     "This store holds telemetry from engines that keep no page ledger (vLLM, SGLang via kvledger "
                     "collect / ingest-logs): which pages a response read, and whose they were, cannot be "
                     "established from it. What it can show is below: requests billed for more prompt than their "
                     "instance's KV pool, requests answered faster than their prompt can be prefilled, the "
                     "engines' own corruption detectors, and block hashes shared across cache scopes."),
            "over_pool_requests": _rows(fleet_impact),
            "below_ttft_floor_requests": _rows(fleet_slow.select("instance", "request_id", "tenant_h",
                                                                  "prompt_tokens_billed", "ttft_s", "ttft_floor_s",
                                                                  "arrived_at")),
            "detector_lines": _rows(detectors),
            "shared_block_hashes": _rows(shared_blocks),
            "telemetry_gaps": _rows(gaps)},
        "remediation": {"guards": _rows(guards), "releases": _rows(releases), "upstream_fixes": UPSTREAM},
        "recommendations": RECOMMENDATIONS,
        "provenance": {"store": str(store), "run": run, "chain_ok": v.ok, "chain_head": v.head, "chain_seq": v.seq,
                       "signing_key": v.fingerprint, "anchor": v.anchor, "anchored_seq": v.anchor_seq,
                       "sealed": v.sealed, "segments": v.segments,
                       "rows": v.rows, "first_broken_link": v.broken, "unverified": fx.unverified_note, "kvledger_version": _version(),
                       "engine": fx.engine, "answered_from": fx.source,
                       "query_sha256": query_hashes(SQL_DIR if fx.engine == "duckdb" else SQL_DIR / "clickhouse")},
    }
    if include_excerpts:
        report["excerpts"] = {"note": "Redacted by construction: the store holds no plaintext, so an excerpt is "
                                      "the count of keyed n-grams (12 tokens each) of the donor's prompt found in "
                                      "the recipient's output, per response and donor; the text itself can be "
                                      "recovered only by the prompt's owner, who holds the n-gram key",
                              "pairs": _rows(ex.select("response", "donor", "severity", "shared_ngrams"))}
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    return report


def _iso(t) -> str | None:
    """Times are UTC everywhere in the store and the report; written with the zone (Z)."""
    if t is None:
        return None
    if isinstance(t, dt.datetime):
        if t.tzinfo is not None:
            t = t.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return t.isoformat() + "Z"
    return t.isoformat() if hasattr(t, "isoformat") else str(t)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvledger")
    except PackageNotFoundError:
        return "0+unknown"



def _guard_items(guards) -> list[tuple[str, bool]]:
    """A guards map as DuckDB (dict) or ClickHouse (list of pairs) returns it."""
    if isinstance(guards, dict):
        return list(guards.items())
    return [(d["key"], d["value"]) if isinstance(d, dict) else tuple(d) for d in guards or []]


def _status_now(runs: pl.DataFrame, pre: pl.DataFrame) -> dict:
    """Whether the exposure is contained now: in the latest run the store holds, every node runs the
    read check (a read of KV its reader did not write fails that one request) and no response read
    foreign KV. Protections in force are that run's switched-on guards."""
    if not runs.height:
        return {"latest_run": None, "contained": None, "protections": [], "exposed_responses_in_latest_run": None,
                "statement": "This store holds no run of kvledger's engine: containment cannot be judged from it."}
    latest = runs.sort("started_at").row(-1, named=True)
    nodes = pre.filter(pl.col("boot") == latest["boot"])
    per_node = {r["node"]: dict(_guard_items(r["guards"])) for r in nodes.iter_rows(named=True)}
    on = sorted({g for gs in per_node.values() for g, v in gs.items() if v})
    checked = bool(per_node) and all(gs.get("read_check") for gs in per_node.values())
    exposed = int(latest["exposed_responses"])
    contained = checked and exposed == 0
    why = ("the read check is on on every node of the latest run and no response of that run read foreign KV"
           if contained else
           "the read check is off on " + ", ".join(n for n, gs in per_node.items() if not gs.get("read_check"))
           if not checked else f"{exposed} response(s) of the latest run still read foreign KV")
    return {"latest_run": latest["boot"], "policy": latest["policy"], "since": _iso(latest["started_at"]),
            "contained": contained, "protections": on, "exposed_responses_in_latest_run": exposed,
            "statement": f"{'Contained' if contained else 'NOT contained'} as of the latest run "
                         f"({latest['boot']}, policy {latest['policy']}, started {_iso(latest['started_at'])}): {why}."}

def _md_cell(v) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v))
    if isinstance(v, str) and len(v) >= 19 and v[10:11] == "T" and v[:4].isdigit() and not v.endswith("Z"):
        return v + "Z"                                  # a time from the store: UTC, and say so
    return "" if v is None else str(v)


def _md_table(rows: list[dict], cols: list[str]) -> str:
    if not rows:
        return "_none_\n"
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(_md_cell(r.get(c, "")).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def markdown(r: dict) -> str:
    c, w, p = r["counts"], r["window"], r["provenance"]
    warn = f"> **{p['unverified']}**\n\n" if p.get("unverified") else ""
    n, st = r["notification"], r["status_now"]
    excerpts = r.get("excerpts")
    return f"""# {r['title']}

{warn}| notification | |
| --- | --- |
| controller | {n['controller']} |
| data protection officer | {n['dpo_contact']} |
| supervisory authority | {n['supervisory_authority']} |
| generated | {r['generated_at']} by kvledger {p['kvledger_version']} (all times UTC) |
| evidence | store head `{p['chain_head'][:16]}` (seq {p['chain_seq']}), chain {'intact' if p['chain_ok'] else 'BROKEN'} |

## Summary
{r['what_happened']['summary']}

**{st['statement']}** Protections in force now: {', '.join(st['protections']) or 'none recorded'}.

{c['affected_responses']} affected response(s); {c['cross_tenant_responses']} read another customer's data, from {c['donor_tenants']} donor tenant(s) ({c['donor_scopes']} donor cache scope(s): each scope is one tenant, user and organisation, so at most that many data subjects) to {c['recipient_tenants']} recipient tenant(s). The evidence follows.

## Measures taken
{_md_table(r['measures'], ['time', 'measure'])}
## Runs covered
{_md_table(r['runs'], ['boot', 'policy', 'nodes', 'requests', 'exposed_responses', 'started_at', 'last_seen'])}
## What happened and why
{r['what_happened']['summary']}

Weakness classes: {', '.join(f"{x['id']} ({x['name']})" for x in r['what_happened']['cwe'])}.

### Node configuration (from config snapshots)
{_md_table(r['what_happened']['config_snapshots'], ['node', 'role', 'pool_tokens', 'advertised_context', 'pool_fits_context', 'preflight_action', 'policy'])}
### Requests longer than their prefill node's pool
{_md_table(r['what_happened']['over_pool_requests'], ['incarnation', 'tenant_h', 'arrived_at', 'prefill_node', 'prompt_tokens_billed', 'pool_tokens', 'finish_reason'])}
## Window
First foreign read: {w['first_exposure'] or '-'}; last: {w['last_exposure'] or '-'} (report window {w['from'] or 'start of store'} to {w['to'] or 'end of store'}).

## Counts
| measure | count |
| --- | --- |
| affected responses | {c['affected_responses']} |
| responses where donor content surfaced | {c['surfaced_responses']} |
| ... of another customer's KV | {c['cross_tenant_responses']} |
| ... of their own tenant's other requests only | {c['same_tenant_only_responses']} |
| stopped by the read check (blocked, not exposed) | {c['blocked_responses']} |
| recipient tenants (cross-tenant) | {c['recipient_tenants']} |
| donor tenants (cross-tenant) | {c['donor_tenants']} |
| donor requests | {c['donor_requests']} |
| foreign KV tokens read | {c['foreign_tokens']} |
| responses billed for more prompt than was prefilled | {c['usage_dishonest_responses']} |
| KV transfers failing integrity | {c['transfers_with_integrity_failures']} |
| donor cache scopes (at most this many data subjects) | {c['donor_scopes']} |
| recipient cache scopes | {c['recipient_scopes']} |

"Surfaced" means the response's output repeats donor-specific text: a keyed 12-token n-gram of the donor's prompt that is neither in the response's own prompt nor common across tenants. It counts responses and any donor text; `kvledger replay` counts only the canary strings it planted, so its "canaries surfaced" is a narrower, smaller number.

## Data categories
{chr(10).join('- ' + d for d in r['data_categories'])}

Likely consequences: {r['likely_consequences']}

## Whom to notify
Tenants are store-keyed pseudonyms; map them to customers with the store secret's owner. Neither side is told the other's identity.

{_md_table(r['notifications'], ['tenant', 'role', 'responses', 'statement'])}
## Timeline
{_md_table(r['timeline'], ['time', 'source', 'event'])}
72-hour clock: became aware {r['clock_72h']['became_aware'] or '(add an operator event such as "report received")'}; deadline {r['clock_72h']['deadline'] or '-'}.

## Foreign fleet telemetry (spans, KV events, logs)
{r['foreign_fleet']['note']}

| measure | count |
| --- | --- |
| requests billed for more prompt than their instance's KV pool | {c['fleet_over_pool_requests']} |
| requests answered under the TTFT floor of their length, a prefix-cache hit ruled out | {c['fleet_below_ttft_floor_requests']} |
| as fast, but a prefix-cache hit could explain it (no cached-token count, no scrape saying otherwise) | {c['fleet_cache_hit_possible_requests']} |
| KV canary / checksum lines in the engines' logs | {c['fleet_detector_lines']} |
| block hashes stored under more than one cache scope | {c['fleet_shared_block_hashes']} |
| telemetry gaps not filled (missing data, not a clean bill) | {c['telemetry_gaps_unfilled']} |

### Requests over their instance's pool
{_md_table(r['foreign_fleet']['over_pool_requests'], ['instance', 'request_id', 'arrived_at', 'prompt_tokens_billed', 'pool_tokens', 'ttft_s'])}
### Engine detector lines
{_md_table(r['foreign_fleet']['detector_lines'], ['instance', 'kind', 'logged_at', 'line'])}
## External probes
`kvledger probe` runs recorded in this store (black-box checks of an endpoint by two test tenants; a finding is observed from outside, the ledger above is the proof inside):
{_md_table(r['external_probes'], ['ts', 'base_url', 'check', 'verdict', 'findings', 'detail'])}
## Remediation
Guards (on, checks run, failures; idle_but_on means protection that was not happening):
{_md_table(r['remediation']['guards'], ['guard', 'enabled', 'checks', 'failed', 'idle_but_on'])}
Upstream fixes: {'; '.join(r['remediation']['upstream_fixes'])}.

{_excerpts_md(excerpts)}## Recommendations to other operators
{chr(10).join('- ' + x for x in r['recommendations'])}

## Provenance
{f"Answered by {p['engine']} from {p['answered_from']}" + (": rows `kvledger export` copied there after verifying each store's signed chain; the stores themselves were not re-verified for this report." if p['engine'] == 'clickhouse' else ", a verified mirror of the store below.") if p['engine'] != 'duckdb' else ''}
{_store_line(p)}
Queries (SHA-256): {', '.join(f'{k} `{v[:12]}`' for k, v in p['query_sha256'].items())}.
"""



def _store_line(p: dict) -> str:
    if p.get("engine") == "clickhouse":
        return ""
    return f"Store `{p['store']}`: chain {'intact and signed by key ' + p['signing_key'] if p['chain_ok'] else 'BROKEN: ' + str(p['first_broken_link'])}, {p['segments']} segments, {p['rows']} rows; computed on head `{p['chain_head']}` (seq {p['chain_seq']}), {'anchored at seq ' + str(p['anchored_seq']) + ' in ' + str(p['anchor']) if p['anchored_seq'] is not None else 'not checked against an anchor'}."

def _excerpts_md(ex: dict | None) -> str:
    if not ex:
        return ""
    return ("## Evidence excerpts (--include-excerpts)\n" + ex["note"] + ".\n\n"
            + _md_table(ex["pairs"], ["response", "donor", "severity", "shared_ngrams"]) + "\n")


def write(report: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(report)
    files = {"report.md": md, "report.json": json.dumps(report, indent=2) + "\n",
             "report.html": "<!doctype html><meta charset='utf-8'><title>kvledger disclosure report</title>"
                            "<style>body{font-family:Georgia,'DejaVu Serif',serif;max-width:60em;margin:2em auto;"
                            "padding:0 1em;line-height:1.45;color:#111}h1{border-bottom:2px solid #111}"
                            "h2{border-bottom:1px solid #bbb;margin-top:1.6em}table{border-collapse:collapse;"
                            "margin:.6em 0;font-size:.85em;max-width:100%}td,th{border:1px solid #ccc;padding:2px 6px;"
                            "text-align:left;vertical-align:top;overflow-wrap:anywhere}th{background:#f2f2f2}"
                            "code{font-size:.9em}@media print{body{margin:0}}</style>\n"
                            + MarkdownIt("commonmark", {"html": False}).enable("table").render(md)}
    paths = []
    for name, text in files.items():
        (out / name).write_text(text)
        paths.append(out / name)
    tables = [("notifications.csv", report["notifications"]), ("responses.csv", report["responses"]),
              ("tenant_matrix.csv", report["tenant_matrix"])]
    if "excerpts" in report:
        tables.append(("excerpts.csv", report["excerpts"]["pairs"]))
    for name, rows in tables:
        df = pl.DataFrame(rows) if rows else pl.DataFrame({"empty": []})
        df = df.with_columns([pl.col(c).cast(pl.List(pl.String)).list.join(";") for c, t in df.schema.items()
                              if isinstance(t, pl.List)])
        df.write_csv(out / name, datetime_format=CSV_TIME)
        paths.append(out / name)
    return paths
