"""The sentences a report sends: the summary, each tenant's notice, the measures, what the guards
prevented, whether the exposure is contained now. Every number comes from ``Evidence``; words are
chosen for the reader outside the team (a data-protection officer, a customer), one word per
concept: evidence levels ``read`` / ``surfaced`` / ``blocked``; customer account = cache scope.
"""
from __future__ import annotations

import datetime as dt

import polars as pl

from forensics.report.evidence import Evidence

KV = ("KV cache (the attention keys and values a model computes from the text of a request: they encode that "
      "text, though they are not the text itself)")
ACCOUNTS = ("each may hold data about many people; the controller estimates the data subjects and records from "
            "those accounts")
WHAT_TO_DO = {
    "donor-surfaced": "Treat the text of your requests in that period as disclosed to another customer: rotate any "
                      "credentials or secrets it held and ask us for the affected request ids.",
    "donor": "Treat the text of your requests in that period as possibly disclosed: rotate any credentials or "
             "secrets it held and ask us for the affected request ids.",
    "recipient": "Do not rely on those responses and delete any copies: they may hold another customer's data. Ask "
                 "us for their ids; re-send the requests if you need the answers.",
    "same-tenant": "Re-send those requests if their answers mattered: they may mix content of your different requests.",
}
ROLES = tuple(WHAT_TO_DO)          # worst case first


def iso(t) -> str | None:
    """Times are UTC everywhere in the store and the report; written with the zone (Z)."""
    if t is None:
        return None
    if isinstance(t, dt.datetime):
        if t.tzinfo is not None:
            t = t.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return t.isoformat() + "Z"
    return t.isoformat() if hasattr(t, "isoformat") else str(t)


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def guard_items(guards) -> list[tuple[str, bool]]:
    """A guards map as DuckDB (dict) or ClickHouse (list of pairs) returns it."""
    if isinstance(guards, dict):
        return list(guards.items())
    return [(d["key"], d["value"]) if isinstance(d, dict) else tuple(d) for d in guards or []]


def _window(e: Evidence) -> str:
    if e.start is None and e.end is None:
        return ""
    return f" between {iso(e.start) or 'the start of the store'} and {iso(e.end) or 'its end'}"


# ---- the summary ---------------------------------------------------------------------------
def summary(e: Evidence) -> str:
    if e.coverage.none:
        return ("Which pages any response read cannot be established from this store: no run it covers recorded a "
                "page ledger. " + prevented_sentence(e))
    parts = []
    if not e.any_exposure:
        parts.append(f"No response read KV cache written by another request in the runs covered{_window(e)}.")
    else:
        cross, own_only, real = e.responses(e.cross), e.own_only, e.real
        n = len(e.responses(e.exposed))
        donors = real["donor"].n_unique() if real.height else 0
        donor_tenants = e.cross["donor_tenant"].drop_nulls().n_unique()
        parts.append(
            f"{plural(n, 'response')} read {KV} written by other requests{_window(e)}: {len(cross)} read another "
            f"customer's ({int(e.cross['foreign_tokens'].sum()) if e.cross.height else 0} tokens from "
            f"{plural(donor_tenants, 'other customer')}), {len(own_only)} only their own tenant's; "
            f"{plural(donors, 'donor request')} in all.")
        parts.append(f"{len(e.surfaced_cross)} of them repeated another customer's text in their output (surfaced), "
                     f"{len(e.surfaced_own)} only the tenant's own earlier text.")
    blocked = e.responses(e.blocked)
    if blocked:
        toks = e.blocked_output_tokens()
        after = (f", after {toks[0]}" + (f"-{toks[1]}" if toks[1] != toks[0] else "") + " token(s) of their own output"
                 if toks else "")
        parts.append(f"The read check stopped {plural(len(blocked), 'more response')} at their first read of "
                     f"another request's KV{after}: nothing computed from it was returned (blocked: not an exposure).")
    if not e.any_exposure:
        prevented = prevented_sentence(e)
        if prevented:
            parts.append(prevented)
    parts += [s[0].upper() + s[1:] + "." for s in e.coverage.sentences()]
    return " ".join(parts)


def cause(e: Evidence) -> str:
    """Why, as far as the store shows it: the incident's precondition, a pool below the context."""
    if not e.any_exposure:
        return ""
    small = [r["node"] for r in e["preflight"].iter_rows(named=True) if not r["pool_fits_context"]]
    if not small:
        return ("Every node's pool fits its context length: the reads came through another path of the bug family "
                "(the kinds of each read - stale, foreign, co-holder - are in the responses table).")
    return (f"{plural(len(small), 'node')} had a KV pool smaller than the context length ({', '.join(small)}): "
            "prompts longer than the pool took a reject path that let decode attend over pages it had reserved but "
            "never received, still holding earlier requests' KV.")


