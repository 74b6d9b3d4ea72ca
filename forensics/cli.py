"""The ``kvledger`` command line (contract: ../shared/CLI.md)."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from engine.errors import KvledgerError
from forensics.fleet import FOLDED, SOURCES


def _die(msg: str) -> int:
    print(f"kvledger: error: {msg}", file=sys.stderr)
    return 2


def _check_store_path(store: str) -> str | None:
    """Why a store cannot be written at ``store`` (None: it can), found before anything is created."""
    import os
    from pathlib import Path

    from telemetry.keys import KeyError_, check_secret_env
    try:
        check_secret_env()
    except KeyError_ as e:
        return str(e)
    p = Path(store).absolute()
    if p.exists() and not p.is_dir():
        return f"--store {store} exists and is not a directory"
    up = p
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        return f"--store {store}: {up} is a file, not a directory"
    if not os.access(up, os.W_OK | os.X_OK):
        return f"--store {store}: {up} is not writable"
    return None


def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.config import EngineConfig, parse_bytes
    from engine.llm import LLMEngine
    from engine.models import load_model
    from engine.request import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for flag, value in (("--max-tokens", args.max_tokens), ("--context-length", args.context_length),
                        ("--page-size", args.page_size)):
        if value is not None and value < 1:
            return _die(f"{flag} must be >= 1, got {value}")
    from engine.preflight import pool_tokens_for
    budget = parse_bytes(args.memory_budget)
    model, tok = load_model(args.model)
    pool = pool_tokens_for(model, EngineConfig(kv_memory_budget=budget, page_size=args.page_size))
    context = args.context_length or pool          # by default the context is what the pool holds
    if context > pool:
        print(f"kvledger: warning: --context-length {context} is longer than the KV pool ({pool} tokens from "
              f"--memory-budget {args.memory_budget}): a prompt longer than the pool is the GLM-5.3 incident's "
              "precondition (`kvledger preflight`); raise the budget or lower the context", file=sys.stderr)
    cfg = EngineConfig(kv_memory_budget=budget, context_length=context, page_size=args.page_size,
                       check_reads=not args.no_check)
    eng = LLMEngine(model, tok, cfg)
    t0 = time.perf_counter()
    req = eng.add_request(args.prompt, sp, tenant=args.tenant)
    con = Console(stderr=True)
    with con.status("generating", spinner="dots"):
        eng.run_until_done()
    wall = time.perf_counter() - t0
    if req.error is not None:
        return _die(str(req.error))
    print(eng.text(req))
    t = Table(title="request", show_header=False)
    n_out = len(req.output_ids)
    decode_s = (req.finished_at - req.first_token_at) if req.first_token_at else 0.0
    for k, v in [("incarnation", str(req.incarnation)), ("tenant / cache scope", f"{req.tenant} / {req.scope}"),
                 ("prompt tokens", len(req.prompt_ids)), ("completion tokens", n_out),
                 ("finish reason", req.finish_reason), ("time to first token", f"{req.ttft * 1e3:.1f} ms"),
                 ("decode tokens/s", f"{(n_out - 1) / decode_s:.1f}" if n_out > 1 and decode_s > 0 else "-"),
                 ("wall time", f"{wall:.2f} s"), ("engine steps", eng.steps),
                 ("read check", "on, no violation" if cfg.check_reads else "off"),
                 ("KV pool", f"{eng.pool.num_pages} pages x {cfg.page_size} = {eng.pool.capacity_tokens} tokens "
                             f"({eng.pool.memory_bytes / 2**20:.1f} MiB) vs context {cfg.context_length}")]:
        t.add_row(k, str(v))
    con.print(t)
    return 0


def cmd_replay(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from engine.faults import FAULTS, MODES
    from engine.scenarios import SCENARIOS, glm53

    con = Console()
    known = {**SCENARIOS, **FAULTS}
    if args.list:
        for name, what in known.items():
            print(f"{name}\t{what}")
        return 0
    if args.scenario is None:
        return _die("replay needs a SCENARIO (see kvledger replay --list)")
    if args.scenario not in known:
        return _die(f"unknown scenario {args.scenario!r}; known: {', '.join(known)}")
    if not 0 <= args.seed < 1 << 63:
        return _die(f"--seed must be in [0, 2**63), got {args.seed}")
    if not args.no_store and (why := _check_store_path(args.store)):
        return _die(why)
    if args.scenario in FAULTS:
        given = [f for f, v in (("--context-length", args.context_length), ("--victims", args.victims),
                                ("--max-tokens", args.max_tokens)) if v is not None]
        if given:
            return _die(f"{', '.join(given)} apply to glm53 only; fault scenario {args.scenario} replays a fixed "
                        "workload (its triggering event is --no-trigger's switch)")
        mode = MODES[args.scenario]
        if args.mode not in (None, mode):
            return _die(f"scenario {args.scenario} runs in {mode} mode only (got --mode {args.mode})")
        return _replay_fault(args, con)
    args.mode = args.mode or "disaggregated"
    args.context_length = 1024 if args.context_length is None else args.context_length
    args.victims = 4 if args.victims is None else args.victims
    args.max_tokens = 160 if args.max_tokens is None else args.max_tokens
    if not 256 <= args.context_length <= MAX_REPLAY_CONTEXT:
        return _die(f"--context-length must be in [256, {MAX_REPLAY_CONTEXT}] for a replay on this machine, "
                    f"got {args.context_length}")
    if args.victims < 0:
        return _die(f"--victims must be >= 0, got {args.victims}")
    if args.max_tokens < 1:
        return _die(f"--max-tokens must be >= 1, got {args.max_tokens}")
    room = args.context_length - round(args.context_length * 681_280 / 1_048_576) - 24
    if args.victims and args.max_tokens >= room:
        return _die(f"--max-tokens {args.max_tokens} leaves no room for a prompt longer than the small prefill pool "
                    f"within context {args.context_length}: it must be < {room}")
    if args.processes and args.mode != "disaggregated":
        return _die("--processes runs prefill nodes as their own processes: it needs --mode disaggregated")
    if args.no_trigger:
        return _die("--no-trigger applies to the fault scenarios; glm53's trigger is its over-pool prompts (--victims 0)")
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"replaying {args.scenario} ({args.policy}, {args.mode})", total=None)
        res = glm53(args.policy, args.mode, seed=args.seed, context=args.context_length, victims=args.victims,
                    max_tokens=args.max_tokens, progress=lambda n: bar.advance(task, n),
                    store=None if args.no_store else args.store, processes=args.processes)
    t = Table(title=f"kvledger replay {args.scenario}: policy={res.policy}, mode={res.mode}, context={res.context}")
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
        ex = res.exposures.get(r.incarnation, [])
        foreign = [e for e in ex if e.donor != r.incarnation]
        outcome = f"[red]error: {r.error}" if r.error else f"HTTP 200, {len(r.output_ids)} tokens, TTFT {r.ttft * 1e3:.0f} ms"
        rt.add_row(str(r.incarnation), str(r.prompt_tokens_billed), outcome, str(len(foreign)),
                   str(len({e.donor for e in foreign})))
    con.print(rt)
    readers = res.foreign_readers
    con.print(f"responses that read foreign slots: [bold]{len(readers)}[/]  "
              f"(oracle: clean re-run of each response's own tokens vs what it read)")
    served_over = [r for r in res.over_pool if r.error is None]
    rate = len({i for i, _, _ in res.surfaced}) / len(served_over) if served_over else 0.0
    con.print(f"canaries planted: {len(res.canaries)}; surfaced in another tenant's output: {len(res.surfaced)} "
              f"(surfacing rate {rate:.0%} of served over-pool responses)")
    for inc, tenant, canary in res.surfaced:
        con.print(f"  {canary} (tenant {res.canaries[canary]}) -> response {inc} of tenant {tenant}")
    if res.telemetry is not None:
        tm = res.telemetry
        con.print(f"store {args.store}: {tm['segments']} segments, {sum(tm['rows'].values())} rows "
                  f"({tm['rows']['page_reads']} page-read runs, {tm['rows']['page_writes']} page-write runs, "
                  f"{tm['spans_exported']} spans, {tm['spans_dropped']} dropped); "
                  f"next: kvledger forensics exposures --store {args.store}")
    return 0


def _replay_fault(args, con) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from engine.faults import FAULTS, MODES, run_fault

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"replaying {args.scenario} ({args.policy}, {MODES[args.scenario]})", total=None)
        res = run_fault(args.scenario, args.policy, seed=args.seed, trigger=not args.no_trigger,
                        store=None if args.no_store else args.store, progress=lambda n: bar.advance(task, n))
    con.print(f"[bold]kvledger replay {args.scenario}[/]: {FAULTS[args.scenario]}")
    con.print(f"policy={res.policy}, mode={res.mode}, triggering event: {'yes' if res.triggered else 'no (--no-trigger)'}")
    readers = res.readers_of_foreign
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
    con.print(f"responses that read foreign slots: [bold]{len(readers)}[/]; free pages at the end (free/total): {pools}"
              f"{'' if res.pages_balanced else '  [red]pages lost or double-counted'}")
    if res.surfaced:
        con.print(f"canaries that surfaced in another tenant's output: {len(res.surfaced)}")
    if res.telemetry is not None:
        tm = res.telemetry
        con.print(f"store {args.store}: {tm['segments']} segments, {sum(tm['rows'].values())} rows; "
                  f"next: kvledger forensics exposures --store {args.store}")
    return 0


MAX_REPLAY_CONTEXT = 131_072


def _preflight_foreign(flag: str, value: str) -> int:
    """Pool vs context of a running engine (ours or SGLang by server info; vLLM or SGLang by log).
    Exit 1 when an instance's pool is smaller than its context, 3 when a context is unknown."""
    from rich.console import Console
    from rich.table import Table

    from forensics.foreign_preflight import from_endpoint, from_log
    try:
        found = from_endpoint(value) if flag == "--endpoint" else from_log(value, flag[2:].split("-")[0])
    except ValueError as e:
        return _die(str(e))
    t = Table(title=f"kvledger preflight {flag} {value}")
    for c in ("instance", "pool (tokens)", "context", "pool / context", "verdict", "from"):
        t.add_column(c, justify="right" if c in ("pool (tokens)", "context", "pool / context") else "left")
    for i in found:
        ratio = f"{i.pool_tokens / i.context_length:.4f}" if i.fits is not None else "-"
        verdict = {True: "[green]fits", False: "[red]pool < context: the incident's precondition",
                   None: "[yellow]context unknown"}[i.fits]
        t.add_row(i.name, f"{i.pool_tokens:,}" if i.pool_tokens else "?", f"{i.context_length:,}" if i.context_length
                  else "?", ratio, verdict, i.source)
    Console().print(t)
    short = [i.name for i in found if i.fits is False]
    if short:
        print(f"kvledger: preflight failed: {', '.join(short)} cannot hold a full-context prompt", file=sys.stderr)
        return 1
    return 3 if any(i.fits is None for i in found) else 0


