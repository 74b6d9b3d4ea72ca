"""Engine configuration. Pool capacity is derived from a memory budget, never given in tokens."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """'64MiB' -> 67108864. Accepts plain integers (bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        from engine.errors import InputError
        raise InputError(f"cannot parse memory size {text!r}: expected e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


DECODE_PATHS = ("timed", "kernel", "onednn")
DECODE_PATH_ENV = "KVLEDGER_DECODE_KERNEL"


def decode_path() -> str:
    """Where a big fp32 weight's decode rows go (engine/models/llama.py ``kernel_decodes_faster``):
    ``timed`` (the default) whichever of the native kernel and oneDNN is timed faster on this CPU
    when the weight is loaded, or pinned to ``kernel`` or ``onednn`` by ``KVLEDGER_DECODE_KERNEL``:
    the two give the same product to float rounding, so processes that must give the same greedy
    tokens where the two paths time within noise pin one. Commands that build an engine check it
    first (``kvledger: error:`` on anything else)."""
    import os
    value = os.environ.get(DECODE_PATH_ENV, "timed").strip().lower() or "timed"
    if value not in DECODE_PATHS:
        from engine.errors import InputError
        raise InputError(f"{DECODE_PATH_ENV} must be one of {', '.join(DECODE_PATHS)}, got "
                         f"{os.environ[DECODE_PATH_ENV]!r}")
    return value


@dataclass(slots=True)
class EngineConfig:
    # The KV pool is sized from this budget (as SGLang sizes it from memory left after weights);
    # its capacity in tokens is derived and may disagree with context_length.
    kv_memory_budget: int = 64 << 20
    page_size: int = 16
    context_length: int = 2048
    max_num_seqs: int = 16
    max_step_tokens: int = 512          # per-step token budget; longer prompts are prefilled in chunks
    host_memory_budget: int = 64 << 20  # host (CPU) tier for swapped-out pages
    attention_backend: str = "torch"    # torch (reference) | triton (decode steps; engine/triton_attention.py)
    check_reads: bool = True            # the read-time provenance check (DESIGN: the one invariant)
    exact_mass: bool = False            # attention mass on every page read (slower prefill); else on decode
                                        # reads and on every page of a chunk that reads a page the check flags
    fail_on_violation: bool = True      # False: record violations but let the read through (vulnerable)
    zero_on_free: bool = False          # freed pages keep their bytes by default, as in real engines
    detect_double_free: bool = True
    deferred_release: bool = True      # pages an in-flight copy (offload, transfer) may touch are held until it drains
    scope_secret: bytes = b"kvledger-default-scope-secret"
    kv_format_version: str = "kvledger-kv-v1"
    prefix_cache: bool = False          # reuse full prompt pages across requests of one cache scope
    isolation_level: str = "tenant"     # cache scope: user | tenant | org | none (derived server-side, never from the client)
    orgs: dict = field(default_factory=dict)   # tenant -> org, for isolation_level="org"
    shared_pool_path: str | None = None   # the pool lives in this shared file mapping (process mode's decode node)
    preflight: str = "record"          # pool < context at start: record | refuse | fit (engine/kv/preflight.py)
    node_id: str = "node0"
    role: str = "unified"
    seed: int = 0
    keep_freed_buffers: bool = True     # glibc: freed activation buffers stay in the heap, not unmapped
                                        # (engine/osutil.py: each step's would fault in afresh)
    freeze_gc: bool = True              # once built, Python's cyclic GC stops scanning what exists then, as
                                        # vLLM's engine does (engine/osutil.py freeze_heap; KVLEDGER_GC_FREEZE=0 off)
    extra: dict = field(default_factory=dict)