def prevented(e: Evidence) -> list[str]:
    """What the guards stopped: prompts refused before any KV was reserved (where, with which error,
    how long against the smallest prefill pool of their run), reads the read check blocked."""
    out = []
    req = e.requests
    if e.start is not None:
        req = req.filter(pl.col("arrived_at") >= e.start)
    if e.end is not None:
        req = req.filter(pl.col("arrived_at") <= e.end)
    refused = req.filter(pl.col("rejected_at").is_not_null() & pl.col("error_type").is_not_null())
    pre = e["preflight"]
    pools = pre.filter(pl.col("role") != "decode").group_by("boot").agg(pl.col("pool_tokens").min()) if pre.height \
        else pl.DataFrame(schema={"boot": pl.String, "pool_tokens": pl.Int64})
    for (where, err), grp in sorted(refused.group_by(["rejected_at", "error_type"]), key=lambda g: str(g[0])):
        lo, hi = grp["prompt_tokens_billed"].min(), grp["prompt_tokens_billed"].max()
        pool = pools.filter(pl.col("boot").is_in(grp["boot"].unique().to_list()))["pool_tokens"].min()
        size = f"prompts of {lo}" + (f"-{hi}" if hi != lo else "") + " tokens"
        if pool is not None:
            size += f"; the smallest prefill pool held {pool}"
        out.append(f"{plural(grp.height, 'prompt')} refused at {where} with {err} before any KV was reserved for "
                   f"{'it' if grp.height == 1 else 'them'} ({size})")
    blocked = e.responses(e.blocked)
    if blocked:
        out.append(f"{plural(len(blocked), 'response')} stopped by the read check at their first read of another "
                   "request's KV")
    return out


def prevented_sentence(e: Evidence) -> str:
    p = prevented(e)
    return ("The guards prevented: " + "; ".join(p) + ".") if p else ""


# ---- each tenant's notice ------------------------------------------------------------------
def notices(e: Evidence) -> list[dict]:
    """One notice per tenant, its worst case first: its text appeared in another customer's output,
    its KV was read by another customer, its requests read another customer's KV, its requests read
    each other's. Neither side is told the other's identity."""
    cross, own = e.cross, e.own
    tenants = sorted(set(cross["donor_tenant"].drop_nulls()) | set(cross["response_tenant"].drop_nulls())
                     | set(own["response_tenant"].drop_nulls()))
    out = []
    for t in tenants:
        as_donor = cross.filter(pl.col("donor_tenant") == t)
        shown = as_donor.filter(pl.col("evidence") == "surfaced")
        as_recipient = cross.filter(pl.col("response_tenant") == t)
        mine = own.filter(pl.col("response_tenant") == t)
        roles = [r for r, df in zip(ROLES, (shown, as_donor, as_recipient, mine)) if df.height]
        involved = pl.concat([df for df in (as_donor, as_recipient, mine) if df.height])
        said = []
        if shown.height:
            said.append(f"Text from {plural(shown['donor'].n_unique(), 'request')} of yours appeared in the output of "
                        f"{plural(shown['response'].n_unique(), 'response')} to "
                        f"{plural(shown['response_tenant'].n_unique(), 'other customer')}.")
        if as_donor.height:
            said.append(f"{plural(as_donor['response'].n_unique(), 'response')} to "
                        f"{plural(as_donor['response_tenant'].n_unique(), 'other customer')} "
                        f"{'was' if as_donor['response'].n_unique() == 1 else 'were'} computed over the KV cache of "
                        f"{plural(as_donor['donor'].n_unique(), 'request')} of yours "
                        f"({int(as_donor['foreign_tokens'].sum())} tokens)"
                        + ("" if shown.height else "; it was read by the model, and no text of yours was found in "
                                                   "their output") + ".")
        if as_recipient.height:
            said.append(f"{plural(as_recipient['response'].n_unique(), 'response')} of yours "
                        f"{'was' if as_recipient['response'].n_unique() == 1 else 'were'} computed over other "
                        f"customers' KV cache ({int(as_recipient['foreign_tokens'].sum())} tokens): "
                        "their content may not reflect your prompts.")
        if mine.height:
            n = mine["response"].n_unique()
            lead = "Also, " if said else ""
            said.append(f"{lead}{plural(n, 'response')} of yours {'was' if n == 1 else 'were'} computed over the KV "
                        f"cache of {plural(mine['donor'].n_unique(), 'other request')} of your own "
                        f"({int(mine['foreign_tokens'].sum())} tokens)"
                        + (": no other customer's data was involved, but" if not said else ";")
                        + " those responses may mix content of your different requests.")
        first, last = iso(involved["first_read"].min()), iso(involved["last_read"].max())
        said.append(f"First read {first}, last read {last} (UTC).")
        out.append({"tenant": t, "role": roles[0], "roles": roles,
                    "responses": involved["response"].n_unique(), "first_read": first, "last_read": last,
                    "statement": " ".join(said), "what_to_do": WHAT_TO_DO[roles[0]]})
    order = {r: i for i, r in enumerate(ROLES)}
    return sorted(out, key=lambda n: (order[n["role"]], -n["responses"], n["tenant"]))


