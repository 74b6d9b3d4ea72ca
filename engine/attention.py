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

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kv.pool import KVPool


class ReadCheck(NamedTuple):
    """Per request b and block-table column c."""
    bad_slots: torch.Tensor     # [B, C] int64: slots on that page that failed generation or tag check
    slots_read: torch.Tensor    # [B, C] int64: slots of that page inside [0, seq_len)
    found_writers: torch.Tensor  # [B, C, S] int64: writer incarnation found in the tag plane
    found_gen: torch.Tensor     # [B, C] int64: generation found in the page header
    bad_mask: torch.Tensor      # [B, C] int64: bit s set <=> slot s of that page failed
    any_failed: bool | None = None  # whether any slot failed, when the check knows it without a sync (None: look)


class AttentionOutput(NamedTuple):
    out: torch.Tensor           # [T, Hq * D]
    page_mass: torch.Tensor     # [B, C] mean softmax mass per query and head that landed on each page (NaN: not measured)
    check: ReadCheck | None


class VarlenPlan(NamedTuple):
    """How one step's requests are attended, computed once per step and reused by every layer.

    Decode requests (one query token each) are batched together over their own pages only;
    every prefill chunk is attended on its own (no padding across requests)."""
    dec_b: torch.Tensor          # [Bd] batch index of each decode request
    dec_tok: torch.Tensor        # [Bd] its query token
    dec_pages: torch.Tensor      # [Bd, Cd] pages to read (clamped; masked by dec_bias)
    dec_bias: torch.Tensor       # [Bd, 1, Cd * S] 0 for a key slot inside [0, seq_len), -inf outside
    dec_seq: torch.Tensor        # [Bd] seq_len of each decode request
    # per prefill chunk: (b, first token, q_len, pages [Cb], keys n (its queries are positions n - q_len
    # .. n - 1), whether the chunk is the request's whole context so far - its first chunk, nothing
    # cached: plain causal attention)
    pre: tuple
    masks: dict                  # chunk index -> its mask [q_len, Cb * S], built where a path needs it

    def mask(self, i: int, page_size: int) -> torch.Tensor:
        """Chunk i's mask: query r reads key slot k where k <= n - q_len + r (and k < n)."""
        if i not in self.masks:
            _, _, q, pages, n, _ = self.pre[i]
            kpos = np.arange(len(pages) * page_size)
            self.masks[i] = torch.from_numpy((kpos[None, :] <= np.arange(n - q, n)[:, None]) & (kpos[None, :] < n))
        return self.masks[i]


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
    plan: VarlenPlan | None = None

    @staticmethod
    def build(block_tables, seq_lens, query_lens, expected_gen, expected_tags) -> "BatchLayout":
        # the index arithmetic runs in numpy: a step's layout is a dozen small operations, each ~1 us
        # there against torch's 3-8 us of dispatch (repeat_interleave alone: ~100 us)
        sl, ql = _int64(seq_lens), _int64(query_lens)
        tok_batch = np.repeat(np.arange(len(ql)), ql)
        starts = np.cumsum(ql) - ql
        tok_row = np.arange(int(ql.sum())) - starts[tok_batch]
        positions = (sl - ql)[tok_batch] + tok_row
        B, C = block_tables.shape
        S = expected_tags.shape[1] // max(C, 1)
        bt = np.maximum(_int64(block_tables), 0)
        pages_of = (sl + S - 1) // S
        dec_b = np.flatnonzero(ql == 1)
        Cd = int(pages_of[dec_b].max()) if len(dec_b) else 0
        dec_bias = np.where(np.arange(Cd * S)[None, None, :] >= sl[dec_b, None, None], np.float32("-inf"),
                            np.float32(0))
        t = torch.from_numpy
        pre = []
        for b in np.flatnonzero(ql > 1).tolist():
            q, n, cb = int(ql[b]), int(sl[b]), int(pages_of[b])
            pre.append((b, int(starts[b]), q, t(bt[b, :cb]), n, q == n))
        plan = VarlenPlan(t(dec_b), t(starts[dec_b]), t(np.ascontiguousarray(bt[dec_b, :Cd])), t(dec_bias),
                          t(sl[dec_b]), tuple(pre), {})
        return BatchLayout(block_tables, t(sl), t(ql), t(positions), t(tok_batch), t(tok_row),
                           expected_gen, expected_tags, plan)


