"""Shared fixtures: tiny HF checkpoints built locally by transformers (no download)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# `pytest -n 2` runs two workers on this 2-core machine: each gets one torch thread (and so do the
# servers and replays they start), else 2 x 2 OpenMP threads fight over 2 cores and spin - the suite
# then burns more CPU for less work
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# No GPU: the Triton kernel runs in Triton's CPU interpreter, which must be chosen before Triton
# is imported (nothing above imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit
import shutil
import tempfile

import pytest


def _own_tempdir(prefix: str) -> str:
    """A directory of this process's, removed when it exits (the suite leaves no /tmp behind)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# keys and anchors live outside every store, in a per-user state directory: the tests get their own
# (the xdist workers and the subprocesses inherit the controller's), never the user's
# ~/.local/state/kvledger
if "KVLEDGER_STATE_DIR" not in os.environ:
    os.environ["KVLEDGER_STATE_DIR"] = _own_tempdir("kvledger-test-state-")
# embedded ClickHouse (chdb) keeps one data directory per process: each test process gets its own
os.environ["KVLEDGER_CHDB_PATH"] = _own_tempdir("kvledger-test-chdb-")
os.environ["KVLEDGER_CHDB_THREADS"] = "1"        # as torch: one thread per xdist worker on two cores
# an engine freezes Python's GC heap once built (engine/osutil.freeze_heap: a full collection first,
# ~0.5 s here); the suite builds hundreds in one process, each freeze keeping the tests' garbage before
# it for good: off here and in the servers the tests start (tests/test_pool.py turns it on to test it)
os.environ["KVLEDGER_GC_FREEZE"] = "0"

from telemetry.recorder import recording
from engine.config import EngineConfig
from engine.kv.pool import KVPool
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


def rewrite_store(src, dst, edit) -> Path:
    """Every table of ``src`` into a new store at ``dst`` through the real segment writer (signed and
    chained by its own key), ``edit(table, arrow)`` applied first."""
    from telemetry.store import SegmentWriter, open_store
    from telemetry.store.schema import tables
    con = open_store(src)
    w = SegmentWriter(dst)
    for t in tables():
        data = edit(t, con.table(t).to_arrow_table())
        if data.num_rows:
            w.submit(t, data)
    w.close()
    return Path(dst)


# ---- the GLM-5.3 replay, recorded into a store: shared by the incident and forensics tests -----
# (tests using these carry @pytest.mark.xdist_group("glm53") so one xdist worker computes them once)
GLM53_SMALL = dict(context=1024, victims=2, background=8, max_tokens=24, seed=3)


def _replay(tmp_path_factory, policy: str, mode: str = "disaggregated"):
    from engine.replay.glm53 import glm53
    store = tmp_path_factory.mktemp(f"store-{policy}-{mode}")
    res = glm53(policy, mode, recorder=recording(str(store), flush_interval=0.2), **GLM53_SMALL)
    return res, store


@pytest.fixture(scope="session")
def glm53_vulnerable(tmp_path_factory):
    return _replay(tmp_path_factory, "vulnerable")


@pytest.fixture(scope="session")
def glm53_hardened(tmp_path_factory):
    return _replay(tmp_path_factory, "hardened")


@pytest.fixture(scope="session")
def glm53_unified(tmp_path_factory):
    return _replay(tmp_path_factory, "vulnerable", "unified")


# ---- several runs in one store (test_runs, test_clickhouse: @pytest.mark.xdist_group("runs")) ----
MIXED = [("late_write", "vulnerable"), ("double_free", "vulnerable"), ("late_write", "hardened"),
         ("offload_race", "vulnerable")]


@pytest.fixture(scope="session")
def mixed(tmp_path_factory):
    """Four runs, one store: node names (prefill0, decode0), page numbers and logical clocks all
    restart with every run - exactly what once made reads of one run match writes of another."""
    from engine.replay.faults import run_fault
    store = tmp_path_factory.mktemp("mixed")
    return store, [run_fault(name, policy, recorder=recording(str(store), flush_interval=0.2)) for name, policy in MIXED]


# ---- a skipped test is a failure, except tests marked `gpu` (no GPU on the CI machine), tests
# marked `amx` on a CPU without AMX tiles and `avx512_bf16` on one without bf16 dot products (CI's
# machines are Intel Xeons with both, AMD EPYCs with the dot products and no tiles, or with neither):
# on a CPU that has them such a test that skips fails the run as any other ---------
_bad_skips: list[str] = []


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_ABSENT_HARDWARE = ({"gpu"} | ({"amx"} if "amx_tile" not in _cpu_flags() else set())
                    | ({"avx512_bf16"} if "avx512_bf16" not in _cpu_flags() else set()))


def pytest_runtest_logreport(report):
    if report.skipped and not _ABSENT_HARDWARE & set(report.keywords):
        _bad_skips.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _bad_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _bad_skips:
        terminalreporter.write_line(f"FAILED: {len(_bad_skips)} test(s) skipped without a marker of hardware absent here "
                                    f"({', '.join(sorted(_ABSENT_HARDWARE))}): "
                                    + ", ".join(_bad_skips[:5]), red=True)


@pytest.fixture(autouse=True)
def _give_memory_back():
    """After each test: collect cycles and hand freed heap back to the OS (glibc keeps it
    otherwise), so a worker's resident memory is the live set, not the sum of every test's peak
    (two workers at 8-12 GB each were OOM-killed on a 24 GB machine)."""
    main = sys.modules.get("__main__")
    yield
    # streamlit's AppTest leaves the dashboard script as __main__: a process spawned later (the
    # receiver's decoders) would run it again on start-up
    sys.modules["__main__"] = main
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):    # not glibc
        pass
