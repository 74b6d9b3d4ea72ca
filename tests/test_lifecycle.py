"""Request lifecycle, scheduling behaviour and bad input (rejected before any page is taken)."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.config import EngineConfig
from engine.errors import InputError, ModelLoadError
from engine.llm import LLMEngine
from engine.models import load_model
from engine.request import IllegalTransition, Request, SamplingParams, Status
from engine.tags import TagChain


def recall_engine(**kw):
    model, tok = load_model("recall")
    base = dict(kv_memory_budget=32 << 20, page_size=16, context_length=1024)
    return LLMEngine(model, tok, EngineConfig(**(base | kw)))


@pytest.mark.parametrize("prompt, sp, match", [
    ("", SamplingParams(), "empty prompt"),
    ("x" * 1025, SamplingParams(), "longer than the context length 1024"),
    ("hello", SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
    ("hello", SamplingParams(max_tokens=-3), "max_tokens must be >= 1"),
    ("hello", SamplingParams(temperature=-1.0), "temperature"),
    ("hello", SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 999], SamplingParams(), "outside the vocabulary"),
])
def test_bad_input_is_rejected_before_any_page_is_taken(prompt, sp, match):
    eng = recall_engine()
    free = eng.allocator.num_free
    with pytest.raises(InputError, match=match):
        eng.add_request(prompt, sp)
    assert eng.allocator.num_free == free and not eng.has_unfinished()
    eng.allocator.check_integrity()


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_checkpoint_shape_mismatch_names_the_tensor(tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
        load_model(str(bad))


def test_prompt_over_the_pool_is_rejected_in_unified_mode_before_any_page_is_taken():
    from engine.kv.pool import KVPool
    eng = recall_engine(kv_memory_budget=3 * KVPool.page_bytes_for(2, 1536, 16), context_length=4096)
    assert eng.pool.capacity_tokens == 48
    with pytest.raises(InputError, match="larger than node node0's KV pool of 48 tokens"):
        eng.add_request("y" * 100, SamplingParams(max_tokens=2))
    assert eng.allocator.num_free == eng.allocator.total and not eng.has_unfinished()


def test_request_that_outgrows_the_pool_while_decoding_fails_alone():
    from engine.kv.pool import KVPool
    eng = recall_engine(kv_memory_budget=3 * KVPool.page_bytes_for(2, 1536, 16), context_length=4096,
                        host_memory_budget=0)
    big = eng.add_request("y" * 40, SamplingParams(max_tokens=30))
    eng.run_until_done()
    assert big.status is Status.FINISHED_ERROR and "more KV pages than the pool" in str(big.error)
    assert eng.allocator.num_free == eng.allocator.total


def test_state_machine_has_one_terminal_predicate_and_rejects_illegal_moves():
    req = Request([1], SamplingParams(), "t", "tenant:t", TagChain(b"k"))
    assert not req.is_finished
    with pytest.raises(IllegalTransition):
        req.transition(Status.DECODING)          # must prefill first
    req.transition(Status.PREFILLING)
    req.fail(RuntimeError("boom"))
    assert req.is_finished and req.finish_reason == "error"
    with pytest.raises(IllegalTransition):
        req.transition(Status.DECODING)          # terminal is terminal


def test_chunked_prefill_gives_the_same_tokens_as_one_shot():
    from pydoc_data.topics import topics
    text = topics["for"][:700] + " The "
    one = recall_engine(max_step_tokens=2048).generate([text], SamplingParams(max_tokens=30))[0]
    chunked_eng = recall_engine(max_step_tokens=64)
    chunked = chunked_eng.generate([text], SamplingParams(max_tokens=30))[0]
    assert chunked_eng.steps > 700 // 64
    assert one.output_ids == chunked.output_ids


def test_eos_and_max_tokens_finish_requests(tiny_llama):
    from engine.models.llama import LlamaModel
    model = LlamaModel.from_pretrained(tiny_llama)
    eng = LLMEngine(model, None, EngineConfig(kv_memory_budget=4 << 20, page_size=8))
    r = eng.add_request([5, 6, 7], SamplingParams(max_tokens=7, ignore_eos=True))
    eng.run_until_done()
    assert r.finish_reason == "length" and len(r.output_ids) == 7
    model.eos_token_id = r.output_ids[2]                 # make the third token an EOS
    r2 = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=7))[0]
    assert r2.finish_reason == "stop" and r2.output_ids == r.output_ids[:3]


def test_seeded_sampling_is_reproducible_and_differs_across_seeds():
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown cat sleeps. the quick"
    outs = [recall_engine().generate([prompt], SamplingParams(max_tokens=20, temperature=1.5, top_p=0.9, seed=s))[0].output_ids
            for s in (1, 1, 2, 3)]
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs}) > 1


def test_the_engine_forgets_finished_requests_so_a_long_run_stays_bounded():
    """A server runs for months: the engine keeps only requests it has not finished (issue 17)."""
    model, tok = load_model("recall")
    eng = LLMEngine(model, tok, EngineConfig(kv_memory_budget=4 << 20, context_length=256, max_num_seqs=64))
    most = 0
    for wave in range(24):
        for i in range(50):
            eng.add_request([1 + (wave + i) % 200] * 4, SamplingParams(max_tokens=1), f"t{i % 3}")
        most = max(most, len(eng.requests))
        eng.run_until_done()
        assert len(eng.requests) == 0
    assert most == 50 and eng.allocator.num_free == eng.allocator.total       # 1200 requests, at most 50 held
