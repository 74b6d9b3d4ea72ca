"""Per-step context handed to a model: where new K/V goes, what each request may read.

Models call ``ctx.attend(layer, q, k, v, ...)``; it stores the new tokens' K/V (and, with layer 0,
their content tags and writer) through one slot mapping, then runs the paged-attention op, which
runs the read check on layer 0 when checking is on. Models never touch the pool directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionOutput, BatchLayout, ReadCheck, paged_attention
from engine.kv.pool import KVPool


@dataclass(slots=True)
class StepContext:
    pool: KVPool
    layout: BatchLayout
    slot_pages: torch.Tensor      # [T] page of each new token
    slot_offsets: torch.Tensor    # [T] offset inside that page
    new_tags: torch.Tensor        # [T] content tag of each new token (the writer's own chain)
    new_writers: torch.Tensor     # [T] writer incarnation of each new token
    check: bool
    num_layers: int
    backend: str = "torch"
    exact_mass: bool = False      # measure the attention mass on every page, not only where the check flags
    prefill_dtype: torch.dtype | None = None    # prefill attention's type (None: q's; paged_attention)
    read_check: ReadCheck | None = None
    flagged: torch.Tensor | None = None     # [B, C] pages whose read failed the check (None: none did)
    page_mass: torch.Tensor | None = field(default=None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
               head_dim: int, scale: float) -> torch.Tensor:
        first = layer == 0
        self.pool.store(layer, self.slot_pages, self.slot_offsets, k, v,
                        self.new_tags if first else None, self.new_writers if first else None)
        if self.backend == "triton" and int(self.layout.query_lens.max()) == 1:   # decode-only step
            from engine.triton_attention import paged_decode
            res: AttentionOutput = paged_decode(q, self.pool, layer, self.layout, num_kv_heads, head_dim, scale,
                                                check=self.check and first)
        else:   # layer 0 runs the check; later layers measure the mass on the pages it flagged
            res = paged_attention(q, self.pool, layer, self.layout, num_kv_heads, head_dim, scale,
                                  check=self.check and first, mass_pages=None if first else self.flagged,
                                  exact_mass=self.exact_mass, prefill_dtype=self.prefill_dtype)
        if first:
            self.read_check = res.check
            chk = res.check            # the pages later layers measure the mass on (once a step, not per layer)
            self.flagged = None if chk is None or chk.any_failed is False else chk.bad_slots > 0
            self.page_mass = res.page_mass / self.num_layers
        else:
            self.page_mass += res.page_mass / self.num_layers
        return res.out
