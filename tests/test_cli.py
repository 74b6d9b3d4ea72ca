"""The command line as a newcomer meets it (issue 23): every option says what it does and its
default, and the defaults are coherent - preflight with no arguments passes, generate never
serves a context longer than its pool without saying so."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine.commands.main import build_parser, main
from engine.kv.pool import KVPool
from engine.models.llama import LlamaModel


def _options():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        for a in sp._actions:
            if not isinstance(a, argparse._HelpAction):
                yield name, a


@pytest.mark.parametrize("command,action", list(_options()),
                         ids=[f"{n} {a.option_strings[0] if a.option_strings else a.dest}" for n, a in _options()])
def test_every_option_has_help_naming_its_default(command, action):
    assert action.help, f"{command} {action.option_strings}: no help text"
    if action.default not in (None, False, [], argparse.SUPPRESS) and action.option_strings:
        assert "default" in action.help, f"{command} {action.option_strings}: help does not state the default"


def test_preflight_with_no_arguments_checks_a_context_the_default_pool_holds(capsys):
    assert main(["preflight"]) == 0
    assert "fits" in capsys.readouterr().out


def test_generate_sizes_its_context_to_the_pool_and_warns_when_told_to_outgrow_it(capsys):
    assert main(["generate", "--model", "recall", "--prompt", "hello there", "--max-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert "kvledger: warning" not in out.err and "= 2720 tokens" in out.err     # 64 MiB: a 2720-token pool
    assert main(["generate", "--model", "recall", "--prompt", "hello there", "--max-tokens", "2",
                 "--context-length", "4096"]) == 0
    err = capsys.readouterr().err
    assert "kvledger: warning: --context-length 4096 is longer than the KV pool (2720 tokens" in err


@pytest.mark.xdist_group("glm53")
def test_forensics_tables_fit_80_columns_and_never_cut_an_id(glm53_vulnerable, capsys, monkeypatch):
    """At 80 columns the table shows a compact set: every id whole on one line. --wide and
    --columns choose more; csv and json always carry every column (maps as key=value lists)."""
    _, store = glm53_vulnerable
    monkeypatch.setenv("COLUMNS", "80")
    for query, ids in (("exposures", ("response", "donor")), ("ttft", ("incarnation",)), ("scores", ("response",))):
        assert main(["forensics", query, "--store", str(store), "--format", "json"]) == 0
        rows = __import__("json").loads(capsys.readouterr().out)
        assert main(["forensics", query, "--store", str(store)]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= 80
        for r in rows:
            for col in ids:
                assert str(r[col]) in out, f"{query}: {col} {r[col]} not shown whole"
    assert main(["forensics", "exposures", "--store", str(store), "--columns", "donor,evidence"]) == 0
    out = capsys.readouterr().out
    head = out[out.index("┏"):out.index("┡")]
    assert "donor" in head and "evidence" in head and "response" not in head
    assert main(["forensics", "exposures", "--store", str(store), "--columns", "donor,nope"]) == 2
    assert "kvledger: error: --columns: nope not in exposures's columns" in capsys.readouterr().err
    assert main(["forensics", "exposures", "--store", str(store), "--columns", ","]) == 2
    assert "kvledger: error: --columns: no column named in exposures's columns" in capsys.readouterr().err
    assert main(["forensics", "exposures", "--store", str(store), "--wide"]) == 0
    assert "attention_mass" in capsys.readouterr().out
    assert main(["forensics", "preflight", "--store", str(store), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "guards" in lines[0] and "read_check=" in lines[1]


@pytest.mark.xdist_group("glm53")
def test_the_readme_examples_run_and_say_what_their_comments_claim(glm53_vulnerable, tmp_path, capsys, monkeypatch):
    """Every command of the README's "After the quick start" block, run as written (against the
    session's replay store, in a scratch directory), exits 0; the ttft comment's claim holds."""
    import json
    import re
    import shlex
    from pathlib import Path
    _, store = glm53_vulnerable
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("After the quick start, for example:", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    ran = 0
    for line in block.strip().splitlines():
        cmd, _, comment = line.partition("   #")
        cmd = re.sub(r"\$\(date -u \+%FT%T\)", "2099-01-01T00:00:00", cmd)
        argv = shlex.split(cmd)
        assert argv[0] == ".venv/bin/kvledger", line
        assert main(argv[1:] + ["--store", str(store)]) == 0, line
        ran += 1
        if argv[1:3] == ["forensics", "ttft"]:
            assert "billed for the whole prompt, 1 token prefilled" in comment      # checked below
    capsys.readouterr()
    assert ran == 5 and (tmp_path / "report" / "report.json").exists()
    assert main(["forensics", "ttft", "--store", str(store), "--format", "json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["usage_dishonest"]]
    assert rows and all(r["prompt_tokens_prefilled"] == 1 and r["prompt_tokens_billed"] > 1 for r in rows)


# ---- fits the ecosystem (issue 34): --version, $KVLEDGER_STORE, completion, "did you mean" -------
def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvledger {version('kvledger')}"


@pytest.mark.parametrize("argv,error,hint", [
    (["forensic", "exposures"], "invalid choice 'forensic'", "did you mean 'forensics'?"),
    (["forensics", "exposres"], "invalid choice 'exposres'", "did you mean 'exposures'?"),
    (["forensics", "exposures", "--alow-unverified"], "unrecognized arguments: --alow-unverified",
     "did you mean --allow-unverified?"),
    (["replay", "glm53", "--polcy", "hardened"], "unrecognized arguments: --polcy", "did you mean --policy?"),
    (["replay", "glm53", "--policy", "hardend"], "invalid choice 'hardend'", "did you mean 'hardened'?"),
    (["completion", "fish"], "invalid choice 'fish'", "(one of: bash, zsh, tcsh)"),
    (["zzzzzz"], "invalid choice 'zzzzzz'", "(one of: generate, replay,"),
])
def test_a_mistake_is_one_line_with_a_suggestion_never_the_usage_block(argv, error, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and err.startswith("kvledger: error: "), err
    assert error in err and hint in err and "usage:" not in err


def test_the_store_defaults_to_the_environment_variable(glm53_vulnerable, monkeypatch, capsys, tmp_path):
    _, store = glm53_vulnerable
    monkeypatch.chdir(tmp_path)                             # no ./kvledger-store here
    monkeypatch.setenv("KVLEDGER_STORE", str(store))
    assert main(["forensics", "runs", "--format", "json"]) == 0
    assert '"boot"' in capsys.readouterr().out
    monkeypatch.delenv("KVLEDGER_STORE")
    assert main(["forensics", "runs"]) == 2
    assert "no kvledger store at kvledger-store" in capsys.readouterr().err


def test_bash_completion_from_the_parser_completes_commands_queries_and_flags(tmp_path):
    import shutil
    import subprocess
    script = tmp_path / "kvledger.bash"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["completion", "bash"]) == 0
    script.write_text(buf.getvalue())

    def complete(*words: str) -> list[str]:
        line = " ".join(("kvledger",) + words)
        cmd = (f'source {script}; COMP_WORDS=(kvledger {" ".join(words)}); COMP_CWORD={len(words)}; '
               f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; _shtab_kvledger kvledger {words[-1]} '
               f'{words[-2] if len(words) > 1 else "kvledger"}; printf "%s\\n" "${{COMPREPLY[@]}}"')
        return subprocess.run([shutil.which("bash"), "-c", cmd], capture_output=True, text=True).stdout.split()
    assert complete("forensics", "expo") == ["exposures"]
    assert "forensics" in complete("fo")
    assert "--allow-unverified" in complete("forensics", "--allow")


def test_preflight_and_verify_print_json_that_says_what_the_table_says(capsys, tmp_path):
    import json
    from pathlib import Path
    assert main(["preflight", "--format", "json", "--memory-budget", "1MiB", "--memory-budget", "64MiB"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [r["fits"] for r in rows] == [False, True] and rows[0]["pool_tokens"] < rows[0]["context_length"]
    log = Path(__file__).parent / "fixtures" / "vllm_v1.log"
    code = main(["preflight", "--vllm-log", str(log), "--format", "json"])
    found = json.loads(capsys.readouterr().out)            # the array alone on stdout
    assert found and all(f["pool_tokens"] for f in found)
    assert code == (1 if any(f["fits"] is False or f["finding"] for f in found) else 3 if any(
        f["fits"] is None for f in found) else 0)


def test_replay_and_generate_print_one_json_object(capsys):
    import json
    assert main(["generate", "--model", "recall", "--prompt", "hello there hello", "--max-tokens", "4",
                 "--format", "json"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert g["completion_tokens"] == 4 and g["read_check"] is True and g["incarnation"].isdigit()
    assert main(["replay", "late_write", "--no-store", "--format", "json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["scenario"] == "late_write" and r["requests"] and r["pages_balanced"] in (True, False)
    assert r["responses_reading_foreign_kv"] == sum(1 for q in r["requests"] if q["donors"]) >= 1
    assert all(d.isdigit() for q in r["requests"] for d in q["donors"])


def test_generate_stores_weights_and_kv_in_bf16_when_asked(tiny_llama, capsys):
    """--dtype bfloat16: the same memory budget holds about twice the tokens (each slot's K and V in
    half the bytes; the tag area and the page header stay: exactly the pages of each record size),
    and the model generates."""
    pools = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["generate", "--model", str(tiny_llama), "--prompt", "hello there", "--max-tokens", "6",
                     "--memory-budget", "8MiB", "--format", "json", "--dtype", dtype]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["completion_tokens"] == 6 and out["read_check"] is True
        pools[dtype] = out["pool_tokens"]
    m = LlamaModel.from_pretrained(tiny_llama)
    for dtype, n in pools.items():
        assert n == 16 * ((8 << 20) // KVPool.page_bytes_for(m.num_layers, m.kv_dim, 16, getattr(torch, dtype)))
    assert 1.7 * pools["float32"] < pools["bfloat16"] < 2 * pools["float32"]


def test_serve_sizes_each_pool_by_the_bytes_its_dtype_stores(tiny_llama):
    """serve's pools hold the tokens its cluster config names whatever --dtype stores (the bytes a
    page takes follow the dtype; with fp32's page size a bf16 pool would hold twice the tokens)."""
    from engine.models import load_model
    from engine.server.backend import ApiKeys, ClusterSpec, build_backend
    spec, keys = ClusterSpec.load(None), ApiKeys.load(None)
    for dtype in ("float32", "bfloat16"):
        model, tok = load_model(str(tiny_llama), dtype)
        eng = build_backend(model, tok, "unified", "hardened", spec, keys, None, max_num_seqs=4)
        assert eng.pool.dtype == getattr(__import__("torch"), dtype)
        assert eng.pool.capacity_tokens == spec.unified_tokens // spec.page_size * spec.page_size


