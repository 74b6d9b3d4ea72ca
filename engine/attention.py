"""The paged-attention op (torch reference backend) and the read check.

One call attends a batch of requests over their pages and, when asked, checks every slot it
reads against the one invariant of DESIGN.md:

    slot (page p, offset o) at logical position i may be read by request r only if
      pool.generation[p]   == the generation r was granted for p, and
      pool.tags[p, o]      == r's own content-tag chain at i.

Ownership ranges per request b (seq_len = tokens after this step, q_len = new tokens):
    keys   [0, seq_len)                   read through block_tables[b]
    query  [seq_len - q_len, seq_len)     causal: query at position t sees keys [0, t]
The check covers every key slot in [0, seq_len): exactly what the attention reads.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.pool import KVPool


class ReadCheck(NamedTuple):
    """Per request b and block-table column c."""
    bad_slots: torch.Tensor     # [B, C] int64: slots on that page that failed generation or tag check
    slots_read: torch.Tensor    # [B, C] int64: slots of that page inside [0, seq_len)
    found_writers: torch.Tensor  # [B, C, S] int64: writer incarnation found in the tag plane
    found_gen: torch.Tensor     # [B, C] int64: generation found in the page header
    bad_mask: torch.Tensor      # [B, C] int64: bit s set <=> slot s of that page failed


class AttentionOutput(NamedTuple):
    out: torch.Tensor           # [T, Hq * D]
    page_mass: torch.Tensor     # [B, C] mean softmax mass per query and head that landed on each page
    check: ReadCheck | None


class BatchLayout(NamedTuple):
    """Token -> request mapping for a flattened varlen batch, precomputed once per step."""
    block_tables: torch.Tensor   # [B, C] int64, -1 padded
    seq_lens: torch.Tensor       # [B]
    query_lens: torch.Tensor     # [B]
    positions: torch.Tensor      # [T]
    tok_batch: torch.Tensor      # [T] request index of each query token
    tok_row: torch.Tensor        # [T] row of each query token inside its request
    expected_gen: torch.Tensor   # [B, C]
    expected_tags: torch.Tensor  # [B, C * S]

    @staticmethod
    def build(block_tables, seq_lens, query_lens, expected_gen, expected_tags) -> "BatchLayout":
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.long)
        query_lens = torch.as_tensor(query_lens, dtype=torch.long)
        tok_batch = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        tok_row = torch.arange(int(query_lens.sum())) - starts[tok_batch]
        positions = (seq_lens - query_lens)[tok_batch] + tok_row
        return BatchLayout(block_tables, seq_lens, query_lens, positions, tok_batch, tok_row,
                           expected_gen, expected_tags)


def read_check(pool: KVPool, lay: BatchLayout) -> ReadCheck:
    """The provenance check over exactly the slots the attention reads."""
    B, C = lay.block_tables.shape
    S = pool.page_size
    bt = lay.block_tables.clamp(min=0)
    slot_pos = torch.arange(C * S)
    in_range = slot_pos[None, :] < lay.seq_lens[:, None]                       # [B, C*S]
    found_gen = pool.generation[bt]                                            # [B, C]
    gen_bad = (found_gen != lay.expected_gen).repeat_interleave(S, dim=1)      # [B, C*S]
    tag_bad = pool.tags[bt].reshape(B, C * S) != lay.expected_tags
    bad = ((gen_bad | tag_bad) & in_range).view(B, C, S)
    bits = torch.ones(S, dtype=torch.long) << torch.arange(S)
    return ReadCheck(bad.sum(-1), in_range.view(B, C, S).sum(-1), pool.writers[bt], found_gen,
                     (bad.long() * bits).sum(-1))


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, lay: BatchLayout, num_kv_heads: int,
                    head_dim: int, scale: float, check: bool) -> AttentionOutput:
    T, Hq, D = q.shape                                                         # q: [T, Hq, D]
    B, C = lay.block_tables.shape
    S = pool.page_size
    K = C * S
    bt = lay.block_tables.clamp(min=0)
    k = pool.k(layer)[bt].reshape(B, K, num_kv_heads, D).to(q.dtype)
    v = pool.v(layer)[bt].reshape(B, K, num_kv_heads, D).to(q.dtype)
    maxq = int(lay.query_lens.max())
    g = Hq // num_kv_heads
    qp = q.new_zeros(B, maxq, Hq, D)
    qp[lay.tok_batch, lay.tok_row] = q
    qpos = torch.full((B, maxq), -1, dtype=torch.long)
    qpos[lay.tok_batch, lay.tok_row] = lay.positions
    kpos = torch.arange(K)
    valid = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lay.seq_lens[:, None, None])
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(B, maxq, num_kv_heads, g, D), k) * scale
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)                     # padded rows -> 0
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(B, maxq, Hq * D)
    mass = probs.sum(dim=(1, 2, 3)) / (Hq * lay.query_lens[:, None]).to(probs.dtype)
    page_mass = mass.view(B, C, S).sum(-1)
    return AttentionOutput(out[lay.tok_batch, lay.tok_row], page_mass, read_check(pool, lay) if check else None)