# ---- measures taken ------------------------------------------------------------------------
def measures(e: Evidence, events) -> list[dict]:
    """What changed, not the state a node ran in: between consecutive runs of a node, each guard
    turned on or off, a pool resized, a policy or preflight action changed; then the operator's
    events. The first run of a node is its starting state: not a measure."""
    out = []
    pre = e["preflight"]
    runs = e["runs"]
    if pre.height and runs.height:
        order = {b: i for i, b in enumerate(runs.sort("started_at")["boot"].to_list())}
        pre = pre.filter(pl.col("boot").is_in(list(order))).with_columns(
            pl.col("boot").replace_strict(order, return_dtype=pl.Int64).alias("_run")).sort("_run", "node")
        last: dict[str, dict] = {}
        for r in pre.iter_rows(named=True):
            before = last.get(r["node"])
            last[r["node"]] = r
            if before is None or before["boot"] == r["boot"]:
                continue
            when, where = iso(r["snapshot_at"]), f"{r['node']} (run {r['boot']})"
            g0, g1 = dict(guard_items(before["guards"])), dict(guard_items(r["guards"]))
            on = sorted(g for g, v in g1.items() if v and not g0.get(g))
            off = sorted(g for g, v in g1.items() if not v and g0.get(g))
            if on:
                out.append({"time": when, "measure": f"{where}: turned on {', '.join(on)}"})
            if off:
                out.append({"time": when, "measure": f"{where}: turned OFF {', '.join(off)}"})
            if r["pool_tokens"] != before["pool_tokens"]:
                out.append({"time": when, "measure": f"{where}: KV pool resized from {before['pool_tokens']} to "
                                                     f"{r['pool_tokens']} tokens (context {r['advertised_context']})"})
            if r["preflight_action"] != before["preflight_action"] and r["preflight_action"] == "lowered":
                out.append({"time": when, "measure": f"{where}: context lowered to fit the pool"})
    out += [{"time": iso(ev.time), "measure": ev.what} for ev in events]
    return sorted(out, key=lambda m: m["time"])


# ---- containment now -----------------------------------------------------------------------
def status_now(e: Evidence) -> dict:
    """Whether the exposure is contained now: in the latest run the store holds, every node runs the
    read check (a read of KV its reader did not write fails that one request) and no response read
    foreign KV. Protections in force are that run's switched-on guards. A latest run without a page
    ledger cannot be judged contained (its reads are unknown)."""
    runs, pre = e["runs"], e["preflight"]
    if not runs.height:
        return {"latest_run": None, "contained": None, "protections": [], "exposed_responses_in_latest_run": None,
                "statement": "This store holds no run of kvledger's engine: containment cannot be judged from it."}
    latest = runs.sort("started_at").row(-1, named=True)
    nodes = pre.filter(pl.col("boot") == latest["boot"])
    per_node = {r["node"]: dict(guard_items(r["guards"])) for r in nodes.iter_rows(named=True)}
    on = sorted({g for gs in per_node.values() for g, v in gs.items() if v})
    checked = bool(per_node) and all(gs.get("read_check") for gs in per_node.values())
    exposed = latest["exposed_responses"]
    if not checked:
        contained = False
        why = "the read check is off on " + ", ".join(n for n, gs in per_node.items() if not gs.get("read_check"))
    elif exposed is None:
        contained = None
        why = "no page ledger was recorded, so its reads are unknown"
    else:
        contained = exposed == 0
        why = ("the read check is on on every node of the latest run and no response of that run read foreign KV"
               if contained else f"{exposed} response(s) of the latest run still read foreign KV")
    word = {True: "Contained", False: "NOT contained", None: "Containment cannot be judged"}[contained]
    return {"latest_run": latest["boot"], "policy": latest["policy"], "since": iso(latest["started_at"]),
            "contained": contained, "protections": on, "exposed_responses_in_latest_run": exposed,
            "statement": f"{word} as of the latest run ({latest['boot']}, policy {latest['policy']}, started "
                         f"{iso(latest['started_at'])}): {why}."}


def likely_consequences(e: Evidence) -> str:
    if e.coverage.none:
        return "Cannot be assessed from this store: no page ledger was recorded."
    if not e.any_exposure:
        return "None shown by this store: no response read another request's KV cache."
    parts = []
    if e.surfaced_cross:
        parts.append(f"{plural(len(e.surfaced_cross), 'response')} showed another customer's text to its recipient: "
                     "that text, which may hold personal data or credentials, was disclosed.")
    if e.cross.height:
        parts.append("Responses computed over another customer's KV cache may carry fragments of that customer's "
                     "prompts in what they generated, and did not answer their own prompt faithfully.")
    if e.own_only:
        parts.append("Responses that read only their own tenant's KV disclosed nothing to another customer, but may "
                     "mix content of that tenant's different requests.")
    return " ".join(parts)
