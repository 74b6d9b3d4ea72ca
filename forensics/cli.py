"""The ``kvledger`` command line (contract: ../shared/CLI.md)."""
from __future__ import annotations

import argparse
import sys
import time

from engine.errors import KvledgerError


def _die(msg: str) -> int:
    print(f"kvledger: error: {msg}", file=sys.stderr)
    return 2


def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.config import EngineConfig, parse_bytes
    from engine.llm import LLMEngine
    from engine.models import load_model
    from engine.request import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    model, tok = load_model(args.model)
    cfg = EngineConfig(kv_memory_budget=parse_bytes(args.memory_budget), context_length=args.context_length,
                       page_size=args.page_size, check_reads=not args.no_check)
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
    for k, v in [("incarnation", f"{req.incarnation:#x}"), ("tenant / cache scope", f"{req.tenant} / {req.scope}"),
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="Paged-attention engine and KV-exposure forensics.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="run the engine on one prompt, print the text and per-request stats")
    g.add_argument("--model", required=True, help="'recall' or an HF-format directory (config.json, safetensors, tokenizer.json)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--tenant", default="default")
    g.add_argument("--memory-budget", default="64MiB", help="KV pool memory budget; capacity in tokens is derived (default 64MiB)")
    g.add_argument("--context-length", type=int, default=4096)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--no-check", action="store_true", help="disable the read-time provenance check")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvledgerError as e:
        return _die(str(e))
    except KeyboardInterrupt:
        return _die("interrupted")


if __name__ == "__main__":
    sys.exit(main())
