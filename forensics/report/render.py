"""The report in the formats people send: Markdown (the source of the others), HTML with print
CSS, PDF (the HTML printed by Chromium), JSON, and CSV tables. Each Markdown section is its own
function; ``markdown`` only lays them out."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import polars as pl
from markdown_it import MarkdownIt

from engine.errors import KvledgerError
from forensics.output import CSV_TIME, HEX_IDS, IDS

FORMATS = ("all", "md", "html", "json", "pdf")
CSS = ("body{font-family:Georgia,'DejaVu Serif',serif;max-width:60em;margin:2em auto;padding:0 1em;line-height:1.45;"
       "color:#111}h1{border-bottom:2px solid #111}h2{border-bottom:1px solid #bbb;margin-top:1.6em}"
       "table{border-collapse:collapse;margin:.6em 0;font-size:.85em;max-width:100%}"
       "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top;overflow-wrap:anywhere}"
       "th{background:#f2f2f2;overflow-wrap:normal;word-break:keep-all;hyphens:none}"
       "code{font-size:.9em;white-space:nowrap}"
       "@page{size:A4;margin:14mm}"
       "@media print{body{margin:0;max-width:none;font-size:10pt}table{font-size:8pt;page-break-inside:auto}"
       "tr,th,code{break-inside:avoid}thead{display:table-header-group}h2,h3{break-after:avoid}}")
GLOSSARY = [
    ("KV cache", "the attention keys and values a model computes from each token of a request's text and keeps "
                 "while it answers; it encodes that text, though it is not the text itself. A token is a word "
                 "piece, about four characters of English."),
    ("donor / recipient", "the request whose KV cache was read / the response that read it."),
    ("read", "evidence level: the response's attention read the donor's KV cache."),
    ("surfaced", "evidence level: the response's output also repeats the donor's own text (a keyed 12-token "
                 "n-gram of the donor's prompt, in the slots the response read from it, that is neither in the "
                 "response's own prompt, nor in its tenant's other requests, nor common across tenants)."),
    ("blocked", "evidence level: the read check stopped the response at that read; nothing computed from it "
                "was returned. Not an exposure."),
    ("cache scope", "one customer account (tenant, user, organisation): the unit the engine isolates. "
                    "Tenants are store-keyed pseudonyms; the key holder maps them back (`kvledger tenants resolve`)."),
    ("canary", "a marker string the replay plants in a prompt to see whether it comes out elsewhere; its "
               "\"canaries surfaced\" counts those strings only, a narrower number than \"surfaced\" here."),
]


class RenderError(KvledgerError):
    pass


def _md_cell(v) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v))
    if isinstance(v, str) and len(v) >= 19 and v[10:11] == "T" and v[:4].isdigit() and not v.endswith("Z"):
        return v + "Z"                                  # a time from the store: UTC, and say so
    return "" if v is None else str(v)


WHOLE = IDS | HEX_IDS | {"role", "node", "prefill_node", "instance", "request_id", "guard"}   # never broken


def md_table(rows: list[dict], cols: list[str]) -> str:
    """A Markdown table; ids, pseudonyms and one-word values as code spans (``white-space: nowrap``
    in the CSS: a printed page never breaks them)."""
    if not rows:
        return "_none_\n"

    def cell(c, v) -> str:
        text = _md_cell(v).replace("|", "\\|")
        return f"`{text}`" if c in WHOLE and text and "`" not in text else text
    out = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(cell(c, r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _bullets(items) -> str:
    return "\n".join(f"- {x}" for x in items) + "\n" if items else "_none_\n"


# ---- sections ------------------------------------------------------------------------------
def _title(r: dict) -> str:
    p, n = r["provenance"], r["notification"]
    warn = f"> **{p['unverified']}**\n\n" if p.get("unverified") else ""
    return f"""# {r['title']}

{warn}| notification | |
| --- | --- |
| controller | {n['controller']} |
| data protection officer | {n['dpo_contact']} |
| supervisory authority | {n['supervisory_authority']} |
| generated | {r['generated_at']} by kvledger {p['kvledger_version']} (all times UTC) |
| evidence | store head `{p['chain_head'][:16]}` (seq {p['chain_seq']}), chain {'intact' if p['chain_ok'] else 'BROKEN'} |
"""


def _summary(r: dict) -> str:
    c, st = r["counts"], r["status_now"]
    accounts = "" if not c["cross_tenant_responses"] else (
        f" At most {c['donor_scopes']} customer account(s) (cache scopes) had their KV cache read by another "
        "customer - each may hold data about many people; the controller estimates the data subjects and records "
        "from those accounts.")
    return f"""## Summary
{r['what_happened']['summary']}

