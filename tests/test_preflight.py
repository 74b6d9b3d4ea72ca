"""Preflight: a pool smaller than the context is refused, fitted or recorded - before allocation."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.models import load_model
from engine.kv.preflight import PreflightError
from engine.commands.main import main
from tests.conftest import budget_for_pages


@pytest.fixture(scope="module")
def recall():
    return load_model("recall")


def _cfg(model, mode: str) -> EngineConfig:
    return EngineConfig(kv_memory_budget=budget_for_pages(model, 4, 16), page_size=16, context_length=256, preflight=mode)


def test_refuse_names_pool_context_and_the_ways_out(recall, monkeypatch):
    import engine.llm as llm
    allocated = []
    monkeypatch.setattr(llm, "KVPool", lambda *a, **k: allocated.append(a))
    with pytest.raises(PreflightError, match=r"node node0: KV pool holds 64 tokens, less than the context length 256.*"
                                             r"Lower the context length to <= 64"):
        LLMEngine(*recall, _cfg(recall[0], "refuse"))
    assert allocated == []                                # refused before any pool memory was taken


def test_fit_lowers_the_context_and_record_keeps_it(recall):
    fit = LLMEngine(*recall, _cfg(recall[0], "fit"))
    assert fit.cfg.context_length == 64 and fit.preflight.action == "lowered" and not fit.preflight.fits
    rec = LLMEngine(*recall, _cfg(recall[0], "record"))
    assert rec.cfg.context_length == 256 and rec.preflight.action == "recorded"


def test_preflight_command_exits_nonzero_when_a_pool_is_smaller(capsys):
    assert main(["preflight", "--context-length", "1024", "--memory-budget", "64MiB"]) == 0
    assert main(["preflight", "--context-length", "1024", "--memory-budget", "64MiB", "--memory-budget", "1MiB"]) == 1
    assert "node1 cannot hold a full-context prompt" in capsys.readouterr().err
    assert main(["preflight", "--context-length", "0"]) == 2