def cmd_preflight(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.config import EngineConfig, parse_bytes
    from engine.models import load_model
    from engine.preflight import pool_tokens_for

    foreign = [(f, v) for f, v in (("--endpoint", args.endpoint), ("--vllm-log", args.vllm_log),
                                   ("--sglang-log", args.sglang_log)) if v]
    if len(foreign) > 1:
        return _die(f"give one of --endpoint, --vllm-log, --sglang-log (got {', '.join(f for f, _ in foreign)})")
    if foreign:
        return _preflight_foreign(*foreign[0])
    if args.context_length <= 0:
        return _die(f"--context-length must be >= 1, got {args.context_length}")
    if args.page_size <= 0:
        return _die(f"--page-size must be >= 1, got {args.page_size}")
    model, _ = load_model(args.model)
    budgets = args.memory_budget or ["64MiB"]
    t = Table(title=f"kvledger preflight: model {args.model}, context length {args.context_length}")
    for c in ("node", "KV memory budget", "pool (tokens)", "pool / context", "verdict"):
        t.add_column(c, justify="right" if c != "node" else "left")
    short = []
    for i, b in enumerate(budgets):
        cfg = EngineConfig(kv_memory_budget=parse_bytes(b), page_size=args.page_size, context_length=args.context_length)
        pool = pool_tokens_for(model, cfg)
        ok = pool >= args.context_length
        short += [] if ok else [f"node{i}"]
        t.add_row(f"node{i}", b, str(pool), f"{pool / args.context_length:.4f}",
                  "[green]fits" if ok else f"[red]pool < context: hardened refuses to start (or lower the context to {pool})")
    Console().print(t)
    if short:
        print(f"kvledger: preflight failed: {', '.join(short)} cannot hold a full-context prompt", file=sys.stderr)
        return 1
    return 0


def cmd_dashboard(args) -> int:
    import os
    from pathlib import Path

    import dashboard

    if not 0 < args.port < 65536:
        return _die(f"--port must be in 1..65535, got {args.port}")
    if args.refresh <= 0:
        return _die(f"--refresh must be > 0 seconds, got {args.refresh}")
    err = _check_engine(args)
    if err:
        return _die(err)
    if not (Path(args.store) / "chain").is_dir():
        print(f"kvledger: note: no store at {args.store} yet; the dashboard shows it once the engine writes there",
              file=sys.stderr)
    app = Path(dashboard.__file__).with_name("app.py")
    env = {**os.environ, "KVLEDGER_STORE": str(Path(args.store).resolve()), "KVLEDGER_REFRESH_S": str(args.refresh),
           "KVLEDGER_ENGINE": args.engine, "KVLEDGER_DSN": args.dsn or ""}
    print(f"kvledger dashboard on http://{args.host}:{args.port} (store {args.store})", file=sys.stderr)
    return run_child([sys.executable, "-m", "dashboard.serve", str(app), "--server.address", args.host,
                      "--server.port", str(args.port), "--server.headless", "true",
                      "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"], env=env)


def run_child(argv: list[str], env: dict) -> int:
    """Run a server child (Streamlit) as this command: SIGTERM and SIGINT sent to this process are
    forwarded to it, and on Linux it is killed if this process dies (kill -9 included)."""
    import signal
    import subprocess

    from engine.procs import _die_with_parent
    child = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)
    forward = lambda signum, frame: child.send_signal(signum)      # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:       # the child got the SIGINT too; wait for it to stop
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def cmd_verify(args) -> int:
    from telemetry.store import verify

    v = verify(args.store, args.anchor)
    for w in v.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not v.ok:
        print(f"kvledger: store {args.store} is BROKEN: {v.broken} (after {v.segments} good segments, "
              f"{v.rows} rows)", file=sys.stderr)
        return 1
    anchored = (f"anchored at seq {v.anchor_seq} in {v.anchor}" if v.anchor_seq is not None
                else "NOT anchored (truncation undetectable)")
    print(f"store {args.store}: chain intact and signed (key {v.fingerprint}), {v.segments} segments, {v.rows} rows, "
          f"head {v.head[:16]} at seq {v.seq}; {anchored}; {'sealed by a clean close' if v.sealed else 'not sealed'}")
    return 0