**{st['statement']}** Protections in force now: {', '.join(st['protections']) or 'none recorded'}.

| headline | another customer's | the tenant's own only |
| --- | --- | --- |
| responses that read KV of other requests | {c['cross_tenant_responses']} | {c['same_tenant_only_responses']} |
| ... whose output repeated that text (surfaced) | {c['surfaced_cross_tenant_responses']} | {c['surfaced_own_tenant_responses']} |

{accounts.strip()}
"""


def _nature(r: dict) -> str:
    c, w = r["counts"], r["window"]
    cats = _bullets(r["data_categories"]) if r["data_categories"] else "_none: no other customer's data was read_\n"
    cwe = r["what_happened"]["cwe"]
    return f"""## (a) Nature of the breach
{r['what_happened']['cause'] or r['what_happened']['summary']}

Exposure window: first foreign read {w['first_exposure'] or '-'}, last {w['last_exposure'] or '-'} (report window {w['from'] or 'start of store'} to {w['to'] or 'end of store'}).{(' Weakness classes: ' + ', '.join(f"{x['id']} ({x['name']})" for x in cwe) + '.') if cwe else ''}

Categories of data:
{cats}
Approximate numbers: {c['donor_scopes']} customer account(s) (cache scopes) whose KV cache another customer read, {c['recipient_scopes']} account(s) that received responses computed over it; {c['foreign_tokens']} tokens of KV cache read across {c['affected_responses']} response(s). Each account may hold data about many people: the controller estimates the data subjects and records from those accounts.
"""


def _contact(r: dict) -> str:
    n = r["notification"]
    return f"""## (b) Contact point
Data protection officer or other contact point: {n['dpo_contact']}. Controller: {n['controller']}. {n['note']}
"""


def _consequences(r: dict) -> str:
    return f"""## (c) Likely consequences
{r['likely_consequences']}
"""


def _measures(r: dict) -> str:
    prevented = _bullets(r["prevented"]) if r["prevented"] else "_nothing recorded_\n"
    taken = md_table(r["measures"], ["time", "measure"]) if r["measures"] else (
        "_none recorded: no guard, pool or policy changed between the runs this store holds; add operator events "
        "with `--event 'TIME WHAT'`_\n")
    return f"""## (d) Measures taken and proposed
Taken (what changed, from the store's configuration snapshots and the operator's events):

{taken}
What the guards prevented:

{prevented}
Proposed:

{_bullets(r['recommendations'])}"""


def _runs(r: dict) -> str:
    cover = "".join(f"\n> {s[0].upper() + s[1:]}.\n" for s in r["coverage"]["statements"])
    return f"""## Runs covered
{md_table(r['runs'], ['boot', 'policy', 'nodes', 'requests', 'exposed_responses', 'page_ledger', 'started_at', 'last_seen'])}{cover}
"""


def _why(r: dict) -> str:
    wh = r["what_happened"]
    return f"""## Node configuration (from config snapshots)
{md_table(wh['config_snapshots'], ['node', 'role', 'pool_tokens', 'advertised_context', 'pool_fits_context', 'preflight_action', 'policy'])}
### Requests longer than their prefill node's pool
{md_table(wh['over_pool_requests'], ['incarnation', 'tenant_h', 'arrived_at', 'prefill_node', 'prompt_tokens_billed', 'pool_tokens', 'finish_reason'])}"""


def _counts(r: dict) -> str:
    c = r["counts"]
    return f"""## Counts
