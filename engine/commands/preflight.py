"""``kvledger preflight``: each node's KV pool in tokens against the context length, for a model
of ours (by memory budget) or for a running engine (ours, SGLang, vLLM: its server info or log).
Exit 1 when a pool is smaller than its context, 3 when a foreign instance's context is unknown."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from engine.errors import InputError

FOREIGN = ("--endpoint", "--vllm-log", "--sglang-log")


@dataclass(frozen=True, slots=True)
class PreflightConfig:
    model: str = "recall"
    context_length: int = 2048
    memory_budgets: tuple[str, ...] = ("64MiB",)
    page_size: int = 16
    foreign: tuple[str, str] | None = None      # (flag, value): judge a running engine instead
    format: str = "table"


def add_arguments(pf) -> None:
    pf.add_argument("--model", default="recall", help="'recall' (default) or an HF-format directory")
    pf.add_argument("--context-length", type=int, default=2048,
                    help="the context each pool must hold (default 2048, the engine's default; GLM-5.3 advertised "
                         "1048576 on a pool of a few thousand tokens)")
    pf.add_argument("--memory-budget", action="append", metavar="SIZE",
                    help="KV memory budget of one node (repeat for several nodes), e.g. 512MiB; default 64MiB")
    pf.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    pf.add_argument("--endpoint", default=None, metavar="URL",
                    help="judge a running server instead: ours, SGLang or its PD router (/server_info), vLLM (/metrics, "
                         "/v1/models, /version)")
    pf.add_argument("--vllm-log", default=None, metavar="FILE",
                    help="judge vLLM instances from a start-up log ('<device> KV cache size: N tokens' / '# <device> blocks: N')")
    pf.add_argument("--sglang-log", default=None, metavar="FILE",
                    help="judge SGLang instances from their start-up log (max_total_num_tokens=..., context_len=...)")
    pf.add_argument("--format", choices=["table", "json"], default="table",
                    help="table (default) or one JSON array, a row per node or instance (the exit code is the same)")


def make_config(a) -> PreflightConfig:
    foreign = [(f, v) for f, v in zip(FOREIGN, (a.endpoint, a.vllm_log, a.sglang_log)) if v]
    if len(foreign) > 1:
        raise InputError(f"give one of --endpoint, --vllm-log, --sglang-log (got {', '.join(f for f, _ in foreign)})")
    if foreign:
        return PreflightConfig(foreign=foreign[0], format=a.format)
    if not 1 <= a.context_length <= 1 << 24:
        raise InputError(f"--context-length must be >= 1 and at most {1 << 24} tokens, got {a.context_length}")
    if not 1 <= a.page_size <= 1 << 16:
        raise InputError(f"--page-size must be >= 1 and at most {1 << 16} tokens, got {a.page_size}")
    return PreflightConfig(a.model, a.context_length, tuple(a.memory_budget or ["64MiB"]), a.page_size,
                           format=a.format)


def run(c: PreflightConfig) -> int:
    if c.foreign is not None:
        return _foreign(*c.foreign, as_json=c.format == "json")
    from rich.console import Console
    from rich.table import Table

    from engine.config import EngineConfig, parse_bytes
    from engine.kv.preflight import pool_tokens_for
    from engine.models import load_model

    model, _ = load_model(c.model)
    t = Table(title=f"kvledger preflight: model {c.model}, context length {c.context_length}")
    for col in ("node", "KV memory budget", "pool (tokens)", "pool / context", "verdict"):
        t.add_column(col, justify="right" if col != "node" else "left")
    short, rows = [], []
    for i, b in enumerate(c.memory_budgets):
        cfg = EngineConfig(kv_memory_budget=parse_bytes(b), page_size=c.page_size, context_length=c.context_length)
        pool = pool_tokens_for(model, cfg)
        ok = pool >= c.context_length
        short += [] if ok else [f"node{i}"]
        rows.append({"node": f"node{i}", "kv_memory_budget": b, "pool_tokens": pool, "context_length": c.context_length,
                     "pool_over_context": round(pool / c.context_length, 4), "fits": ok})
        t.add_row(f"node{i}", b, str(pool), f"{pool / c.context_length:.4f}",
                  "[green]fits" if ok else f"[red]pool < context: hardened refuses to start (or lower the context to {pool})")
    if c.format == "json":
        import json
        print(json.dumps(rows))
    else:
        Console().print(t)
    return _verdict(short)


def _verdict(short: list[str]) -> int:
    if short:
        print(f"kvledger: preflight failed: {', '.join(short)} cannot hold a full-context prompt", file=sys.stderr)
        return 1
    return 0


def _foreign(flag: str, value: str, as_json: bool = False) -> int:
    from rich.console import Console
    from rich.table import Table

    from forensics.preflight import from_endpoint, from_log
    try:
        found = from_endpoint(value) if flag == "--endpoint" else from_log(value, flag[2:].split("-")[0])
    except ValueError as e:
        raise InputError(str(e)) from None
    t = Table(title=f"kvledger preflight {flag} {value}")
    for col in ("instance", "engine", "pool (tokens)", "context", "pool / context", "verdict", "from"):
        t.add_column(col, justify="right" if col in ("pool (tokens)", "context", "pool / context") else "left",
                     overflow="fold")
    for i in found:
        ratio = f"{i.pool_tokens / i.context_length:.4f}" if i.fits is not None else "-"
        verdict = {True: "[green]fits", False: "[red]pool < context",
                   None: "[yellow]context unknown" if i.pool_tokens else "[yellow]pool unknown"}[i.fits]
        if i.finding:
            verdict += "; [red]release (below)"
        engine = " ".join(x for x in (i.engine, i.version) if x) or "?"
        t.add_row(i.name, engine, f"{i.pool_tokens:,}" if i.pool_tokens else "?",
                  f"{i.context_length:,}" if i.context_length else "?", ratio, verdict, i.source)
    console = Console(stderr=as_json)          # json: the array alone on stdout, the words on stderr
    if as_json:
        import json
        print(json.dumps([{"instance": i.name, "engine": i.engine, "version": i.version, "pool_tokens": i.pool_tokens,
                           "context_length": i.context_length, "fits": i.fits, "finding": i.finding or None,
                           "source": i.source} for i in found]))
    else:
        console.print(t)
    if any(i.fits is False for i in found):
        console.print("pool < context is the incident's precondition: a prompt longer than the pool is accepted "
                      "and cannot all be held.")
    for i in found:
        if i.finding:
            console.print(f"[red]{i.name}: {i.finding}")
    code = _verdict([i.name for i in found if i.fits is False])
    if any(i.finding for i in found):
        print(f"kvledger: preflight failed: {', '.join(i.name for i in found if i.finding)}: "
              f"{next(i.finding for i in found if i.finding)}", file=sys.stderr)
        code = 1
    return code or (3 if any(i.fits is None for i in found) else 0)