def _check_engine(args) -> str | None:
    """The engine options agree with each other (checked before anything is opened)."""
    engine, dsn = args.engine, getattr(args, "dsn", None)
    if engine == "clickhouse" and not dsn:
        return "--engine clickhouse needs --dsn clickhouse://HOST:8123/DATABASE (the server `kvledger export` fills)"
    if dsn and engine != "clickhouse":
        return f"--dsn is for --engine clickhouse (got --engine {engine})"
    spans = getattr(args, "spans_table", None)
    if spans and engine == "duckdb":
        return "--spans-table reads a ClickHouse table: use it with --engine chdb or --engine clickhouse"
    if spans and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", spans):
        return f"--spans-table {spans!r}: expected TABLE or DATABASE.TABLE (letters, digits, _)"
    if getattr(args, "chdb_path", None) and engine != "chdb":
        return f"--chdb-path is for --engine chdb (got --engine {engine})"
    return None


def _engine_args(args, spans: bool = False) -> dict:
    kw = {"engine": args.engine}
    if args.engine == "clickhouse":
        kw["dsn"] = args.dsn
    if args.engine == "chdb" and args.chdb_path:
        kw["chdb_path"] = args.chdb_path
    if spans and args.engine != "duckdb":
        kw["spans_table"], kw["tenant_attribute"] = args.spans_table, args.tenant_attribute
    return kw