| measure | count |
| --- | --- |
| affected responses | {c['affected_responses']} |
| ... that read another customer's KV | {c['cross_tenant_responses']} |
| ... that read only their own tenant's other requests' KV | {c['same_tenant_only_responses']} |
| responses whose output repeated another customer's text (surfaced) | {c['surfaced_cross_tenant_responses']} |
| responses whose output repeated the tenant's own earlier text (surfaced) | {c['surfaced_own_tenant_responses']} |
| stopped by the read check (blocked, not exposed) | {c['blocked_responses']} |
| affected responses with no end in the store (in flight or cut off: judged on what they had streamed) | {c.get('unfinished_responses', 0)} |
| recipient tenants (another customer's KV) | {c['recipient_tenants']} |
| donor tenants (KV read by another customer) | {c['donor_tenants']} |
| donor requests | {c['donor_requests']} |
| tokens of KV cache read | {c['foreign_tokens']} |
| responses billed for more prompt than was prefilled | {c['usage_dishonest_responses']} |
| KV transfers failing integrity | {c['transfers_with_integrity_failures']} |
| customer accounts (cache scopes) whose KV another customer read | {c['donor_scopes']} |
| customer accounts (cache scopes) that received such responses | {c['recipient_scopes']} |
| runs without a page ledger (their exposure unknown) | {c['runs_without_ledger']} |

"Surfaced" counts responses and any donor text; `kvledger replay` counts only the canary strings it planted, so its "canaries surfaced" is a narrower, smaller number.
"""


def _notify(r: dict) -> str:
    return f"""## Whom to notify
Tenants are store-keyed pseudonyms; the key holder maps them to customers (`kvledger tenants resolve`). Neither side is told the other's identity. Worst case first.

{md_table(r['notifications'], ['tenant', 'role', 'responses', 'statement', 'what_to_do'])}"""


def _timeline(r: dict) -> str:
    k = r["clock_72h"]
    hint = '(add an operator event such as "report received")'
    clock = (f"72-hour clock: became aware {k['became_aware'] or hint}; deadline {k['deadline'] or '-'}."
             if r["counts"]["affected_responses"] else k["note"])
    return f"""## Timeline
{md_table(r['timeline'], ['time', 'source', 'event'])}
{clock}
"""


def _fleet(r: dict) -> str:
    c, f = r["counts"], r["foreign_fleet"]
    return f"""## Foreign fleet telemetry (spans, KV events, logs)
{f['note']}

| measure | count |
| --- | --- |
| requests billed for more prompt than their instance's KV pool | {c['fleet_over_pool_requests']} |
| requests answered under the TTFT floor of their length, a prefix-cache hit ruled out | {c['fleet_below_ttft_floor_requests']} |
| as fast, but a prefix-cache hit could explain it (no cached-token count, no scrape saying otherwise) | {c['fleet_cache_hit_possible_requests']} |
| KV canary / checksum lines in the engines' logs | {c['fleet_detector_lines']} |
| block hashes stored under more than one cache scope | {c['fleet_shared_block_hashes']} |
| telemetry gaps not filled (missing data, not a clean bill) | {c['telemetry_gaps_unfilled']} |

### Requests over their instance's pool
{md_table(f['over_pool_requests'], ['instance', 'request_id', 'arrived_at', 'prompt_tokens_billed', 'pool_tokens', 'ttft_s'])}
### Engine detector lines
{md_table(f['detector_lines'], ['instance', 'kind', 'logged_at', 'line'])}"""


def _probes(r: dict) -> str:
    return f"""## External probes
`kvledger probe` runs recorded in this store (black-box checks of an endpoint by two test tenants; a finding is observed from outside, the ledger above is the proof inside):
{md_table(r['external_probes'], ['ts', 'base_url', 'check', 'verdict', 'findings', 'detail'])}"""


def _remediation(r: dict) -> str:
    rem = r["remediation"]
    return f"""## Remediation
Guards (on, checks run, failures; idle_but_on means protection that was not happening):
{md_table(rem['guards'], ['guard', 'enabled', 'checks', 'failed', 'idle_but_on'])}
Upstream fixes: {'; '.join(rem['upstream_fixes'])}.
"""


def _excerpts(r: dict) -> str:
    ex = r.get("excerpts")
    if not ex:
        return ""
    return ("## Evidence excerpts (--include-excerpts)\n" + ex["note"] + ".\n\n"
            + md_table(ex["pairs"], ["response", "donor", "evidence", "shared_ngrams"]))


def _glossary(_: dict) -> str:
    return "## Words used in this report\n" + "".join(f"- **{w}**: {d}\n" for w, d in GLOSSARY)


def _provenance(r: dict) -> str:
    p = r["provenance"]
    via = ""
    if p["engine"] != "duckdb":
        via = f"Answered by {p['engine']} from {p['answered_from']}" + (
            ": rows `kvledger export` copied there after verifying each store's signed chain; the stores themselves "
            "were not re-verified for this report." if p["engine"] == "clickhouse" else
            ", a verified mirror of the store below.")
    store = "" if p.get("engine") == "clickhouse" else (
        f"Store `{p['store']}`: chain "
        f"{'intact and signed by key ' + p['signing_key'] if p['chain_ok'] else 'BROKEN: ' + str(p['first_broken_link'])}, "
        f"{p['segments']} segments, {p['rows']} rows; computed on head `{p['chain_head']}` (seq {p['chain_seq']}), "
        + ('anchored at seq ' + str(p['anchored_seq']) + ' in ' + str(p['anchor']) if p['anchored_seq'] is not None
           else 'not checked against an anchor') + ".")
    return f"""## Provenance
{via}
{store}
Queries (SHA-256): {', '.join(f'{k} `{v[:12]}`' for k, v in p['query_sha256'].items())}.
"""


SECTIONS = [_title, _summary, _nature, _contact, _consequences, _measures, _runs, _counts, _notify, _timeline, _why,
            _fleet, _probes, _remediation, _excerpts, _glossary, _provenance]


def markdown(r: dict) -> str:
    return "\n".join(s for s in (section(r) for section in SECTIONS) if s)


def html(r: dict) -> str:
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown(r))
    return (f"<!doctype html><html lang='en'><meta charset='utf-8'><title>kvledger disclosure report</title>"
            f"<style>{CSS}</style>\n{body}</html>\n")


def chromium() -> str:
    for name in (os.environ.get("KVLEDGER_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RenderError("--format pdf prints the HTML report with Chromium, and none was found (apt-get install "
                      "chromium, or set KVLEDGER_CHROMIUM to its path)")


def pdf(html_path: Path, out: Path, timeout: float = 120) -> Path:
    """The HTML report printed to PDF by headless Chromium (A4, the print CSS above)."""
    exe = chromium()
    with tempfile.TemporaryDirectory(prefix="kvledger-pdf-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-pdf-header-footer",
               f"--user-data-dir={profile}", f"--print-to-pdf={out}", html_path.resolve().as_uri()]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RenderError(f"Chromium did not print {html_path} within {timeout:.0f} s") from None
    if p.returncode != 0 or not out.is_file() or out.stat().st_size == 0:
        raise RenderError(f"Chromium could not print {html_path} to PDF (exit {p.returncode}): "
                          f"{(p.stderr or '').strip().splitlines()[-1:] or ''}")
    return out


def _csv(rows: list[dict], path: Path) -> Path:
    df = pl.DataFrame(rows) if rows else pl.DataFrame({"empty": []})
    df = df.with_columns([pl.col(c).cast(pl.List(pl.String)).list.join(";") for c, t in df.schema.items()
                          if isinstance(t, pl.List)])
    df.write_csv(path, datetime_format=CSV_TIME)
    return path


def write(report: dict, out: str | Path, fmt: str = "all") -> list[Path]:
    """The report's files in ``out``: ``all`` (default) writes Markdown, HTML, JSON and the CSV tables;
    ``md``, ``html``, ``json`` one of them (and the CSVs); ``pdf`` everything plus ``report.pdf``."""
    if fmt not in FORMATS:
        raise RenderError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = {"report.md": lambda: markdown(report), "report.html": lambda: html(report),
             "report.json": lambda: json.dumps(report, indent=2) + "\n"}
    want = list(texts) if fmt in ("all", "pdf") else [f"report.{fmt}"]
    paths = []
    for name in want:
        (out / name).write_text(texts[name]())
        paths.append(out / name)
    if fmt == "pdf":
        paths.append(pdf(out / "report.html", out / "report.pdf"))
    tables = [("notifications.csv", report["notifications"]), ("responses.csv", report["responses"]),
              ("tenant_matrix.csv", report["tenant_matrix"])]
    if "excerpts" in report:
        tables.append(("excerpts.csv", report["excerpts"]["pairs"]))
    paths += [_csv(rows, out / name) for name, rows in tables]
    return paths
