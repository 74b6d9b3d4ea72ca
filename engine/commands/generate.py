"""``kvledger generate``: one prompt through the engine, the text and the request's stats."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from engine.config import decode_path
from engine.errors import InputError


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    model: str
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    tenant: str = "default"
    memory_budget: str = "64MiB"
    context_length: int | None = None
    page_size: int = 16
    check_reads: bool = True
    format: str = "text"
    dtype: str = "float32"


def add_arguments(g) -> None:
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
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="how the weights and the KV pool are stored (default float32; bfloat16: half the memory "
                        "and the bytes a decode step reads; products in bf16 where the CPU multiplies bf16 "
                        "(AVX512-BF16, AMX), else fp32 arithmetic; an HF checkpoint only)")
    g.add_argument("--no-check", action="store_true", help="disable the read-time provenance check")
    g.add_argument("--format", choices=["text", "json"], default="text",
                   help="text (default): the completion, then its stats table on stderr; json: one object with both")


MAX_TOKENS = 1 << 24          # tokens: no context this engine serves is longer


def physical_memory() -> int:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_config(args) -> GenerateConfig:
    decode_path()                   # KVLEDGER_DECODE_KERNEL checked before anything is loaded
    for flag, value in (("--max-tokens", args.max_tokens), ("--context-length", args.context_length),
                        ("--page-size", args.page_size)):
        if value is not None and not 1 <= value <= MAX_TOKENS:
            raise InputError(f"{flag} must be in [1, {MAX_TOKENS}], got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InputError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2 ** 63:
        raise InputError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.dtype != "float32" and args.model == "recall":
        from engine.models import RECALL_DTYPE
        raise InputError(RECALL_DTYPE)
    from engine.config import parse_bytes
    budget, ram = parse_bytes(args.memory_budget), physical_memory()
    if not 0 < budget <= ram:
        raise InputError(f"--memory-budget {args.memory_budget}: must be more than 0 and at most this machine's "
                         f"memory ({ram / 2**30:.1f} GiB)")
    return GenerateConfig(args.model, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed,
                          args.tenant, args.memory_budget, args.context_length, args.page_size, not args.no_check, format=args.format,
                          dtype=args.dtype)


def run(c: GenerateConfig) -> int:
    from rich.console import Console

    from engine.config import EngineConfig, parse_bytes
    from engine.kv.preflight import pool_tokens_for
    from engine.llm import LLMEngine
    from engine.models import load_model
    from engine.request import SamplingParams

    sp = SamplingParams(max_tokens=c.max_tokens, temperature=c.temperature, top_p=c.top_p, seed=c.seed)
    budget = parse_bytes(c.memory_budget)
    model, tok = load_model(c.model, c.dtype)
    pool = pool_tokens_for(model, EngineConfig(kv_memory_budget=budget, page_size=c.page_size))
    context = c.context_length or pool          # by default the context is what the pool holds
    if c.max_tokens >= context:
        raise InputError(f"--max-tokens {c.max_tokens} leaves no room for the prompt in the context of {context} "
                         "tokens; give fewer (or a larger --context-length)")
    if context > pool:
        print(f"kvledger: warning: --context-length {context} is longer than the KV pool ({pool} tokens from "
              f"--memory-budget {c.memory_budget}): a prompt longer than the pool is the GLM-5.3 incident's "
              "precondition (`kvledger preflight`); raise the budget or lower the context", file=sys.stderr)
    cfg = EngineConfig(kv_memory_budget=budget, context_length=context, page_size=c.page_size,
                       check_reads=c.check_reads)
    eng = LLMEngine(model, tok, cfg)
    t0 = time.perf_counter()
    req = eng.add_request(c.prompt, sp, tenant=c.tenant)
    con = Console(stderr=True, quiet=c.format == "json")
    with con.status("generating", spinner="dots"):
        eng.run_until_done()
    wall = time.perf_counter() - t0
    if req.error is not None:
        from engine.commands.main import die
        return die(str(req.error))
    if c.format == "json":
        import json
        n_out = len(req.output_ids)
        decode_s = (req.finished_at - req.first_token_at) if req.first_token_at else 0.0
        print(json.dumps({"text": eng.text(req), "incarnation": str(req.incarnation), "tenant": req.tenant,
                          "prompt_tokens": len(req.prompt_ids), "completion_tokens": n_out,
                          "finish_reason": req.finish_reason, "ttft_s": req.ttft,
                          "decode_tokens_per_s": (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None,
                          "wall_s": wall, "engine_steps": eng.steps, "read_check": cfg.check_reads,
                          "pool_tokens": eng.pool.capacity_tokens, "context_length": cfg.context_length}))
        return 0
    print(eng.text(req))
    con.print(_stats(eng, req, cfg, wall))
    return 0


def _stats(eng, req, cfg, wall: float):
    from rich.table import Table
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
    return t