def cmd_forensics(args) -> int:
    from forensics.clickhouse import open_forensics
    from forensics.fleet import folded
    from forensics.output import emit, pick_columns

    if args.query not in FOLDED and args.source != "auto":
        return _die(f"--source applies to {', '.join(FOLDED)} only (their page-ledger and foreign-span views), "
                    f"not to {args.query}")
    if args.bucket <= 0:
        return _die(f"--bucket must be a positive number of seconds, got {args.bucket}")
    if args.start is not None and args.end is not None and args.start > args.end:
        return _die(f"--from {args.start.isoformat()}Z is after --to {args.end.isoformat()}Z: the window would be empty")
    err = _check_engine(args)
    if err:
        return _die(err)
    fx = open_forensics(args.store, args.run, allow_unverified=args.allow_unverified, anchor=args.anchor,
                        **_engine_args(args, spans=True))
    df, answered, fold_note = folded(fx, args.query, args.source, args.start, args.end, bucket_s=args.bucket)
    note = fx.unverified_note
    if note:
        print(f"kvledger: warning: {note}", file=sys.stderr)
    if fold_note:
        print(f"kvledger: note: {fold_note}", file=sys.stderr)
    title = f"kvledger forensics {answered} ({args.store})"
    width = None
    if args.format == "table":
        df = pick_columns(df, answered, args.wide, args.columns)
        if args.wide:                       # every column, as wide as it needs (a pager with -S reads it)
            width = 0
    return emit(df, args.format, title=f"{note} - {title}" if note else title, width=width)


def cmd_report(args) -> int:
    from pathlib import Path

    from forensics.report import build, parse_event, write

    if Path(args.out).exists() and not Path(args.out).is_dir():
        return _die(f"--out {args.out} exists and is not a directory (the report writes several files into one)")
    err = _check_engine(args)
    if err:
        return _die(err)
    try:
        events = [parse_event(e) for e in args.event]
        report = build(args.store, args.start, args.end, events, args.include_excerpts, run=args.run,
                       allow_early_awareness=args.allow_early_awareness, allow_unverified=args.allow_unverified,
                       anchor=args.anchor, engine=_engine_args(args))
    except ValueError as e:
        return _die(str(e))
    for p in write(report, args.out):
        print(p)
    c = report["counts"]
    print(f"{c['affected_responses']} affected response(s), {c['recipient_tenants']} recipient and "
          f"{c['donor_tenants']} donor tenant(s); chain {'intact' if report['provenance']['chain_ok'] else 'BROKEN'}",
          file=sys.stderr)
    return 0 if report["provenance"]["chain_ok"] else 1


def cmd_export(args) -> int:
    import signal
    import threading

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from telemetry.clickhouse import connect, ddl, export

    if args.print_ddl:
        print(";\n\n".join(ddl(args.database, args.cluster)) + ";")
        return 0
    if not args.to:
        return _die("export needs --to clickhouse://HOST:8123/DATABASE (or chdb:PATH for embedded ClickHouse)")
    if args.interval <= 0:
        return _die(f"--interval must be > 0 seconds, got {args.interval}")
    if not (Path(args.store) / "chain").is_dir():
        return _die(f"no kvledger store at {args.store} (expected {args.store}/chain)")
    target = connect(args.to)
    err = Console(stderr=True)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)} if args.follow else {}
    cache: dict = {}
    try:
        while True:
            with Progress(TextColumn("export"), BarColumn(), MofNCompleteColumn(), TextColumn("segments"),
                          TextColumn("{task.fields[rows]:,} rows"), TimeRemainingColumn(), console=err,
                          transient=True) as bar:
                task = bar.add_task("export", total=None, rows=0)
                res = export(args.store, target, anchor=args.anchor, cache=cache,
                             progress=lambda done, total, rows: bar.update(task, completed=done, total=total, rows=rows))
            if res["segments"] or not args.follow:
                print(f"exported {res['segments']} segment(s), {res['rows']:,} rows of store {res['store_id']} to "
                      f"{target.url} ({res['skipped']} already there; head {res['head'][:16]} at seq {res['seq']})",
                      file=sys.stderr, flush=True)
            if not args.follow or stop.wait(args.interval):
                return 0
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        target.close()


def cmd_serve(args) -> int:
    from engine.server.app import serve

    if not 0 < args.port < 65536:
        return _die(f"--port must be in 1..65535, got {args.port}")
    if not 1 <= args.max_pending <= 1_000_000:
        return _die(f"--max-pending must be in [1, 1000000], got {args.max_pending}")
    if not 0 <= args.drain_timeout <= 3600:
        return _die(f"--drain-timeout must be in [0, 3600] seconds, got {args.drain_timeout}")
    if not 1 <= args.torch_threads <= 1024:
        return _die(f"--torch-threads must be in [1, 1024], got {args.torch_threads}")
    from engine.server.limits import MAX_LIMIT
    for flag in ("tenant_rpm", "tenant_tpm", "tenant_max_parallel"):
        if not 0 <= getattr(args, flag) <= MAX_LIMIT:
            return _die(f"--{flag.replace('_', '-')} must be in [0, {MAX_LIMIT}] (0: no limit), got {getattr(args, flag)}")
    if (why := _check_store_path(args.store)):
        return _die(why)
    return serve(args)


def cmd_collect(args) -> int:
    from telemetry.receivers.collect import collect
    err = _check_store_path(args.store)
    if err:
        return _die(err)
    return collect(args)


