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


# bf16 (weights and KV stored as bf16, arithmetic fp32): the stated tolerance. Against transformers in
# fp32 on the same bf16-rounded weights, teacher-forced on the engine's own tokens, the only
# difference left is the KV rounded to bf16 in the pool: every logit within BF16_LOGIT_ATOL (these
# random checkpoints' logits span about +-10; observed up to 0.08), each greedy token within
# 2 x BF16_LOGIT_ATOL of the reference's best. Against the fp32 engine, greedy tokens agree up to the
# first position where fp32's own choice and bf16's are within BF16_TIE of each other (a near tie that
# rounding may break either way; observed 0.005 and 0.01, on 2 of 10 sequences of 12 tokens); past it
# the sequences are different texts and are not compared.
BF16_LOGIT_ATOL = 0.25
# with products in bf16 (llama.bf16_gemm: activations rounded to bf16, bf16 results, as vLLM-CPU and
# transformers compute in bf16; prefill rows, and decode rows too on weights of BF16_ONEDNN_MIN_WEIGHT
# values and more) each layer's output is rounded too: every logit within 0.5 (observed up to 0.2);
# native kernels vs torch's ops within 5e-2 (a last-bit difference before a product's bf16 rounding
# moves its result by a bf16 step; observed 1.8e-2), 0.13 where the logits are a bf16 result too
BF16_GEMM_LOGIT_ATOL = 0.5
BF16_TIE = 0.5
BF16_PROMPTS = [list(range(20, 20 + n)) for n in (7, 33, 61)] + [[5, 17, 99, 3] * 9, list(range(300, 100, -4))]


def _greedy_with_logits(model, prompts, n, max_step_tokens=256, **cfg_kw):
    # 256 tokens a step: the prompts' prefill runs as one product of more than BF16_KERNEL_ROWS rows
    cfg = small_config(model, pages=96, page_size=4, max_step_tokens=max_step_tokens, **cfg_kw)
    eng = LLMEngine(model, None, cfg)
    seen = {}

    def capture(engine, out):
        for row, b in enumerate(out.sampling):
            req = out.batch[b].req
            seen[(req.incarnation, req.seq_len)] = out.logits[row].clone()
    eng.observers.append(capture)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    eng.run_until_done()
    assert eng.allocator.num_free == eng.allocator.total
    return [r.output_ids for r in reqs], [[seen[(r.incarnation, len(p) + i)] for i in range(n)]
                                          for p, r in zip(prompts, reqs)]