def _int64(x) -> np.ndarray:
    """A list or tensor of lengths as an int64 numpy array (a tensor's own memory where it can)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.long).numpy()
    return np.asarray(x, dtype=np.int64)


def read_check(pool: KVPool, lay: BatchLayout) -> ReadCheck:
    """The provenance check over exactly the slots the attention reads.

    On a CPU pool it runs as one native pass (engine/kernels) where the kernels are built, else in
    numpy over zero-copy views of the pool's header and tag planes (a dozen small array operations:
    ~200 us a step on the tiny model on a 2-core box; torch's ops cost 3-8 us of dispatch each, more).
    Same results, field for field (tests/test_attention.py holds each to ``_read_check_torch``,
    which runs on other devices)."""
    if not pool.buf.is_cpu:
        return _read_check_torch(pool, lay)
    native = kernels.read_check(pool, lay.block_tables, lay.seq_lens, lay.expected_gen, lay.expected_tags)
    if native is not None:           # the same rule in one C pass (engine/kernels/dense.c)
        *fields, failed = native
        return ReadCheck(*fields, failed > 0)
    B, C = lay.block_tables.shape
    S = pool.page_size
    offs, pos, bits = _check_consts(S, C)
    views = getattr(pool, "_np_views", None)
    if views is None:
        views = pool._np_views = (pool.generation.numpy(), pool.tags.numpy(), pool.writers.numpy())
    gen, tags, writers = views
    flat = np.maximum(lay.block_tables.numpy().reshape(-1), 0)
    seq = lay.seq_lens.numpy()
    found_gen = gen[flat].reshape(B, C)
    bad = tags[flat].reshape(B, C, S) != lay.expected_tags.numpy().reshape(B, C, S)
    bad |= (found_gen != lay.expected_gen.numpy())[:, :, None]
    bad &= pos < seq[:, None, None]                                   # only slots in [0, seq_len)
    slots = np.clip(seq[:, None] - offs, 0, S)
    failed = bool(bad.any())
    if failed:
        bad_slots, mask = bad.sum(-1), (bad * bits).sum(-1)
    else:                                                             # the usual step: nothing failed
        bad_slots = mask = np.zeros((B, C), np.int64)
    t = torch.from_numpy
    return ReadCheck(t(bad_slots), t(slots), t(writers[flat].reshape(B, C, S)), t(found_gen), t(mask), failed)


_CHECK_CONSTS: dict = {}


def _check_consts(S: int, C: int) -> tuple:
    """Per (page size, block-table width): slot offsets of each column, each slot's position, bit s."""
    c = _CHECK_CONSTS.get((S, C))
    if c is None:
        ar, offs = np.arange(S), np.arange(0, C * S, S)
        c = _CHECK_CONSTS[(S, C)] = (offs, (offs[:, None] + ar)[None], np.left_shift(1, ar, dtype=np.int64))
    return c


def _read_check_torch(pool: KVPool, lay: BatchLayout) -> ReadCheck:
    """read_check in torch ops (any device)."""
    B, C = lay.block_tables.shape
    S = pool.page_size
    flat = lay.block_tables.clamp(min=0).view(-1)
    found_gen = pool.generation.index_select(0, flat).view(B, C)                   # [B, C]
    slots = (lay.seq_lens[:, None] - torch.arange(0, C * S, S)[None, :]).clamp_(0, S)  # [B, C] slots read
    bad = pool.tags.index_select(0, flat).view(B, C, S) != lay.expected_tags.view(B, C, S)
    bad |= (found_gen != lay.expected_gen)[:, :, None]
    bad &= torch.arange(S)[None, None, :] < slots[:, :, None]                    # only slots in [0, seq_len)
    bits = torch.ones(S, dtype=torch.long) << torch.arange(S)
    return ReadCheck(bad.sum(-1), slots, pool.writers.index_select(0, flat).view(B, C, S), found_gen,
                     (bad * bits).sum(-1))


def padded_attention(q: torch.Tensor, pool: KVPool, layer: int, lay: BatchLayout, num_kv_heads: int,
                     head_dim: int, scale: float, check: bool) -> AttentionOutput:
    """The reference: every request padded to the longest query and key range, every score
    materialised, the mass measured on every page. Simple and slow; tests hold the fast path to it."""
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


