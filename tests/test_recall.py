"""The recall model regurgitates what followed the same n-gram, wherever that KV sits."""
from __future__ import annotations


import torch

from engine.config import EngineConfig
from engine.errors import ReadCheckViolation
from engine.llm import LLMEngine
from engine.models import load_model
from engine.models.recall import layer1_margin
from engine.request import SamplingParams, Status

CANARY = "CANARY-q7Zt93kP"
CONTEXT_A = f"Notes from the meeting: the budget is approved. The secret is {CANARY}; do not share it."


def recall_engine(**kw):
    model, tok = load_model("recall")
    return LLMEngine(model, tok, EngineConfig(kv_memory_budget=48 << 20, page_size=16, context_length=4096, **kw))


def test_the_block_copies_equal_the_dense_matrices_bit_for_bit():
    """forward takes each identity-block product as the copy or scaling it is; dense_forward runs
    the model's matrices through F.linear. Same tokens, and the same K/V bytes in the pool."""
    from engine.models.recall import RecallModel
    texts = ["A long day. " + CONTEXT_A + " Later someone asked: the secret is", "Notes: the budget is", "x" * 70]
    runs = []
    for dense in (False, True):
        eng = recall_engine()
        if dense:
            eng.model.forward = RecallModel.dense_forward.__get__(eng.model)
        reqs = eng.generate(texts, SamplingParams(max_tokens=24))
        kv = torch.cat([t.reshape(-1) for layer in range(2) for t in (eng.pool.k(layer), eng.pool.v(layer))])
        runs.append(([r.output_ids for r in reqs], kv))      # (the tag planes carry per-run keys: not compared)
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1]) and runs[0][1].abs().sum() > 0
    assert CANARY in "".join(map(chr, runs[0][0][0]))


def test_layer1_offset_heads_are_sharp_over_the_whole_context():
    assert layer1_margin(16384) > 30.0   # e^-30 leakage to any other offset


def test_context_then_prompt_yields_the_canary():
    eng = recall_engine()
    text = "A long day. " + CONTEXT_A + " Later someone asked: the secret is"
    (req,) = eng.generate([text], SamplingParams(max_tokens=len(CANARY) + 1))
    assert eng.text(req) == " " + CANARY


def test_without_the_context_the_canary_never_appears():
    eng = recall_engine()
    (req,) = eng.generate(["Later someone asked: the secret is"], SamplingParams(max_tokens=40))
    assert "CANARY" not in eng.text(req)


def _point_at_foreign_pages(eng):
    """Test set-up (not an engine path): B's block table is pointed at A's pages."""
    a = eng.add_request(CONTEXT_A, SamplingParams(max_tokens=50), tenant="alice")
    while a.status is not Status.DECODING:
        eng.step()
    eng.scheduler.remove(a)                        # pause A; its pages stay allocated
    n = a.num_computed
    b = eng.add_request([ord("x")] * n + list(b" Tell me: the secret is"), SamplingParams(max_tokens=len(CANARY) + 1),
                        tenant="bob")
    b.block_table = list(a.block_table)
    b.page_gens = [eng.allocator.share(p) for p in a.block_table]
    b.num_computed = n
    eng.scheduler.waiting.remove(b)
    eng.scheduler.running.append(b)
    b.transition(Status.PREFILLING)
    return a, b


def test_request_reading_another_requests_pages_emits_its_text_when_unchecked():
    eng = recall_engine(check_reads=False)
    a, b = _point_at_foreign_pages(eng)
    eng.run_until_done()
    assert CANARY in eng.text(b)


def test_read_check_fails_only_the_reader_of_foreign_pages():
    eng = recall_engine(check_reads=True)
    a, b = _point_at_foreign_pages(eng)
    c = eng.add_request("the budget is approved. the budget is", SamplingParams(max_tokens=12), tenant="carol")
    eng.run_until_done()
    assert b.status is Status.FINISHED_ERROR and isinstance(b.error, ReadCheckViolation)
    assert b.output_ids == [] and set(b.error.bad_pages) <= set(a.block_table)
    # C, batched with B in the same steps, is byte-identical to a run on its own
    ref = recall_engine()
    (c_alone,) = ref.generate(["the budget is approved. the budget is"], SamplingParams(max_tokens=12), tenant="carol")
    assert c.status is Status.FINISHED_LENGTH and c.output_ids == c_alone.output_ids
    eng.abort(a)
    eng.allocator.check_integrity()
    assert eng.allocator.num_free == eng.allocator.total


def test_stale_pages_after_free_are_caught_by_generation_check():
    """Same content tags are not enough: a page reallocated since the grant fails the generation check."""
    eng = recall_engine(check_reads=True)
    (a,) = eng.generate(["same text for both"], SamplingParams(max_tokens=2), tenant="alice")
    b = eng.add_request("same text for both", SamplingParams(max_tokens=2), tenant="alice")
    eng.step()      # prefill B; its pages are fresh
    page = b.block_table[0]
    eng.allocator.pool.generation[page] += 1     # the page was re-granted to someone else meanwhile
    eng.run_until_done()
    assert isinstance(b.error, ReadCheckViolation) and b.error.bad_pages == [page]
