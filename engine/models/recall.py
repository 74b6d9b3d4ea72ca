"""The recall model: a deterministic, hand-wired n-gram induction transformer over bytes.

It has no trained weights: every matrix below is written by hand, and it runs through the same
pool, block tables and attention op as the Llama path. Given context, it continues by
regurgitating what followed the same n-gram before - wherever that KV sits in the pool and
whatever position it was written at. A request that reads another tenant's stale pages
therefore starts speaking that tenant's text, which is what makes exposures *surface*.

Residual stream: CTX + 2 blocks of 256 dims (one-hot bytes)
    block 0        the current byte x[t]                   (embedding)
    block d        the byte x[t-d], d = 1..CTX             (written by layer 1, head d)
    block CTX+1    the byte the induction head copied      (written by layer 2; read by lm_head)

Layer 1 (RoPE, theta=100): head d has constant query/key vectors (biases only) rotated so that
    q(t) . k(j) = ALPHA * sum_i cos(theta_i * (t - j - d)),
peaking sharply at j = t - d; its value copies x[j] into block d.
Layer 2 (no rotation): one induction head. Query = sum_k W_k e(x[t-k]), k = 0..CTX-1;
key(j) = e(x[j-1-k]) in the same sub-blocks; W_k = BETA * 2^-k ranks matches by the longest
common suffix. Value = e(x[j]): the byte that followed the matched context.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.models.llama import rope, rope_tables
from engine.step import StepContext

V = 256            # bytes
CTX = 6            # bytes of context the induction query matches
ROPE_THETA = 100.0
ALPHA = 6.0        # layer-1 sharpness: margin 6.9 * ALPHA >> log(context) (see tests)
BETA = 24.0 * 2 ** (CTX - 1)   # smallest suffix weight still separates by e^24
GAMMA = 50.0       # logit scale


class RecallModel:
    name = "recall"
    num_layers = 2
    kv_dim = CTX * V       # layer 1: CTX heads x 256; layer 2: 1 head x CTX*256
    eos_token_id = None
    vocab_size = V

    def __init__(self, dtype: torch.dtype = torch.float32):
        H = (CTX + 2) * V
        eye = torch.eye(V, dtype=dtype)
        self.embed = torch.zeros(V, H, dtype=dtype)
        self.embed[:, :V] = eye
        self.embed[0] = 0.0    # byte 0 (NUL, never in text) is "no token": it matches and copies nothing
        # layer 1: queries and keys are biases only (weights zero); values copy block 0.
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, V, 2, dtype=torch.float64) / V))
        half = V // 2
        self.q1 = torch.zeros(CTX, V, dtype=torch.float64)
        for d in range(1, CTX + 1):
            self.q1[d - 1, :half] = ALPHA * torch.cos(d * inv)
            self.q1[d - 1, half:] = -ALPHA * torch.sin(d * inv)
        self.q1 = self.q1.to(dtype)
        self.k1 = torch.zeros(CTX, V, dtype=dtype)
        self.k1[:, :half] = 1.0
        self.v1 = torch.zeros(CTX * V, H, dtype=dtype)     # head d value <- block 0
        self.o1 = torch.zeros(H, CTX * V, dtype=dtype)     # head d output -> block d
        for d in range(1, CTX + 1):
            self.v1[(d - 1) * V: d * V, :V] = eye
            self.o1[d * V:(d + 1) * V, (d - 1) * V: d * V] = eye
        # layer 2: induction head.
        self.q2 = torch.zeros(CTX * V, H, dtype=dtype)
        self.k2 = torch.zeros(CTX * V, H, dtype=dtype)
        for k in range(CTX):
            self.q2[k * V:(k + 1) * V, k * V:(k + 1) * V] = BETA * 2.0 ** -k * eye    # block k = x[t-k]
            self.k2[k * V:(k + 1) * V, (k + 1) * V:(k + 2) * V] = eye               # block k+1 = x[j-1-k]
        self.v2 = torch.zeros(CTX * V, H, dtype=dtype)
        self.v2[:V, :V] = eye
        self.o2 = torch.zeros(H, CTX * V, dtype=dtype)
        self.o2[(CTX + 1) * V:, :V] = eye
        self.lm_head = torch.zeros(V, H, dtype=dtype)
        self.lm_head[:, (CTX + 1) * V:] = GAMMA * eye
        self._q2_scale = torch.tensor([BETA * 2.0 ** -k for k in range(CTX)], dtype=dtype)[None, :, None]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Every matrix above is identity blocks (times a constant) and zeros, so each product is
        taken as the block copy or scaling it is - the same numbers, bit for bit, as the dense
        ``F.linear`` (each output element has one non-zero term; ``dense_forward`` keeps that path
        and tests/test_recall.py holds the two equal) - at a fraction of 7 dense 2048-wide GEMMs."""
        T = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos, sin = rope_tables(positions, V, ROPE_THETA, x.dtype)
        q = rope(self.q1.expand(T, CTX, V), cos, sin)
        k = rope(self.k1.expand(T, CTX, V), cos, sin)
        v = x[:, :V].repeat(1, CTX)                                   # v1: every head copies block 0
        a = ctx.attend(0, q, k, v, CTX, V, 1.0)
        x = x.clone()
        x[:, V:(CTX + 1) * V] += a                                    # o1: head d -> block d
        q = (x[:, :CTX * V].view(T, CTX, V) * self._q2_scale).view(T, 1, CTX * V)   # q2: block k x BETA 2^-k
        k = x[:, V:(CTX + 1) * V].contiguous()                        # k2: block k+1
        v = torch.zeros(T, CTX * V, dtype=x.dtype)
        v[:, :V] = x[:, :V]                                           # v2: block 0
        a = ctx.attend(1, q, k, v, 1, CTX * V, 1.0)
        x[:, (CTX + 1) * V:] += a[:, :V]                              # o2: the copied byte -> block CTX+1
        return (x[logits_rows, (CTX + 1) * V:] * GAMMA).float()      # lm_head

    @torch.inference_mode()
    def dense_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                      logits_rows: torch.Tensor) -> torch.Tensor:
        """The same model through its dense matrices (the definition; tests compare to it)."""
        T = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos, sin = rope_tables(positions, V, ROPE_THETA, x.dtype)
        q = rope(self.q1.expand(T, CTX, V), cos, sin)
        k = rope(self.k1.expand(T, CTX, V), cos, sin)
        v = F.linear(x, self.v1)
        x = x + F.linear(ctx.attend(0, q, k, v, CTX, V, 1.0), self.o1)
        q = F.linear(x, self.q2).view(T, 1, CTX * V)
        k = F.linear(x, self.k2)
        v = F.linear(x, self.v2)
        x = x + F.linear(ctx.attend(1, q, k, v, 1, CTX * V, 1.0), self.o2)
        return F.linear(x[logits_rows], self.lm_head).float()


def layer1_margin(max_context: int) -> float:
    """Score gap between the intended offset and the best other offset, in logits (for tests)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, V, 2, dtype=torch.float64) / V))
    delta = torch.arange(max_context, dtype=torch.float64)
    worst = math.inf
    for d in range(1, CTX + 1):
        s = torch.cos((delta - d)[:, None] * inv[None, :]).sum(1) * ALPHA
        peak = float(s[d])
        s[d] = -math.inf
        worst = min(worst, peak - float(s.max()))
    return worst
