"""Parity: kvledger's paged path reproduces transformers' greedy tokens and logits on tiny
randomly initialised Llama and Qwen2 checkpoints, batched, with preemption in the middle.

Tolerance: float32 logits agree within 2e-4 absolute (observed ~1e-6; the paged path sums
attention in a different order than transformers' SDPA)."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLMEngine
from engine.models.llama import LlamaModel
from engine.request import SamplingParams
from tests.conftest import small_config

LOGIT_ATOL = 2e-4
PROMPTS = [[5, 17, 99, 3], list(range(20, 53)), [7] * 11 + [300, 301], list(range(100, 160, 3))]
MAX_NEW = 12


def hf_greedy(path, prompt, n):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0)
        full = out[0].tolist()
        logits = hf(torch.tensor([full])).logits[0]
    return full[len(prompt):], logits


def run_paged(path, pages, host_budget):
    model = LlamaModel.from_pretrained(path)
    cfg = small_config(model, pages=pages, page_size=4, host_memory_budget=host_budget, max_step_tokens=24)
    eng = LLMEngine(model, None, cfg)
    seen = {}

    def capture(engine, out):
        for row, b in enumerate(out.sampling):
            req = out.batch[b].req
            seen[(req.incarnation, req.seq_len)] = out.logits[row].clone()
    eng.observers.append(capture)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)) for p in PROMPTS]
    eng.run_until_done()
    eng.allocator.check_integrity()
    assert eng.allocator.num_free == eng.allocator.total
    return eng, reqs, seen


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("preempt", ["swap", "recompute"])
def test_greedy_tokens_and_logits_match_transformers(kind, preempt, request):
    path = request.getfixturevalue(f"tiny_{kind}")
    host = (64 << 20) if preempt == "swap" else 0
    # 14 pages x 4 tokens = 56 slots for 4 requests needing 116: preemption must happen
    eng, reqs, seen = run_paged(path, pages=14, host_budget=host)
    assert sum(r.preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    for prompt, req in zip(PROMPTS, reqs):
        assert req.error is None, req.error
        want, hf_logits = hf_greedy(path, prompt, MAX_NEW)
        assert req.output_ids == want
        for i in range(MAX_NEW):
            ours = seen[(req.incarnation, len(prompt) + i)]
            torch.testing.assert_close(ours, hf_logits[len(prompt) + i - 1], atol=LOGIT_ATOL, rtol=0)
