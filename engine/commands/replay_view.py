"""What ``kvledger replay`` prints: the pools, the requests, who read whose KV (by the oracle)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import Progress
from rich.table import Table


def with_progress(title: str, work, unit: str = "requests"):
    """Run ``work(progress)`` under a progress bar on stderr: ``progress(n)`` n more ``unit`` done,
    ``progress(0, total=N)`` says how many there are (a count and a percentage, not a pulse)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, SpinnerColumn, TaskProgressColumn, TextColumn,
                               TimeElapsedColumn)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn(unit), TaskProgressColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=None)

        def progress(n: int, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            bar.advance(task, n)
        return work(progress)


def print_json(res, store: str | None) -> None:
    """The replay as one JSON object (ids as decimal strings, as everywhere)."""
    import json
    donors = res.readers_of_foreign
    reqs = [{"incarnation": str(r.incarnation), "tenant": r.tenant, "prompt_tokens": len(r.prompt_ids),
             "prompt_tokens_billed": r.prompt_tokens_billed, "completion_tokens": len(r.output_ids),
             "outcome": "error" if r.error is not None else (r.finish_reason or "unfinished"),
             "error": str(r.error) if r.error is not None else None,
             "over_pool": any(r is o for o in res.over_pool),
             "foreign_slots_read": len(res.exposures.get(r.incarnation, [])),
             "donors": sorted(str(d) for d in donors.get(r.incarnation, ())),
             "blocked": r.incarnation in res.blocked} for r in res.requests]
    print(json.dumps({"scenario": res.scenario, "policy": res.policy, "mode": res.mode, "context": res.context,
                      "pools": res.pools, "requests": reqs,
                      "responses_reading_foreign_kv": sum(1 for r in reqs if r["donors"]),
                      "canaries_planted": len(res.canaries), "canaries_leaked": len(res.surfaced),
                      "pages_balanced": res.pages_balanced,
                      "free_pages": {n: {"free": f, "total": t} for n, (f, t) in res.free_pages.items()},
                      "store": store, "telemetry": res.telemetry}, default=str))


def _store_line(res, store: str | None, detail: bool) -> str | None:
    if res.telemetry is None:
        return None
    tm = res.telemetry
    rows = (f" ({tm['rows']['page_reads']} page-read runs, {tm['rows']['page_writes']} page-write runs, "
            f"{tm['spans_exported']} spans, {tm['spans_dropped']} dropped)" if detail else "")
    return (f"store {store}: {tm['segments']} segments, {sum(tm['rows'].values())} rows{rows}; "
            f"next: kvledger forensics exposures --store {store}")


def print_glm53(res, store: str | None) -> None:
    con = Console()
    t = Table(title=f"kvledger replay glm53: policy={res.policy}, mode={res.mode}, context={res.context}")
    t.add_column("node")
    t.add_column("KV pool (tokens)", justify="right")
    t.add_column("vs context", justify="right")
    for node, cap in res.pools.items():
        t.add_row(node, str(cap), ("[red]" if cap < res.context else "[green]") + f"{cap / res.context:.3f}")
    con.print(t)
    ok = [r for r in res.requests if r.error is None]
    con.print(f"requests: {len(res.requests)}  served: {len(ok)}  errors: {len(res.requests) - len(ok)}  "
              f"longer than their prefill pool: {len(res.over_pool)}  "
              f"pool free counts back to initial: {res.pages_balanced}")
    rt = Table(title="requests longer than their prefill node's pool")
    rt.add_column("incarnation", no_wrap=True, min_width=19)       # decimal, as in the store: never cut short
    for c in ("prompt tokens (billed)", "outcome", "foreign slots read (oracle)", "donors"):
        rt.add_column(c)
    for r in res.over_pool:
        foreign = [e for e in res.exposures.get(r.incarnation, []) if e.donor != r.incarnation]
        outcome = f"[red]error: {r.error}" if r.error else f"HTTP 200, {len(r.output_ids)} tokens, TTFT {r.ttft * 1e3:.0f} ms"
        rt.add_row(str(r.incarnation), str(r.prompt_tokens_billed), outcome, str(len(foreign)),
                   str(len({e.donor for e in foreign})))
    con.print(rt)
    con.print(f"responses that read foreign slots: [bold]{len(res.foreign_readers)}[/]  "
              f"(oracle: clean re-run of each response's own tokens vs what it read)")
    served_over = [r for r in res.over_pool if r.error is None]
    rate = len({i for i, _, _ in res.surfaced}) / len(served_over) if served_over else 0.0
    con.print(f"canaries planted: {len(res.canaries)}; leaked into another tenant's output: {len(res.surfaced)} "
              f"(the replay's own string check, {rate:.0%} of served over-pool responses; forensics' `surfaced` "
              "is the store's n-gram evidence)")
    for inc, tenant, canary in res.surfaced:
        con.print(f"  {canary} (tenant {res.canaries[canary]}) -> response {inc} of tenant {tenant}")
    if (line := _store_line(res, store, detail=True)):
        con.print(line)


def print_fault(res, store: str | None) -> None:
    from engine.replay import FAULTS
    con = Console()
    con.print(f"[bold]kvledger replay {res.scenario}[/]: {FAULTS[res.scenario]}")
    con.print(f"policy={res.policy}, mode={res.mode}, triggering event: {'yes' if res.triggered else 'no (--no-trigger)'}")
    t = Table(title="requests (foreign slots judged by the oracle: clean re-run of each response's own tokens)")
    t.add_column("incarnation", no_wrap=True, min_width=19)        # decimal, as in the store: never cut short
    for c in ("tenant", "prompt tokens", "outcome", "foreign slots read", "donors"):
        t.add_column(c)
    for r in res.requests:
        ex = [e for e in res.exposures.get(r.incarnation, []) if e.donor != r.incarnation]
        outcome = f"[red]{r.finish_reason}: {r.error}" if r.error else f"{r.finish_reason}, {len(r.output_ids)} tokens"
        mark = " [yellow](event)" if r in res.affected else ""
        t.add_row(f"{r.incarnation}{mark}", r.tenant, str(len(r.prompt_ids)), outcome,
                  ("[red]" if ex else "") + str(len(ex)), str(len({e.donor for e in ex})))
    con.print(t)
    pools = ", ".join(f"{n} {f}/{tot}" for n, (f, tot) in res.free_pages.items())
    con.print(f"responses that read foreign slots: [bold]{len(res.readers_of_foreign)}[/]; free pages at the end "
              f"(free/total): {pools}{'' if res.pages_balanced else '  [red]pages lost or double-counted'}")
    if res.surfaced:
        con.print(f"canaries leaked into another tenant's output: {len(res.surfaced)}")
    if (line := _store_line(res, store, detail=False)):
        con.print(line)