def cmd_ingest_logs(args) -> int:
    from telemetry.receivers.logs import ingest
    from telemetry.store import SegmentWriter
    err = _check_store_path(args.store)
    if err:
        return _die(err)
    if not Path(args.file).is_file():
        return _die(f"{args.file}: no such log file")
    writer = SegmentWriter(args.store)
    try:
        got = ingest(writer, args.file, args.engine, args.instance)
    finally:
        writer.close()
    print(f"kvledger ingest-logs: {args.file}: {got['capacity_lines']} capacity line(s), {got['canary_lines']} "
          f"KV canary line(s), {got['checksum_lines']} KV checksum line(s) into {args.store} (run {writer.boot})")
    return 0


def _probe_writer(store: str):
    """The store writer a probe records into, opened (and the store verified) before any request."""
    from forensics.probe import ProbeError
    from telemetry.store import SegmentWriter, StoreError
    try:
        return SegmentWriter(store)
    except StoreError as e:
        raise ProbeError(f"--store {store}: {e}") from None


def cmd_probe(args) -> int:
    import json

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from forensics.probe import ProbeError, Target, as_json, exit_code, run_probe, validate

    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    try:
        validate(checks, args.samples, args.pool_tokens, args.context_length)
        writer = _probe_writer(args.store) if args.store else None
    except ProbeError as e:
        return _die(str(e))
    try:                                   # the writer is closed (sealed) on every path, errors included
        try:
            target = Target(args.base_url, args.key_a, args.key_b, args.model, args.tokenizer)
            with Progress(console=Console(stderr=True), transient=True) as bar:
                task = bar.add_task(f"probing {args.base_url}", total=None)
                results, meta = run_probe(target, checks, args.pool_tokens, args.context_length, args.samples,
                                          progress=lambda: bar.advance(task))
        except ProbeError as e:
            return _die(str(e))
        if writer is not None:
            from forensics.probe import record
            record(writer, results, meta, args.key_a, args.key_b)
    finally:
        if writer is not None:
            writer.close()
    if args.format == "json":
        print(as_json(results, meta))
    else:
        t = Table(title=f"kvledger probe {meta['base_url']} (model {meta['model']}, pool {meta['pool_tokens']}, "
                        f"context {meta['context_length']} from {meta['discovered_from']}; {meta['requests']} requests)")
        for c in ("check", "verdict", "detail"):
            t.add_column(c, overflow="fold")
        colour = {"pass": "green", "finding": "red", "inconclusive": "yellow"}
        for r in results:
            t.add_row(r.check, f"[{colour[r.verdict]}]{r.verdict}", r.detail)
            for e in r.evidence:
                t.add_row("", "", f"[red]{json.dumps(e)}")
        Console().print(t)
    return exit_code(results)


