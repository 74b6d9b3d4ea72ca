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