def test_json_rows_write_what_python_s_json_wrote_and_null_for_a_float_that_is_not_a_number():
    """forensics' JSON (json_rows): written by polars where every column is plain, it parses to the
    values the dicts-and-json path gives - ids as decimal strings, times as utc_iso writes them
    (microseconds only where not zero, a zoned time in UTC, nanoseconds cut) - except that NaN and
    infinities are null (JSON has neither); any other column type takes the dicts path."""
    import datetime as dt
    import json
    import math

    import polars as pl

    from forensics.output import _json_default, json_ready, json_rows
    t = [dt.datetime(2026, 1, 1), dt.datetime(2026, 1, 1, 0, 0, 0, 5), None, dt.datetime(1999, 12, 31, 23, 59, 59, 999999)]
    df = pl.DataFrame({"response": pl.Series([2 ** 62 + 1, -3, None, 7], dtype=pl.Int64),
                       "donor": [[2 ** 60], [], None, [1, 2]], "t": t,
                       "zoned": pl.Series(t).dt.replace_time_zone("Europe/Paris"),
                       "mass": [1.5, math.nan, math.inf, -0.0], "flag": [True, None, False, True],
                       "kinds": [["stale"], None, [], ["a", "é\"\n"]], "tenant": ["e9", None, "\u2028", ""]}
                      ).with_columns(ns=pl.col("t").cast(pl.Datetime("ns")) + pl.duration(nanoseconds=999))

    def slow(d: pl.DataFrame):
        return json.loads(json.dumps(json_ready(d).to_dicts(), default=_json_default).replace("NaN", "null")
                          .replace("Infinity", "null"))
    got = json.loads(json_rows(df))
    assert got == slow(df)
    assert got[0]["response"] == str(2 ** 62 + 1) and got[0]["donor"] == [str(2 ** 60)]
    assert [r["t"] for r in got] == ["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.000005Z", None,
                                     "1999-12-31T23:59:59.999999Z"]
    assert got[0]["zoned"] == "2025-12-31T23:00:00Z" and got[1]["ns"] == "2026-01-01T00:00:00.000005Z"
    assert [r["mass"] for r in got] == [1.5, None, None, -0.0]
    other = df.with_columns(d=pl.col("t") - pl.col("t").min(), s=pl.struct("flag", "tenant"))   # not plain: dicts
    assert json.loads(json_rows(other)) == json.loads(json.dumps(json_ready(other).to_dicts(), default=_json_default)
                                                      .replace("NaN", "null").replace("Infinity", "null"))