@pytest.mark.parametrize("gemm", ["bf16", "bf16-all", "fp32"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_weights_and_kv_stay_within_the_stated_tolerance(kind, gemm, request, monkeypatch):
    """Every product path, on any CPU: bf16 products through oneDNN (where the CPU multiplies bf16
    natively: llama.bf16_gemm) for prefill rows, with a small weight's decode rows in fp32 ("bf16",
    the tiny models' weights) or every product in bf16 ("bf16-all": as the big shape's weights run,
    BF16_ONEDNN_MIN_WEIGHT lowered to 0), and the fp32 copy of the weight (elsewhere); one tolerance."""
    import transformers

    from engine import kernels
    from engine.models import llama
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "0" if gemm == "fp32" else "1")
    if gemm == "bf16-all":
        monkeypatch.setattr(llama, "BF16_ONEDNN_MIN_WEIGHT", 0)
    path = request.getfixturevalue(f"tiny_{kind}")
    model = LlamaModel.from_pretrained(path, torch.bfloat16)
    assert model.dtype == torch.bfloat16
    calls, gemms = kernels.CALLS, llama.BF16_GEMM_CALLS
    toks, logits = _greedy_with_logits(model, BF16_PROMPTS, MAX_NEW)
    assert (llama.BF16_GEMM_CALLS > gemms) == (gemm != "fp32")      # the products took the path named
    eng = LLMEngine(model, None, small_config(model, pages=8, page_size=4))
    assert eng.pool.dtype == torch.bfloat16
    if kernels.native() is not None:       # the native kernels ran on the bf16 pool and weights ...
        assert kernels.CALLS > calls
        # ... and give torch's numbers on the same stored values: the same tokens, logits within 1e-2
        # (not fp32's 2e-4: a last-bit difference before the KV is rounded to bf16 can move a stored
        # value by one bf16 step, 2^-8 of it; observed 2.3e-3)
        with monkeypatch.context() as m:
            m.setattr(kernels, "_lib", None)
            torch_ops = LlamaModel.from_pretrained(path, torch.bfloat16)
            # the same prefill attention's type as the native path's (fp32 over widened values where
            # the native kernels attend a bf16 pool's chunks only that way: engine.attention.bf16_prefill_widened)
            torch_ops.prefill_dtype = model.prefill_dtype
            t_toks, t_logits = _greedy_with_logits(torch_ops, BF16_PROMPTS, MAX_NEW)
        assert t_toks == toks
        for a, b in zip(logits, t_logits):
            # (bf16-all: the logits are a bf16 product's result too - one bf16 step of a logit of 8-16
            # is 0.0625 - within 0.13; observed 0.0625)
            torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=0,
                                       atol={"fp32": 1e-2, "bf16": 5e-2, "bf16-all": 0.13}[gemm])

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    atol = BF16_LOGIT_ATOL if gemm == "fp32" else BF16_GEMM_LOGIT_ATOL
    worst = 0.0
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for prompt, out, steps in zip(BF16_PROMPTS, toks, logits):
            ref = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:len(prompt) - 1 + MAX_NEW]
            ours = torch.stack(steps)
            worst = max(worst, float((ours - ref).abs().max()))
            torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
            chosen = ref.gather(1, torch.tensor(out)[:, None])[:, 0]
            assert bool((chosen >= ref.max(dim=1).values - 2 * atol).all())
    assert worst > 0                        # the KV really was rounded (bf16 is not fp32 under another name)

    fp_toks, fp_logits = _greedy_with_logits(LlamaModel.from_pretrained(path), BF16_PROMPTS, MAX_NEW)
    first, ties = [], []
    for a, b, steps in zip(fp_toks, toks, fp_logits):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        first.append(MAX_NEW if i is None else i)
        if i is not None:                   # a near tie at the first divergence, never a clear choice
            ties.append(round(float(steps[i][a[i]] - steps[i][b[i]]), 3))
            assert ties[-1] <= BF16_TIE, (i, a[i], b[i])
    print(f"bf16 vs fp32 ({kind}, {gemm} products): first divergence at {first} of {MAX_NEW} (fp32's margin there: {ties}); "
          f"worst logit error against the rounded weights {worst:.3f}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layer_of_a_step_runs_in_inference_mode(tiny_llama, dtype, monkeypatch):
    """LlamaModel.forward runs under torch.inference_mode (no autograd bookkeeping on a step's
    tensors): an insertion once moved the decorator onto a helper and nothing noticed. Every norm of
    every step, prefill and decode, fp32 and bf16, sees it on."""
    from engine.models import llama
    model = LlamaModel.from_pretrained(tiny_llama, dtype)
    seen = []
    real = llama.add_rms_norm
    monkeypatch.setattr(llama, "add_rms_norm",
                        lambda *a, **k: seen.append(torch.is_inference_mode_enabled()) or real(*a, **k))
    _greedy_with_logits(model, PROMPTS[:2], 3)
    assert len(seen) >= 3 * 2 * model.num_layers and all(seen), seen.count(False)


def test_a_step_s_mlp_in_row_tiles_gives_the_numbers_of_one_pass(tiny_llama, monkeypatch):
    """A step of more rows than MLP_ROWS runs its MLP MLP_ROWS rows at a time (LlamaModel.mlp, the
    activations kept in cache): the same tokens, and logits within float rounding of one pass."""
    from engine.models import llama
    model = LlamaModel.from_pretrained(tiny_llama)
    calls = []
    real = llama.silu_mul
    monkeypatch.setattr(llama, "silu_mul", lambda gu: calls.append(gu.shape[0]) or real(gu))
    whole_toks, whole_logits = _greedy_with_logits(model, PROMPTS, MAX_NEW)
    assert max(calls) > 8                                   # a prefill step's rows in one pass
    calls.clear()
    monkeypatch.setattr(llama, "MLP_ROWS", 8)
    toks, logits = _greedy_with_logits(model, PROMPTS, MAX_NEW)
    assert max(calls) == 8 and len(calls) > MAX_NEW * model.num_layers      # ... now 8 rows at a time
    assert toks == whole_toks
    for a, b in zip(whole_logits, logits):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-4, rtol=0)


