"""Greedy and seeded temperature / top-p sampling."""
from __future__ import annotations

import torch

from engine.request import Request


def sample(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    out = logits.argmax(-1).tolist()
    for i, req in enumerate(reqs):
        sp = req.sampling
        if sp.temperature <= 0:
            continue
        if req.generator is None:
            req.generator = torch.Generator().manual_seed(sp.seed if sp.seed is not None else req.incarnation & 0xFFFFFFFF)
        probs = torch.softmax(logits[i] / sp.temperature, -1)
        if sp.top_p < 1.0:
            sp_, idx = probs.sort(descending=True)
            keep = torch.cumsum(sp_, 0) - sp_ < sp.top_p      # smallest set with mass >= top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp_[keep])
        out[i] = int(torch.multinomial(probs, 1, generator=req.generator))
    return out
