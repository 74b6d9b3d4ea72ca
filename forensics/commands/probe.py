"""``kvledger probe``: the isolation probe against any OpenAI-compatible endpoint; exit 0 pass,
1 finding, 3 inconclusive. With ``--store`` the run and its findings are recorded (pseudonyms)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.errors import InputError


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    base_url: str
    key_a: str
    key_b: str
    model: str | None = None
    checks: tuple[str, ...] = ("limits", "usage", "canary", "salt", "timing", "abort")
    pool_tokens: int | None = None
    context_length: int | None = None
    tokenizer: str | None = None
    samples: int = 6
    format: str = "table"
    store: str | None = None


def add_arguments(pb) -> None:
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


def make_config(a) -> ProbeConfig:
    from forensics.probe import validate
    checks = tuple(c.strip() for c in a.checks.split(",") if c.strip())
    validate(list(checks), a.samples, a.pool_tokens, a.context_length)
    return ProbeConfig(a.base_url, a.key_a, a.key_b, a.model, checks, a.pool_tokens, a.context_length, a.tokenizer,
                       a.samples, a.format, a.store)


def _writer(store: str):
    """The store writer a probe records into, opened (and the store verified) before any request."""
    from telemetry.store import SegmentWriter, StoreError
    try:
        return SegmentWriter(store)
    except StoreError as e:
        raise InputError(f"--store {store}: {e}") from None


def run(c: ProbeConfig) -> int:
    from rich.console import Console
    from rich.progress import Progress

    import httpx

    from forensics.probe import Endpoint, ProbeError, as_json, exit_code, record, run_probe
    writer = _writer(c.store) if c.store else None
    try:                                   # the writer is closed (sealed) on every path, errors included
        target = Endpoint(c.base_url, c.key_a, c.key_b, c.model, c.tokenizer)
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"probing {c.base_url}", total=None)
            try:
                results, meta = run_probe(target, list(c.checks), c.pool_tokens, c.context_length, c.samples,
                                          progress=lambda: bar.advance(task))
            except httpx.HTTPError as e:
                raise ProbeError(f"{c.base_url}: the endpoint stopped answering mid-probe ({e}); nothing was "
                                 "judged") from None
        if writer is not None:
            record(writer, results, meta, c.key_a, c.key_b)
    finally:
        if writer is not None:
            writer.close()
    if c.format == "json":
        print(as_json(results, meta))
    else:
        Console().print(_table(results, meta))
    return exit_code(results)


def _table(results, meta):
    from rich.table import Table
    t = Table(title=f"kvledger probe {meta['base_url']} (model {meta['model']}, pool {meta['pool_tokens']}, "
                    f"context {meta['context_length']} from {meta['discovered_from']}; {meta['requests']} requests)")
    for col in ("check", "verdict", "detail"):
        t.add_column(col, overflow="fold")
    colour = {"pass": "green", "finding": "red", "inconclusive": "yellow"}
    for r in results:
        t.add_row(r.check, f"[{colour[r.verdict]}]{r.verdict}", r.detail)
        for e in r.evidence:
            t.add_row("", "", f"[red]{json.dumps(e)}")
    return t