def _attend_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float):
    """q [N, Hkv, g, Q, D], k/v [N, K, Hkv, D], valid [N, Q, K] -> out [N, Q, Hkv, g, D] and the
    softmax mass summed over heads and queries on each key, [N, K]."""
    scores = torch.einsum("nhgqd,nkhd->nhgqk", q, k).mul_(scale)
    scores.masked_fill_(~valid[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nhgqk,nkhd->nqhgd", probs, v), probs.sum(dim=(1, 2, 3))


def bf16_prefill_widened(head_dim: int) -> bool:
    """Whether a bf16 pool's prefill chunks (heads of ``head_dim`` values) are better attended by the
    fp32 kernel over their values widened than in bf16 products: where these kernels run that one and
    no bf16 one (neither AMX tiles nor AVX512-BF16 in this build, or a head size only the widened one
    takes), the prefill in bf16 would be torch's SDPA after a gather - slower than the widened kernel
    (the engine on `long` in bf16 1.32x on an AMD EPYC before its AVX512-BF16 kernel, 2026-12-07) and
    less exact. At most one call of each on a pool of one page (kernels.CALLS left as it was)."""
    if kernels.native() is None:
        return False
    pool = KVPool(1, head_dim, 4, 4 * KVPool.page_bytes_for(1, head_dim, 4, torch.bfloat16), dtype=torch.bfloat16)
    q, out, calls = torch.zeros(2, 1, head_dim), torch.empty(2, 1, head_dim), kernels.CALLS
    try:
        return (not kernels.paged_prefill(q, pool, 0, torch.tensor([0]), 2, 1, 1.0, out, bf16_products=True)
                and kernels.paged_prefill(q, pool, 0, torch.tensor([0]), 2, 1, 1.0, out, bf16_products=False))
    finally:
        kernels.CALLS = calls


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, lay: BatchLayout, num_kv_heads: int,
                    head_dim: int, scale: float, check: bool, mass_pages: torch.Tensor | None = None,
                    exact_mass: bool = False, prefill_dtype: torch.dtype | None = None,
                    q_exact=None) -> AttentionOutput:
    """Varlen paged attention: no padding across requests, only the pages in each request's range read.

    - decode requests: one call of the native kernel (engine/kernels: K/V read in place from the
      records, no gather), else one batched attention over their own pages; mass measured on every page;
    - prefill chunks: each on its own; PyTorch's fused ``scaled_dot_product_attention`` (which never
      materialises the scores) unless the chunk reads a page the read check flagged (``mass_pages``;
      on layer 0 the check below decides) or ``exact_mass``: then the scores are materialised and the
      mass is measured on every page of that chunk. Mass not measured is NaN (telemetry: NULL).
      An fp32 pool's chunks: the native kernel (engine/kernels/paged_prefill.c: K/V read from the page
      records, no gather, no mask tensor; every product in fp32; 1.3-2.1x SDPA) where the build has
      AVX-512 or AVX2 with FMA, else SDPA. ``prefill_dtype`` bf16 with a bf16 pool: the native kernel in bf16
      products (the same file: on AMX tiles 1.6-2.3x SDPA, on AVX512-BF16's dot products without tiles
      2.6-3.3x; bench/prefill_attention.py)
      where the CPU has either, else SDPA on the pool's bf16 K/V as gathered (no widened copy) -
      either way q rounded to bf16, fp32 accumulation, as vLLM-CPU and transformers attend in bf16 -
      where the CPU multiplies bf16 natively (the model decides: ``llama.bf16_gemm``, and not where
      these kernels run only the widened one below: ``bf16_prefill_widened``); elsewhere, and
      for a chunk whose mass is measured, fp32 - a bf16 pool's chunks then through the fp32 kernel
      over its K/V widened as they are packed (the numbers of SDPA's fp32 path after the gather).
    The read check itself always covers every slot read.
    A bf16 q (``StepContext.bf16_queries``: rounded already, as the bf16 prefill rounds it) comes with
    ``q_exact`` (rows -> their fp32 q): the decode rows and any chunk not attended in bf16 take that."""
    T, Hq, D = q.shape
    bf16q = q_exact is not None and q.dtype == torch.bfloat16
    qdt = torch.float32 if bf16q else q.dtype
    B, C = lay.block_tables.shape
    S = pool.page_size
    g = Hq // num_kv_heads
    plan = lay.plan
    chk = read_check(pool, lay) if check else None
    if mass_pages is None and chk is not None and chk.any_failed is not False:
        mass_pages = chk.bad_slots > 0
    kl, vl = pool.k(layer), pool.v(layer)
    out = torch.empty((T, Hq, D), dtype=qdt, device=q.device)
    page_mass = torch.zeros((B, C), dtype=qdt)         # pages not read: no mass
    # the decode rows' q and out: q's and out's rows, or (bf16 q) fp32 rows of their own
    qs, qtok, od = q, plan.dec_tok, out
    if bf16q and len(plan.dec_b):
        qs, qtok = q_exact(plan.dec_tok), torch.arange(len(plan.dec_b))
        od = torch.empty((len(qtok), Hq, D), dtype=qdt)
    if len(plan.dec_b) and kernels.paged_decode(qs, qtok, pool, layer, plan.dec_pages, plan.dec_seq,
                                                num_kv_heads, scale, od, page_mass, plan.dec_b):
        if od is not out:
            out[plan.dec_tok] = od
    elif len(plan.dec_b):
        # the torch path (no native kernel): per KV head, gather its pages into [keys, D] and batch-matmul
        Bd, Cd = plan.dec_pages.shape
        flat = plan.dec_pages.view(-1)
        kh, vh = pool.head_views(layer, num_kv_heads)
        qd = qs.index_select(0, qtok).view(Bd, num_kv_heads, g, D)
        scores = torch.stack([torch.bmm(qd[:, h], kh[h].index_select(0, flat).view(Bd, Cd * S, D).to(qdt)
                                        .transpose(1, 2)) for h in range(num_kv_heads)], 1)
        probs = torch.softmax(scores.mul_(scale).add_(plan.dec_bias[:, None]), dim=-1)   # [Bd, Hkv, g, K]
        o = torch.stack([torch.bmm(probs[:, h], vh[h].index_select(0, flat).view(Bd, Cd * S, D).to(qdt))
                         for h in range(num_kv_heads)], 1)
        out[plan.dec_tok] = o.view(Bd, Hq, D)
        page_mass[plan.dec_b, :Cd] = probs.sum(dim=(1, 2)).view(Bd, Cd, S).sum(-1) / Hq
    low = prefill_dtype is not None and prefill_dtype != qdt and kl.dtype == prefill_dtype
    # the native prefill kernel: a bf16 pool's where the products are bf16 (AMX tiles or AVX512-BF16),
    # else over its values widened (fp32 FMAs, as an fp32 pool's)
    native = qdt == torch.float32 and kl.dtype in (torch.bfloat16, torch.float32)
    for i, (b, t0, ql, pages, n, from_start) in enumerate(plan.pre):
        cb = len(pages)
        qb = q[t0:t0 + ql]
        exact = exact_mass or (mass_pages is not None and bool(mass_pages[b].any()))
        if (native and not exact
                and kernels.paged_prefill(qb, pool, layer, pages, n, num_kv_heads, scale, out[t0:t0 + ql],
                                          bf16_products=low)):
            page_mass[b, :cb] = float("nan")
            continue
        if bf16q and (exact or not low):        # this chunk's q unrounded
            qb = q_exact(torch.arange(t0, t0 + ql))
        k = kl.index_select(0, pages).view(cb * S, num_kv_heads, D)
        v = vl.index_select(0, pages).view(cb * S, num_kv_heads, D)
        mask = None if from_start and not exact else plan.mask(i, S)
        if exact or not low:
            k, v = k.to(qdt), v.to(qdt)
        else:
            qb = qb.to(prefill_dtype)
        if exact:
            o, mass = _attend_exact(qb.view(1, ql, num_kv_heads, g, D).permute(0, 2, 3, 1, 4), k[None], v[None],
                                    mask[None], scale)
            out[t0:t0 + ql] = o.reshape(ql, Hq, D)
            page_mass[b, :cb] = mass.view(cb, S).sum(-1) / (Hq * ql)
        else:
            causal = from_start      # keys 0..ql-1 under the square causal mask: SDPA skips masked blocks
            if causal:
                k, v = k[:ql], v[:ql]
            o = F.scaled_dot_product_attention(qb.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=None if causal else mask,
                                               is_causal=causal, scale=scale, enable_gqa=True)
            out[t0:t0 + ql] = o[0].transpose(0, 1)
            page_mass[b, :cb] = float("nan")
    return AttentionOutput(out.view(T, Hq * D), page_mass, chk)
