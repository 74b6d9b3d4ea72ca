"""The Triton paged-decode kernel (engine/triton_attention.py) against the torch reference: same
output, attention mass and read check - computed inside the kernel - on random shapes and on
pools holding stale and foreign pages. Without a GPU it runs in Triton's CPU interpreter
(TRITON_INTERPRET=1, set in conftest before Triton is imported)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine import triton_attention as ta
from engine.attention import BatchLayout, paged_attention
from engine.config import EngineConfig
from engine.errors import InputError, ReadCheckViolation
from engine.llm import LLMEngine
from engine.models.llama import LlamaModel
from engine.kv.pool import KVPool
from engine.request import SamplingParams, Status
from tests.conftest import small_config


@st.composite
def decode_batches(draw):
    S = draw(st.sampled_from([4, 8, 16]))
    hkv, g, D = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([8, 16, 24]))
    B, C = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    seq = [draw(st.integers(1, C * S)) for _ in range(B)]
    corrupt = draw(st.lists(st.tuples(st.integers(0, B - 1), st.integers(0, C * S - 1), st.booleans()), max_size=4))
    tuning = ta.Tuning(pages_per_split=draw(st.sampled_from([2, 8])), pages_per_block=draw(st.sampled_from([1, 2, 4])),
                       dot=draw(st.booleans()))
    return S, hkv, g, D, B, C, seq, corrupt, draw(st.integers(0, 2 ** 31)), tuning


@settings(max_examples=25, deadline=None)
@given(decode_batches())
def test_kernel_matches_the_reference_on_random_shapes_with_stale_and_foreign_slots(case):
    """Every launch shape bench/gpu_check.py sweeps (pages per block, per split, tl.dot) computes the same."""
    S, hkv, g, D, B, C, seq, corrupt, seed, tuning = case
    torch.manual_seed(seed)
    pool = KVPool(2, hkv * D, S, (B * C + 3) * KVPool.page_bytes_for(2, hkv * D, S))
    pool.buf.view(torch.float32)[:] = torch.randn(pool.buf.numel() // 4)
    bt = torch.randperm(pool.num_pages)[: B * C].view(B, C)
    seq_t = torch.tensor(seq)
    for b in range(B):                                   # unused block-table columns are padding
        bt[b, -(-seq[b] // S):] = -1
    gens = pool.generation[bt.clamp(min=0)].clone()
    tags = pool.tags[bt.clamp(min=0)].reshape(B, C * S).clone()
    for b, pos, stale in corrupt:                        # a stale page (generation) or a foreign slot (tag)
        if stale:
            gens[b, pos // S] += 1
        else:
            tags[b, pos] ^= 0x5A5A
    lay = BatchLayout.build(bt, seq_t, torch.ones(B, dtype=torch.long), gens, tags)
    q = torch.randn(B, hkv * g, D)
    ref = paged_attention(q, pool, 1, lay, hkv, D, D ** -0.5, True)
    before = ta.LAUNCHES
    got = ta.paged_decode(q, pool, 1, lay, hkv, D, D ** -0.5, True, tuning)
    assert ta.LAUNCHES == before + 1                     # the kernel ran, not a fallback
    torch.testing.assert_close(got.out, ref.out.reshape(B, -1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.page_mass, ref.page_mass, atol=1e-5, rtol=1e-4)
    assert torch.equal(got.check.bad_slots, ref.check.bad_slots)
    assert torch.equal(got.check.bad_mask, ref.check.bad_mask)
    assert torch.equal(got.check.slots_read, ref.check.slots_read)
    read = ref.check.slots_read > 0
    assert torch.equal(got.check.found_gen[read], ref.check.found_gen[read])
    in_run = torch.arange(S)[None, None, :] < ref.check.slots_read[:, :, None]
    assert torch.equal(got.check.found_writers[in_run], ref.check.found_writers[in_run])


def test_split_k_over_a_long_context():
    """More pages than one split holds: the epilogue combines the partial softmaxes exactly."""
    S, hkv, D = 16, 1, 16
    C = 3 * ta.PAGES_PER_SPLIT + 2
    pool = KVPool(1, hkv * D, S, (C + 1) * KVPool.page_bytes_for(1, hkv * D, S))
    pool.buf.view(torch.float32)[:] = torch.randn(pool.buf.numel() // 4)
    bt = torch.arange(C).view(1, C)
    lay = BatchLayout.build(bt, torch.tensor([C * S - 5]), torch.ones(1, dtype=torch.long),
                            pool.generation[bt].clone(), pool.tags[bt].reshape(1, -1).clone())
    q = torch.randn(1, 4, D)
    ref = paged_attention(q, pool, 0, lay, hkv, D, 0.25, True)
    got = ta.paged_decode(q, pool, 0, lay, hkv, D, 0.25, True)
    torch.testing.assert_close(got.out, ref.out.reshape(1, -1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.page_mass, ref.page_mass, atol=1e-5, rtol=1e-4)
    assert int(got.check.bad_slots.sum()) == 0


def _engine(path, backend: str, **kw) -> LLMEngine:
    model = LlamaModel.from_pretrained(path)
    return LLMEngine(model, None, small_config(model, 64, page_size=4, attention_backend=backend, **kw))


def test_engine_on_the_triton_backend_generates_what_the_reference_does(tiny_llama):
    prompts, sp = [[5, 17, 99, 3], list(range(20, 43))], SamplingParams(max_tokens=6)
    ref = [r.output_ids for r in _engine(tiny_llama, "torch").generate(prompts, sp)]
    before = ta.LAUNCHES
    got = [r.output_ids for r in _engine(tiny_llama, "triton").generate(prompts, sp)]
    assert got == ref and ta.LAUNCHES > before


def test_the_kernels_read_check_fails_only_the_reader(tiny_llama):
    eng = _engine(tiny_llama, "triton")
    a = eng.add_request(list(range(30, 50)), SamplingParams(max_tokens=8))
    b = eng.add_request(list(range(60, 70)), SamplingParams(max_tokens=8))
    while not (a.status is Status.DECODING and b.status is Status.DECODING):
        eng.step()
    page = b.block_table[0]
    eng.pool.generation[page] += 1                       # b's first page was re-granted meanwhile
    before = ta.LAUNCHES
    eng.run_until_done()
    assert ta.LAUNCHES > before
    assert isinstance(b.error, ReadCheckViolation) and b.error.bad_pages == [page]
    assert a.status is Status.FINISHED_LENGTH and len(a.output_ids) == 8


def test_unknown_backend_is_refused():
    with pytest.raises(InputError, match="attention_backend must be 'torch' or 'triton'"):
        from engine.llm import _check_backend
        _check_backend("cuda-graphs")
    assert EngineConfig().attention_backend == "torch"


def test_the_gpu_default_is_among_the_fastest_shapes_measured_on_a_gpu():
    """README: the GPU default launch shape is within 2 % of the fastest of bench/gpu_check.sh's last
    sweep (pipelining depths 1-4 of the same shape measured within 0.3 % of one another: noise)."""
    import json
    from pathlib import Path
    r = json.loads((Path(__file__).resolve().parent.parent / "bench" / "results" / "gpu_check_dot.json").read_text())
    assert all(c["ok"] for c in r["correctness"])
    ok = [s for s in r["sweep"] if "error" not in s]
    fastest = min(s["ms_check_on"] for s in ok)
    default = [s for s in ok if ta.Tuning(**s["tuning"]) == ta.GPU_DEFAULT]
    assert len(default) == 1 and default[0]["ms_check_on"] <= 1.02 * fastest
    timed = [t for t in r["timing"] if t["shape"] == "default"]
    assert timed and all(ta.Tuning(**t["tuning"]) == ta.GPU_DEFAULT for t in timed)
