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

    @property
    def bf16_queries(self) -> bool:
        """Whether ``attend`` takes a bf16 product's q, k and v as they are (bf16, q and k rotated and
        rounded: ``kernels.rope_bf16``) with ``q_exact`` for the rows whose q it needs unrounded: a
        bf16 pool on the CPU whose prefill attends in bf16, in a step with prefill rows (a decode-only
        step's rows all want q unrounded), nowhere the mass is measured on every page. The prefill
        kernel rounds q to bf16 itself and the pool stores K and V rounded: the same numbers without
        widening the product's result and rounding it back (long bf16: 0.9-1.0 ms of a 4096-row step's
        4 layers, 2026-12-05)."""
        return (self.prefill_dtype == torch.bfloat16 and self.pool.dtype == torch.bfloat16 and self.pool.buf.is_cpu
                and self.backend != "triton" and not self.exact_mass and self.layout.plan is not None
                and bool(self.layout.plan.pre))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
               head_dim: int, scale: float, q_exact=None) -> torch.Tensor:
        """``q_exact``: with a bf16 q (``bf16_queries``), rows -> those rows' q in fp32 as the fp32 path
        makes them (decode rows, a chunk whose mass is measured)."""
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
                                  exact_mass=self.exact_mass, prefill_dtype=self.prefill_dtype, q_exact=q_exact)
        if first:
            self.read_check = res.check
            chk = res.check            # the pages later layers measure the mass on (once a step, not per layer)
            self.flagged = None if chk is None or chk.any_failed is False else chk.bad_slots > 0
            self.page_mass = res.page_mass / self.num_layers
        else:
            self.page_mass += res.page_mass / self.num_layers
        return res.out
