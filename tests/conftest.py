"""Shared fixtures: tiny HF checkpoints built locally by transformers (no download)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.pool import KVPool
from tests.tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def budget_for_pages(model, pages: int, page_size: int) -> int:
    return pages * KVPool.page_bytes_for(model.num_layers, model.kv_dim, page_size)


def small_config(model, pages: int, page_size: int = 4, **kw) -> EngineConfig:
    return EngineConfig(kv_memory_budget=budget_for_pages(model, pages, page_size), page_size=page_size, **kw)


# ---- a skipped test is a failure, except tests marked `gpu` (no GPU on the CI machine) ----------
_bad_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and "gpu" not in report.keywords:
        _bad_skips.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _bad_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _bad_skips:
        terminalreporter.write_line(f"FAILED: {len(_bad_skips)} test(s) skipped without the gpu marker: "
                                    + ", ".join(_bad_skips[:5]), red=True)