def test_a_bf16_mlp_in_row_tiles_widens_its_weights_once_a_step(tiny_llama, monkeypatch):
    """bf16 weights with fp32 products (a CPU without bf16 ones): a step's MLP in row tiles widens
    gate_up's and down's weights once for all its tiles (Linear.wide), not once a tile - the same
    tokens and logits bit for bit as widening them every tile."""
    from engine.models import llama
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "0")
    model = LlamaModel.from_pretrained(tiny_llama, torch.bfloat16)
    monkeypatch.setattr(llama, "MLP_ROWS", 8)
    monkeypatch.setattr(llama, "BF16_KERNEL_ROWS", 4)      # tiles of 8 rows: products through F.linear
    widened = []
    real = llama.Linear._widened
    monkeypatch.setattr(llama.Linear, "_widened", lambda self: widened.append(self) or real(self))
    once_toks, once_logits = _greedy_with_logits(model, PROMPTS, 4)
    once = len(widened)
    widened.clear()
    monkeypatch.setattr(llama.Linear, "wide", lambda self, m: None)     # every tile widens again
    toks, logits = _greedy_with_logits(model, PROMPTS, 4)
    assert 0 < once < len(widened)
    assert toks == once_toks
    for a, b in zip(once_logits, logits):
        assert torch.equal(torch.stack(a), torch.stack(b))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_bf16_prefill_s_qkv_kept_in_bf16_gives_the_numbers_of_the_fp32_detour(kind, request, monkeypatch):
    """bf16 products (KVLEDGER_BF16_GEMM=1) on a bf16 pool: a step with prefill rows hands its qkv
    product to the attention in bf16 (q and k rotated and rounded once: kernels.rope_bf16; decode
    rows' q rotated in fp32 from the product) instead of widening it, rotating in fp32 and rounding
    K into the pool and q in the prefill kernel: the same tokens and bit for bit the same logits -
    100 tokens a step (more than BF16_KERNEL_ROWS: the products in bf16) so that prompts are chunked
    and steps mix prefill chunks with decode rows."""
    from engine import kernels, step
    from engine.models import llama
    from engine.step import StepContext
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "1")
    if kernels.native() is None:
        pytest.skip(f"native kernels not built here: {kernels.why_not()}")
    model = LlamaModel.from_pretrained(request.getfixturevalue(f"tiny_{kind}"), torch.bfloat16)
    model.prefill_dtype = torch.bfloat16    # a prefill attended in bf16, as on a CPU with AMX tiles (elsewhere
    #                                         the model attends it in fp32 where the widened kernel runs)
    seen = []           # per attention call: q's type, decode rows, prefill chunks
    real = step.paged_attention

    def spy(q, pool, layer, lay, *a, **kw):
        seen.append((q.dtype, len(lay.plan.dec_b), len(lay.plan.pre)))
        return real(q, pool, layer, lay, *a, **kw)
    monkeypatch.setattr(step, "paged_attention", spy)
    toks, logits = _greedy_with_logits(model, BF16_PROMPTS, MAX_NEW, max_step_tokens=100)
    assert 100 > llama.BF16_KERNEL_ROWS
    mixed = [(dt, d, c) for dt, d, c in seen if d and c]
    assert mixed and all(dt == torch.bfloat16 for dt, _, _ in mixed)       # mixed steps took the bf16 path ...
    assert all(dt == torch.float32 for dt, _, c in seen if not c)           # ... decode-only ones did not
    seen.clear()
    monkeypatch.setattr(StepContext, "bf16_queries", property(lambda ctx: False))
    toks32, logits32 = _greedy_with_logits(model, BF16_PROMPTS, MAX_NEW, max_step_tokens=100)
    assert all(dt == torch.float32 for dt, _, _ in seen)
    assert toks == toks32
    assert all(torch.equal(a, b) for x, y in zip(logits, logits32) for a, b in zip(x, y))


def test_a_bf16_prefill_is_attended_by_a_native_kernel_wherever_one_runs(tiny_llama, monkeypatch):
    """bf16 products (KVLEDGER_BF16_GEMM=1) on a bf16 pool: every prefill chunk goes to a native kernel
    where one runs here for the model's heads - the one in bf16 products where the CPU has AMX tiles
    or AVX512-BF16; else the fp32 one over the values widened (``model.prefill_dtype`` None: faster
    than torch's bf16 SDPA after a gather, and exact) - never to SDPA. (That path's logits against
    transformers' fp32: the tolerance test above, whose native run takes it.)"""
    import torch.nn.functional as F

    from engine import kernels
    from engine.attention import bf16_prefill_widened
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "1")
    if kernels.native() is None:
        pytest.skip(f"native kernels not built here: {kernels.why_not()}")
    model = LlamaModel.from_pretrained(tiny_llama, torch.bfloat16)
    D = model.cfg.head_dim
    from engine.kv.pool import KVPool

    def runs(products: bool) -> bool:
        pool = KVPool(1, D, 4, 4 * KVPool.page_bytes_for(1, D, 4, torch.bfloat16), dtype=torch.bfloat16)
        return kernels.paged_prefill(torch.zeros(2, 1, D), pool, 0, torch.tensor([0]), 2, 1, 1.0,
                                     torch.empty(2, 1, D), bf16_products=products)
    bf16, widened = runs(True), runs(False)
    if not (bf16 or widened):
        pytest.skip(f"no native prefill kernel for heads of {D} values here")
    assert model.prefill_dtype == (torch.bfloat16 if bf16 else None)
    assert bf16_prefill_widened(D) == (not bf16)
    took, sdpa = [], []
    real_prefill, real_sdpa = kernels.paged_prefill, F.scaled_dot_product_attention

    def prefill(*a, bf16_products=True, **kw):
        ok = real_prefill(*a, bf16_products=bf16_products, **kw)
        took.extend([bf16_products] * ok)
        return ok

    def spy_sdpa(*a, **kw):
        sdpa.append(1)
        return real_sdpa(*a, **kw)
    monkeypatch.setattr(kernels, "paged_prefill", prefill)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    _greedy_with_logits(model, BF16_PROMPTS, MAX_NEW, max_step_tokens=100)      # prompts chunked
    assert took and not sdpa
    assert set(took) == {bf16}          # bf16 products (AMX tiles, AVX512-BF16), else the widened values' fp32 kernel