def _engine_options(p: argparse.ArgumentParser, spans: bool = False) -> None:
    """--engine, --dsn, --chdb-path (and --spans-table, --tenant-attribute): which SQL engine answers."""
    p.add_argument("--engine", choices=["duckdb", "chdb", "clickhouse"], default="duckdb",
                   help="SQL engine: duckdb over the local store (default); chdb: embedded ClickHouse over the local "
                        "store (nothing to start); clickhouse: a server `kvledger export` filled (--dsn)")
    p.add_argument("--dsn", default=None, metavar="URL",
                   help="--engine clickhouse: clickhouse://[USER[:PASSWORD]@]HOST[:8123]/DATABASE (clickhouses:// "
                        "for HTTPS)")
    p.add_argument("--chdb-path", default=None, metavar="DIR",
                   help="--engine chdb: where embedded ClickHouse keeps its copy of the store (default "
                        "$KVLEDGER_CHDB_PATH or ~/.cache/kvledger/chdb)")
    if spans:
        p.add_argument("--spans-table", default=None, metavar="[DB.]TABLE",
                       help="ClickHouse engines: read spans from an OpenTelemetry Collector `otel_traces` table in "
                            "place (TTFT, usage honesty, impact, fleet queries)")
        p.add_argument("--tenant-attribute", default="tenant.id",
                       help="--spans-table: the span or resource attribute naming the tenant (default tenant.id)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="Paged-attention engine and KV-exposure forensics.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="run the engine on one prompt, print the text and per-request stats")
    g.add_argument("--model", required=True, help="'recall' or an HF-format directory (config.json, safetensors, tokenizer.json)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none; greedy needs none)")
    g.add_argument("--tenant", default="default", help="tenant the request runs as (default 'default')")
    g.add_argument("--memory-budget", default="64MiB", help="KV pool memory budget; capacity in tokens is derived (default 64MiB)")
    g.add_argument("--context-length", type=int, default=None,
                   help="longest prompt + output served (default: the KV pool's capacity in tokens, so a prompt "
                        "never outgrows the pool; a longer one is warned about)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--no-check", action="store_true", help="disable the read-time provenance check")
    g.set_defaults(func=cmd_generate)
    r = sub.add_parser("replay", help="run a scenario (glm53 or a fault of its bug family) and print what happened")
    r.add_argument("scenario", nargs="?", help="scenario name; --list names them")
    r.add_argument("--list", action="store_true", help="list the scenarios")
    r.add_argument("--policy", choices=["vulnerable", "hardened"], default="vulnerable",
                   help="vulnerable (default: the incident's engine, guards off) or hardened (every guard on)")
    r.add_argument("--mode", choices=["disaggregated", "unified"], default=None,
                   help="glm53: disaggregated (default) or unified; each fault scenario has its own mode")
    r.add_argument("--processes", action="store_true",
                   help="glm53: each prefill node is its own OS process writing KV into decode's pool through shared memory")
    r.add_argument("--no-trigger", action="store_true",
                   help="fault scenarios: the same workload without the triggering event (expect zero exposures)")
    r.add_argument("--store", default="./kvledger-store", help="where spans, metrics and the page ledger land (default ./kvledger-store)")
    r.add_argument("--no-store", action="store_true", help="record nothing (the oracle still judges the run)")
    r.add_argument("--seed", type=int, default=0,
                   help="seeds the traffic, the canaries and the oracle: the same seed replays the same run (default 0)")
    r.add_argument("--context-length", type=int, default=None,
                   help="glm53: scaled context, 256..131072 (default 1024); pools keep the incident's ratio")
    r.add_argument("--victims", type=int, default=None, help="glm53: prompts longer than the small prefill pool (default 4)")
    r.add_argument("--max-tokens", type=int, default=None, help="glm53: tokens each over-pool request generates (default 160)")
    r.set_defaults(func=cmd_replay)
    sv = sub.add_parser("serve", help="OpenAI-compatible server (tenants from API keys), recording into the store")
    sv.add_argument("--model", default="recall", help="'recall' (default) or an HF-format directory")
    sv.add_argument("--policy", choices=["vulnerable", "hardened"], default="hardened",
                    help="hardened (default): every guard on; vulnerable: the incident's behaviour, with a warning")
    sv.add_argument("--mode", choices=["unified", "disaggregated"], default="unified",
                    help="unified (default): one node; disaggregated: router, prefill nodes, decode node, KV link")
    sv.add_argument("--config", default=None, metavar="cluster.toml",
                    help="node pools, context length, page size, isolation level (default: the glm53 cluster)")
    sv.add_argument("--keys", default=None, metavar="FILE",
                    help='JSON {"api-key": "tenant"} or {"api-key": {"tenant":..., "user":..., "org":..., "rpm":..., '
                         '"tpm":..., "max_parallel_requests":...}}; unknown or missing key -> 401 (default: no keys, '
                         "every caller is tenant 'default')")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--store", default="./kvledger-store", help="where telemetry lands (default ./kvledger-store)")
    sv.add_argument("--max-pending", type=int, default=256,
                    help="requests in flight before new ones get 429 with Retry-After (default 256)")
    sv.add_argument("--tenant-rpm", type=int, default=0, metavar="N",
                    help="requests per minute per tenant, for tenants whose keys entry sets no rpm (default 0: no "
                         "limit); over it -> 429 with Retry-After")
    sv.add_argument("--tenant-tpm", type=int, default=0, metavar="N",
                    help="tokens per minute per tenant (prompt + max_tokens, the unused part given back when the "
                         "request ends), for tenants whose keys entry sets no tpm (default 0: no limit)")
    sv.add_argument("--tenant-max-parallel", type=int, default=0, metavar="N",
                    help="requests in flight at once per tenant, for tenants whose keys entry sets no "
                         "max_parallel_requests (default 0: no limit beyond --max-pending)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM/SIGINT, seconds to let running requests finish before aborting them (default 30)")
    sv.add_argument("--torch-threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                    help="torch's intra-op threads for the engine (default: the cores less one, left to the HTTP "
                         "server, the store writer and local clients; each op waits for its slowest thread, so one "
                         "that loses its core stalls them all)")
    sv.set_defaults(func=cmd_serve)
    pb = sub.add_parser("probe", help="isolation probe against any OpenAI-compatible endpoint: exit 0 pass, "
                                      "1 finding, 3 inconclusive")
    pb.add_argument("--base-url", required=True, help="the endpoint as the openai client takes it, e.g. http://host:8000/v1")
    pb.add_argument("--key-a", required=True, help="API key of tenant A (plants canaries)")
    pb.add_argument("--key-b", required=True, help="API key of tenant B, another tenant (looks for them)")
    pb.add_argument("--model", default=None, help="model name (default: the first /v1/models lists)")
    pb.add_argument("--checks", default="limits,usage,canary,salt,timing,abort",
                    help="comma-separated: limits, usage, canary, salt, timing, abort (default: all six)")
    pb.add_argument("--pool-tokens", type=int, default=None, help="KV pool in tokens (default: discovered)")
    pb.add_argument("--context-length", type=int, default=None, help="context length (default: discovered)")
    pb.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="a directory with tokenizer.json to count tokens (default: the endpoint's /tokenize)")
    pb.add_argument("--samples", type=int, default=6, help="canaries planted and prompts per check (default 6)")
    pb.add_argument("--format", choices=["table", "json"], default="table", help="table (default) or one JSON array")
    pb.add_argument("--store", default=None, metavar="PATH",
                    help="also record the run and its findings in this store (keyed pseudonyms; no keys or canaries "
                         "in clear); default: none")
    pb.set_defaults(func=cmd_probe)
    co = sub.add_parser("collect", help="receive a vLLM/SGLang fleet's telemetry (OTLP/HTTP spans and metrics, "
                                        "ZMQ KV cache events) into a store until SIGTERM/SIGINT")
    co.add_argument("--store", default="kvledger-store", help="the store to write (default: kvledger-store)")
    co.add_argument("--otlp-host", default="127.0.0.1", help="address the OTLP/HTTP receiver binds (default 127.0.0.1)")
    co.add_argument("--otlp-port", type=int, default=4318, help="OTLP/HTTP port (default 4318, the OTLP standard)")
    co.add_argument("--kv-events", action="append", metavar="ENDPOINT[,replay=URL][,name=NAME][,topic=T]",
                    help="a KV event publisher to subscribe to (repeat for several), e.g. tcp://10.0.0.5:5557 "
                         "(vLLM --kv-events-config endpoint); replay= its replay socket, to fill sequence gaps")
    co.add_argument("--tenant-attribute", default="tenant.id",
                    help="span or resource attribute naming the tenant (default tenant.id; stored pseudonymised)")
    co.add_argument("--tenant-header", default=None,
                    help="HTTP header on the OTLP request naming the tenant of all its spans (default: none)")
    co.add_argument("--decode-workers", type=int, default=min(4, os.cpu_count() or 1),
                    help="processes decoding OTLP bodies of 64 KiB or more, started on the first one (default: "
                         "the cores, at most 4; 0 decodes everything in the receiver's own process)")
    co.set_defaults(func=cmd_collect)
    il = sub.add_parser("ingest-logs", help="a vLLM/SGLang log's capacity, KV canary and KV checksum lines into a store")
    il.add_argument("file", help="the engine's log file")
    il.add_argument("--engine", required=True, choices=["vllm", "sglang"], help="which engine wrote it")
    il.add_argument("--store", default="kvledger-store", help="the store to write (default: kvledger-store)")
    il.add_argument("--instance", default=None,
                    help="the instance's name, as its spans' service.instance.id (default: the file's name "
                         "without extension)")
    il.set_defaults(func=cmd_ingest_logs)
    pf = sub.add_parser("preflight", help="each node's KV pool in tokens against the context length; non-zero exit when smaller")
    pf.add_argument("--model", default="recall", help="'recall' (default) or an HF-format directory")
    pf.add_argument("--context-length", type=int, default=2048,
                    help="the context each pool must hold (default 2048, the engine's default; GLM-5.3 advertised "
                         "1048576 on a pool of a few thousand tokens)")
    pf.add_argument("--memory-budget", action="append", metavar="SIZE",
                    help="KV memory budget of one node (repeat for several nodes), e.g. 512MiB; default 64MiB")
    pf.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    pf.add_argument("--endpoint", default=None, metavar="URL",
                    help="judge a running server instead: ours or SGLang (/server_info or /get_server_info)")
    pf.add_argument("--vllm-log", default=None, metavar="FILE",
                    help="judge a vLLM instance from its start-up log (GPU KV cache size / # GPU blocks lines)")
    pf.add_argument("--sglang-log", default=None, metavar="FILE",
                    help="judge SGLang instances from their start-up log (max_total_num_tokens=..., context_len=...)")
    pf.set_defaults(func=cmd_preflight)
    d = sub.add_parser("dashboard", help="the live Streamlit exposure dashboard (loopback by default)")
    d.add_argument("--store", default="./kvledger-store", help="the store to show (default ./kvledger-store)")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    d.add_argument("--port", type=int, default=8501, help="port (default 8501, Streamlit's)")
    d.add_argument("--refresh", type=float, default=2.0, help="seconds between live refreshes (default 2)")
    d.add_argument("--engine", choices=["duckdb", "chdb", "clickhouse"], default="duckdb",
                   help="SQL engine behind the panels: duckdb (default), chdb (embedded ClickHouse), clickhouse (--dsn)")
    d.add_argument("--dsn", default=None, metavar="URL", help="--engine clickhouse: clickhouse://HOST:8123/DATABASE")
    d.set_defaults(func=cmd_dashboard)
    v = sub.add_parser("verify", help="verify the store's signed chain against its anchor; non-zero exit naming "
                                      "the first broken link or the truncation; needs no secret, writes nothing")
    v.add_argument("--store", default="./kvledger-store", help="the store (default ./kvledger-store)")
    v.add_argument("--anchor", default=None, metavar="PATH",
                   help="the anchor log to check against (default: $KVLEDGER_ANCHOR, else "
                        "$KVLEDGER_STATE_DIR/anchors/<store id>.jsonl, used when it exists)")
    v.set_defaults(func=cmd_verify)
    f = sub.add_parser("forensics", help="forensic queries over the store")
    f.add_argument("query", choices=FORENSIC_QUERIES, help="; ".join(f"{k}: {v}" for k, v in FORENSIC_QUERIES.items()))
    f.add_argument("--store", default="./kvledger-store", help="the store to query (default ./kvledger-store)")
    f.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table",
                   help="table (default), csv, json (one array of objects on stdout) or parquet (binary on stdout: "
                        "redirect it)")
    f.add_argument("--from", dest="start", type=_timestamp, default=None, help="window start (ISO 8601, UTC)")
    f.add_argument("--to", dest="end", type=_timestamp, default=None, help="window end (ISO 8601, UTC)")
    f.add_argument("--bucket", type=int, default=60, help="tenant_scores: window length in seconds (default 60)")
    f.add_argument("--wide", action="store_true",
                   help="table format: every column (default: the columns that fit 80 characters; csv/json/parquet "
                        "always carry every column)")
    f.add_argument("--columns", default=None, metavar="A,B,...", help="table format: these columns, in this order")
    f.add_argument("--run", metavar="BOOT", default=None,
                   help="answer for one run only: a boot id from `kvledger forensics runs`, or a unique prefix of one "
                        "(default: every run the store holds)")
    f.add_argument("--source", choices=SOURCES, default="auto",
                   help="ttft, impact, tenants: 'ledger' (kvledger's own requests and page ledger), 'spans' (a "
                        "foreign fleet's request spans: fleet_ttft, fleet_impact, fleet_tenants) or 'auto' (default: "
                        "the ledger when the store has kvledger requests, else the spans)")
    f.add_argument("--allow-unverified", action="store_true",
                   help="answer even when the store does not verify (every output then says so)")
    f.add_argument("--anchor", default=None, metavar="PATH", help="the anchor to verify against (see kvledger verify)")
    _engine_options(f, spans=True)
    f.set_defaults(func=cmd_forensics)
    rp = sub.add_parser("report", help="disclosure report: Markdown, HTML, JSON (schema-validated), CSV")
    rp.add_argument("--store", default="./kvledger-store", help="the store to report on (default ./kvledger-store)")
    rp.add_argument("--from", dest="start", type=_timestamp, default=None, help="window start (ISO 8601, UTC)")
    rp.add_argument("--to", dest="end", type=_timestamp, default=None, help="window end (ISO 8601, UTC)")
    rp.add_argument("--out", required=True, help="output directory")
    rp.add_argument("--run", metavar="BOOT", default=None,
                    help="report on one run only (a boot id or a unique prefix; default: every run in the store)")
    rp.add_argument("--event", action="append", default=[], metavar="'TIME WHAT'",
                    help="an operator event for the timeline, e.g. '2026-09-01T10:00 report received' (repeatable; "
                         "a time without a zone is UTC); an event naming a report, declaration or awareness starts "
                         "the 72-hour clock")
    rp.add_argument("--allow-unverified", action="store_true",
                    help="report on a store that does not verify (the report says so on every page; exit 1)")
    rp.add_argument("--anchor", default=None, metavar="PATH", help="the anchor to verify against (see kvledger verify)")
    rp.add_argument("--allow-early-awareness", action="store_true",
                    help="accept an awareness event earlier than the first foreign read (refused by default: "
                         "usually a wrong time or zone)")
    rp.add_argument("--include-excerpts", action="store_true",
                    help="add the keyed n-gram evidence per exposure (the store holds no plaintext)")
    _engine_options(rp)
    rp.set_defaults(func=cmd_report)
    ex = sub.add_parser("export", help="copy the store into ClickHouse (a server, or embedded chdb), idempotent per "
                                       "segment; --follow keeps copying a live store")
    ex.add_argument("--to", default=None, metavar="URL",
                    help="clickhouse://[USER[:PASSWORD]@]HOST[:8123]/DATABASE, clickhouses://... (HTTPS), or "
                         "chdb:DIR[?db=NAME] (embedded ClickHouse, database kvledger by default)")
    ex.add_argument("--store", default="./kvledger-store", help="the store to copy (default ./kvledger-store)")
    ex.add_argument("--follow", action="store_true",
                    help="keep copying new segments every --interval seconds until SIGTERM/SIGINT")
    ex.add_argument("--interval", type=float, default=2.0, help="--follow: seconds between passes (default 2)")
    ex.add_argument("--anchor", default=None, metavar="PATH", help="the anchor to verify against (see kvledger verify)")
    ex.add_argument("--print-ddl", action="store_true",
                    help="print the ClickHouse DDL (generated from schema.sql) and exit; nothing is copied")
    ex.add_argument("--database", default="kvledger", help="--print-ddl: the database name (default kvledger)")
    ex.add_argument("--cluster", default=None, metavar="NAME",
                    help="--print-ddl: the cluster variant (ReplicatedMergeTree shards behind Distributed tables)")
    ex.set_defaults(func=cmd_export)
    return p


