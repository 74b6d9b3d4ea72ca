"""Builds one step's slot mapping, block tables and expected provenance, and runs the model.

For each scheduled request (seq_len' = num_computed + num_tokens after this step):
    [0, num_computed)          already in the pool: read, and checked
    [num_computed, seq_len')   written now (K/V + tag + writer through one slot mapping),
                               then read and checked like the rest
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.attention import BatchLayout, ReadCheck
from engine.kv.pool import KVPool
from engine.scheduler import Scheduled
from engine.step import StepContext


class StepOutput(NamedTuple):
    """Everything one step did, as tensors (telemetry consumes these, never per-read objects)."""
    batch: list[Scheduled]
    layout: BatchLayout
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    new_tags: torch.Tensor
    new_writers: torch.Tensor
    read_check: ReadCheck | None
    page_mass: torch.Tensor
    logits: torch.Tensor            # [R, vocab] for the requests in `sampling`
    sampling: list[int]             # batch indices whose last token's logits are in `logits`
    # slot_pages as the numpy array it was built from (same memory): the ledger reads the pages'
    # generations through it on the engine thread, where a tensor's .numpy() costs ~16 us a step on
    # the caches the model's work has just refilled (0.6 us in a loop)
    slot_pages_np: "np.ndarray | None" = None


class ModelRunner:
    def __init__(self, model, pool: KVPool, check_reads: bool, backend: str = "torch", exact_mass: bool = False):
        self.model, self.pool, self.check_reads, self.backend = model, pool, check_reads, backend
        self.exact_mass = exact_mass

    def run(self, batch: list[Scheduled]) -> StepOutput:
        # the step's tables are built in numpy and handed to torch without a copy: a few dozen small
        # operations a step, each ~1 us there against torch's 3-8 us of dispatch (bench/engine.py)
        S = self.pool.page_size
        B = len(batch)
        C = max(len(s.req.block_table) for s in batch)
        bt = np.full((B, C), -1, dtype=np.int64)          # block tables, -1 padded
        gens = np.zeros((B, C), dtype=np.int64)           # the generation granted for each page
        exp_tags = np.zeros((B, C * S), dtype=np.int64)
        ids, seq_lens, q_lens, sampling, writers = [], [], [], [], []
        for b, (req, n) in enumerate(batch):
            end = req.num_computed + n
            bt[b, :len(req.block_table)] = req.block_table
            gens[b, :len(req.page_gens)] = req.page_gens
            exp_tags[b, :end] = req.chain.array()[:end]
            ids += req.all_ids[req.num_computed:end]
            seq_lens.append(end)
            q_lens.append(n)
            writers.append(req.incarnation)
            if end == req.seq_len:
                sampling.append(b)
        t = torch.from_numpy
        lay = BatchLayout.build(t(bt), seq_lens, q_lens, t(gens), t(exp_tags))
        tok_batch, positions = lay.tok_batch.numpy(), lay.positions.numpy()
        slot_pages_np = bt[tok_batch, positions // S]
        slot_pages = t(slot_pages_np)
        slot_offsets = t(positions % S)
        new_tags = t(exp_tags[tok_batch, positions])
        new_writers = t(np.repeat(np.asarray(writers, dtype=np.int64), q_lens))
        ctx = StepContext(self.pool, lay, slot_pages, slot_offsets, new_tags, new_writers,
                          self.check_reads, self.model.num_layers, self.backend, self.exact_mass,
                          getattr(self.model, "prefill_dtype", None))
        rows = t((np.cumsum(q_lens) - 1)[sampling])
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), lay.positions, ctx, rows)
        return StepOutput(batch, lay, slot_pages, slot_offsets, new_tags, ctx.new_writers, ctx.read_check,
                          ctx.page_mass, logits, sampling, slot_pages_np)
