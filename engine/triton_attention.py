"""Paged decode attention in Triton, with the read check of DESIGN.md inside the kernel.

One program per (request b, KV head, split of the context). For each page of its split it loads,
with the K/V tile, the page's generation and every slot's content tag (and writer), compares them
with what the request was granted and its own tag chain, and writes per (request, page): the
failing-slot bitmask and count, the generation and writers found, and the log-sum-exp of the
page's attention scores (per query head). The check is the same pass as the attention: no second
kernel reads the pool. A tiny torch epilogue combines the splits (split-K, as FlashDecoding) and
turns page log-sum-exps into attention mass per page.

Decode only (one query token per request); ``paged_attention`` routes mixed prefill batches to the
torch reference. On a machine without a GPU it runs under ``TRITON_INTERPRET=1`` (set before
Triton is imported). ``LAUNCHES`` counts kernel launches, so tests can tell the kernel ran.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.attention import AttentionOutput, BatchLayout, ReadCheck

LAUNCHES = 0
PAGES_PER_SPLIT = 8


class Tuning(NamedTuple):
    """Launch shape of the kernel. ``pages_per_block`` pages (of S slots) are loaded and scored per
    loop iteration; ``pages_per_split`` pages per program (split-K); ``dot`` scores and weighs with
    ``tl.dot`` (tensor cores on a GPU; query heads padded to 16 rows) instead of broadcast sums."""
    pages_per_split: int = PAGES_PER_SPLIT
    pages_per_block: int = 1
    num_warps: int = 4
    dot: bool = False
    num_stages: int = 3          # Triton's software pipelining depth of the page loop (GPU only)


# bench/gpu_check.py sweeps these on a GPU and reports which is fastest; on a GPU the default is
# the fastest measured there (README, "GPU"), in the CPU interpreter the plain shape
DEFAULT = Tuning()
GPU_DEFAULT = Tuning(pages_per_split=64, pages_per_block=2, num_warps=2, dot=True, num_stages=4)


@triton.jit
def _paged_decode(q_ptr, kv_ptr, i64_ptr, bt_ptr, seq_ptr, egen_ptr, etag_ptr,
                  acc_ptr, m_ptr, l_ptr, lse_ptr, fgen_ptr, fmask_ptr, fcount_ptr, fwriter_ptr,
                  scale, C, SPLITS, Hq, NKV,
                  page_stride, rec_stride, k_off, v_off,                 # element strides of the K/V views
                  gen_stride, tag_page_stride, tag_rec_stride, tag_off, writer_off,   # int64 views
                  S: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, PPS: tl.constexpr, PB: tl.constexpr, DOT: tl.constexpr,
                  F32: tl.constexpr, CHECK: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_ptr + b)
    n_pages = (seq_len + S - 1) // S
    c_start = split * PPS
    c_end = tl.minimum(c_start + PPS, n_pages)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, PB * S)                 # slot of the block: page j // S of the block, slot j % S
    jp = j // S
    js = j % S
    pb = tl.arange(0, PB)
    gmask = g < G
    dmask = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + (b * Hq + heads)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for c0 in range(c_start, c_end, PB):
        cpage = c0 + jp
        mine = cpage < c_end                 # pages past the split's end belong to the next program
        page = tl.load(bt_ptr + b * C + cpage, mask=mine, other=0)
        pos = cpage * S + js
        valid = mine & (pos < seq_len)
        rec = page * page_stride + js * rec_stride
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(kv_ptr + (rec + k_off + kvh * D)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + (rec + v_off + kvh * D)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT:
            if F32:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q.to(k.dtype), tl.trans(k)) * scale          # [BLOCK_G, PB * S]
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # per page log-sum-exp (pages past the split's end come out -inf and are not stored)
        s3 = tl.reshape(scores, [BLOCK_G, PB, S])
        m_p = tl.max(s3, axis=2)
        m_p = tl.where(m_p == float("-inf"), 0.0, m_p)
        lse_p = m_p + tl.log(tl.sum(tl.exp(s3 - m_p[:, :, None]), axis=2))
        tl.store(lse_ptr + (b * Hq + heads)[:, None] * C + c0 + pb[None, :], lse_p,
                 mask=gmask[:, None] & (c0 + pb < c_end)[None, :])
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT:
            if F32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
        if CHECK:
            if kvh == (c0 // PB) % NKV:
                # the read check, on the same pages, in the same pass: generation + content tag per
                # slot; one KV head's program per block does it, the blocks dealt round the heads
                gen = tl.load(i64_ptr + page * gen_stride, mask=mine, other=0)
                exp_gen = tl.load(egen_ptr + b * C + cpage, mask=mine, other=0)
                trec = page * tag_page_stride + js * tag_rec_stride
                tags = tl.load(i64_ptr + trec + tag_off, mask=valid, other=0)
                writers = tl.load(i64_ptr + trec + writer_off, mask=valid, other=0)
                exp_tags = tl.load(etag_ptr + b * C * S + pos, mask=valid, other=0)
                bad = ((tags != exp_tags) | (gen != exp_gen)) & valid
                bits = tl.reshape(tl.where(bad, tl.full([PB * S], 1, tl.int64) << js.to(tl.int64), 0), [PB, S])
                count = tl.reshape(bad.to(tl.int64), [PB, S])
                pmine = c0 + pb < c_end
                ppage = tl.load(bt_ptr + b * C + c0 + pb, mask=pmine, other=0)
                tl.store(fgen_ptr + b * C + c0 + pb, tl.load(i64_ptr + ppage * gen_stride, mask=pmine, other=0),
                         mask=pmine)
                tl.store(fmask_ptr + b * C + c0 + pb, tl.sum(bits, axis=1), mask=pmine)
                tl.store(fcount_ptr + b * C + c0 + pb, tl.sum(count, axis=1), mask=pmine)
                tl.store(fwriter_ptr + (b * C + cpage) * S + js, writers, mask=valid)
    out = ((b * Hq + heads) * SPLITS + split)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(m_ptr + out, m_i, mask=gmask)
    tl.store(l_ptr + out, l_i, mask=gmask)


def paged_decode(q: torch.Tensor, pool, layer: int, lay: BatchLayout, num_kv_heads: int, head_dim: int,
                 scale: float, check: bool, tuning: Tuning | None = None) -> AttentionOutput:
    """q: [B, Hq * D] or [B, Hq, D], one query token per request."""
    global LAUNCHES
    B, C = lay.block_tables.shape
    S, D, dev = pool.page_size, head_dim, q.device
    Hq = q.numel() // (B * D)
    G = Hq // num_kv_heads
    t = tuning or (GPU_DEFAULT if dev.type == "cuda" else DEFAULT)
    pb = t.pages_per_block
    while t.dot and pb * S < 16:                         # tl.dot's inner size is at least 16
        pb *= 2
    pps = max(t.pages_per_split, pb)
    splits = max(1, math.ceil(C / pps))
    q = q.reshape(B, Hq, D).float().contiguous()
    el = pool.buf.view(pool.dtype)
    k_view, v_view = pool.k(layer), pool.v(layer)
    i64 = pool.buf.view(torch.int64)
    f32 = dict(dtype=torch.float32, device=dev)
    acc = torch.empty(B, Hq, splits, D, **f32)
    m = torch.empty(B, Hq, splits, **f32)
    l_ = torch.empty(B, Hq, splits, **f32)
    lse = torch.full((B, Hq, C), float("-inf"), **f32)
    i = dict(dtype=torch.int64, device=dev)
    fgen, fmask, fcount = torch.zeros(B, C, **i), torch.zeros(B, C, **i), torch.zeros(B, C, **i)
    fwriters = torch.zeros(B, C, S, **i)
    bt = lay.block_tables.clamp(min=0).contiguous()
    # tl.dot wants at least 16 rows, columns and inner size: query heads are padded, pages grouped
    block_g = max(triton.next_power_of_2(G), 16 if t.dot else 1)
    _paged_decode[(B, num_kv_heads, splits)](
        q, el, i64, bt, lay.seq_lens.contiguous(), lay.expected_gen.contiguous(), lay.expected_tags.contiguous(),
        acc, m, l_, lse, fgen, fmask, fcount, fwriters,
        scale, C, splits, Hq, num_kv_heads,
        k_view.stride(0), k_view.stride(1), k_view.storage_offset(), v_view.storage_offset(),
        pool.generation.stride(0), pool.tags.stride(0), pool.tags.stride(1), pool.tags.storage_offset(),
        pool.writers.storage_offset(),
        S=S, D=D, G=G, BLOCK_G=block_g, BLOCK_D=max(triton.next_power_of_2(D), 16 if t.dot else 1),
        PPS=pps, PB=pb, DOT=t.dot, F32=pool.dtype == torch.float32, CHECK=check,
        num_warps=t.num_warps, num_stages=t.num_stages)
    LAUNCHES += 1
    # split-K epilogue: combine the partial softmaxes; page mass = exp(page lse - total lse), mean over heads
    M = m.amax(-1, keepdim=True)
    w = torch.exp(m - M).nan_to_num_(0.0)
    l_tot = (l_ * w).sum(-1)
    out = (acc * w[..., None]).sum(2) / l_tot[..., None]
    lse_tot = M.squeeze(-1) + torch.log(l_tot)
    page_mass = torch.exp(lse - lse_tot[..., None]).mean(1)
    chk = None
    if check:
        slots = (lay.seq_lens[:, None] - torch.arange(C, device=dev)[None, :] * S).clamp(0, S)
        chk = ReadCheck(fcount, slots, fwriters, fgen, fmask)
    return AttentionOutput(out.reshape(B, Hq * D).to(q.dtype), page_mass, chk)