FORENSIC_QUERIES = {
    "runs": "the runs the store holds: boot id, policy, nodes, requests, exposed responses, first/last time",
    "exposures": "responses that read KV slots not written by their own chain, per donor (attention_mass: softmax "
                 "mass on the donor's pages summed over read steps; 1.0 = one step attending to nothing else)",
    "scores": "exposure score per response (README: Exposure score)",
    "tenant_scores": "exposure score per recipient tenant and --bucket window",
    "tenants": "donor -> recipient tenant matrix (pseudonyms)",
    "ttft": "time to first token vs uncached prompt tokens, the floor, and usage honesty",
    "impact": "responses whose billed prompt exceeds their prefill node's pool (the incident predicate)",
    "exploitation": "tenants sending abnormal volumes of over-pool or boundary-length prompts",
    "transfers": "KV transfers: reserved vs landed slot sets, checksums",
    "guards": "guard liveness: on, checks run, failures; red when on but idle",
    "releases": "page releases: immediate vs deferred, ended by drain or timeout",
    "preflight": "per node: KV pool tokens vs context length, policy, guards",
    "fleet_ttft": "foreign request spans: TTFT vs prompt tokens, Theil-Sen fit per instance, below_floor; "
                  "usage_dishonest where the engine reports the tokens it computed",
    "fleet_impact": "foreign request spans billed for more prompt than their instance's reported KV pool",
    "fleet_tenants": "foreign request spans per tenant: requests, below the TTFT floor, over the pool",
    "canary": "KV canary and KV checksum lines from foreign engines' logs, by instance and time",
    "cache_scopes": "block hashes a foreign engine stored under more than one cache scope (salt ignored)",
    "gaps": "telemetry known lost: KV event sequence gaps (filled from replay or not)",
    "probes": "external probe runs (`kvledger probe --store`): verdict and findings per check",
}


def _timestamp(text: str):
    import datetime as dt
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2026-09-01T12:00:00)") from None
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvledgerError as e:
        return _die(str(e))
    except OSError as e:          # read-only or full disk, a path that is a file: name it, no traceback
        where = f"{e.filename}: " if e.filename else ""
        return _die(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        return _die("interrupted")


if __name__ == "__main__":
    sys.exit(main())
