"""Bad input, as a table: every case ends in one line `kvledger: error: <what, and the limit>` and
a non-zero exit - never a Python traceback - and takes nothing first (no store is created)."""
from __future__ import annotations

import shutil

import pytest

from engine.commands.main import main

CASES = {
    "temperature nan": (["generate", "--model", "recall", "--prompt", "x", "--temperature", "nan"],
                        "temperature must be a finite number >= 0, got nan"),
    "temperature inf": (["generate", "--model", "recall", "--prompt", "x", "--temperature", "inf"],
                        "temperature must be a finite number >= 0, got inf"),
    "invalid UTF-8 prompt": (["generate", "--model", "recall", "--prompt", "ok \udcff"], "not valid UTF-8"),
    "seed 2**70": (["generate", "--model", "recall", "--prompt", "x", "--seed", str(2 ** 70)], "seed must be in [0, 2**63)"),
    "generate max-tokens 0": (["generate", "--model", "recall", "--prompt", "x", "--max-tokens", "0"],
                              "--max-tokens must be in [1, 16777216]"),
    "generate max-tokens 1e12": (["generate", "--model", "recall", "--prompt", "x", "--max-tokens", "1000000000000"],
                                 "--max-tokens must be in [1, 16777216]"),
    "generate max-tokens over the context": (["generate", "--model", "recall", "--prompt", "x", "--max-tokens", "100000"],
                                             "leaves no room for the prompt in the context of"),
    "generate memory-budget 1024GiB": (["generate", "--model", "recall", "--prompt", "x", "--memory-budget", "1024GiB"],
                                       "at most this machine's memory"),
    "generate memory-budget 0": (["generate", "--model", "recall", "--prompt", "x", "--memory-budget", "0"],
                                 "must be more than 0"),
    "tenant_scores bucket 2**62": (["forensics", "tenant_scores", "--bucket", str(2 ** 62)],
                                   "--bucket must be in [1, 315360000] seconds"),
    "dashboard refresh nan": (["dashboard", "--refresh", "nan"], "--refresh must be in [0.5, 3600] seconds, got nan"),
    "dashboard refresh 0": (["dashboard", "--refresh", "0"], "--refresh must be in [0.5, 3600]"),
    "serve host 999.1.1.1": (["serve", "--host", "999.1.1.1"], "--host '999.1.1.1' is not an address"),
    "collect host 999.1.1.1": (["collect", "--otlp-host", "999.1.1.1"], "--otlp-host '999.1.1.1' is not an address"),
    "collect kv-events port abc": (["collect", "--kv-events", "tcp://127.0.0.1:abc"], "a ZMQ address is tcp://HOST:PORT"),
    "serve port in use": (["serve", "--port", "@busy"], "cannot listen on 127.0.0.1:"),
    "serve metrics-key too short": (["serve", "--metrics-key", "abc"], "--metrics-key must be 16 to 512 characters"),
    "collect port in use": (["collect", "--otlp-port", "@busy"], "cannot listen on 127.0.0.1:"),
    "replay context 0": (["replay", "glm53", "--context-length", "0"], "--context-length must be in [256, 131072]"),
    "replay context -5": (["replay", "glm53", "--context-length", "-5"], "--context-length must be in [256, 131072]"),
    "replay context 1e9": (["replay", "glm53", "--context-length", "1000000000"], "--context-length must be in [256"),
    "replay victims -1": (["replay", "glm53", "--victims", "-1"], "--victims must be >= 0 and at most 1024, got -1"),
    "replay seed 2**70": (["replay", "glm53", "--seed", str(2 ** 70)], "--seed must be in [0, 2**63)"),
    "replay max-tokens too long": (["replay", "glm53", "--max-tokens", "400"], "it must be < 335"),
    "fault replay ignores a flag": (["replay", "late_write", "--max-tokens", "5"], "apply to glm53 only"),
    "preflight page size -16": (["preflight", "--page-size", "-16", "--context-length", "1024"], "--page-size must be >= 1"),
    "forensics from after to": (["forensics", "exposures", "--from", "2026-09-02", "--to", "2026-09-01"], "is after --to"),
    "serve port 0": (["serve", "--port", "0"], "--port must be in 1..65535"),
    "serve max-pending 0": (["serve", "--max-pending", "0"], "--max-pending must be in [1, 1000000]"),
    "serve drain-timeout -1": (["serve", "--drain-timeout", "-1"], "--drain-timeout must be in [0, 3600]"),
    "serve torch-threads 0": (["serve", "--torch-threads", "0"], "--torch-threads must be in [1, 1024]"),
    "serve max-num-seqs 0": (["serve", "--max-num-seqs", "0"], "--max-num-seqs must be in [1, 4096]"),
    "serve bf16 recall": (["serve", "--dtype", "bfloat16"], "--dtype bfloat16 needs an HF-format checkpoint directory"),
    "generate bf16 recall": (["generate", "--model", "recall", "--prompt", "x", "--dtype", "bfloat16"],
                             "--dtype bfloat16 needs an HF-format checkpoint directory"),
    "serve max-num-batched-tokens huge": (["serve", "--max-num-batched-tokens", "9999999"],
                                          "--max-num-batched-tokens must be in [1, 1048576]"),
    "serve tenant-rpm -1": (["serve", "--tenant-rpm", "-1"], "--tenant-rpm must be in [0, 1099511627776] (0: no limit)"),
    "serve tenant-tpm 2**41": (["serve", "--tenant-tpm", str(2 ** 41)], "--tenant-tpm must be in [0, 1099511627776]"),
    "serve tenant-max-parallel -2": (["serve", "--tenant-max-parallel", "-2"], "--tenant-max-parallel must be in [0,"),
    "unknown run": (["forensics", "runs", "--run", "nope"], None),      # store-dependent: filled in below
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line_and_takes_nothing(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)                 # the default ./kvledger-store must not appear
    argv, expect = CASES[case]
    if expect is None:
        argv, expect = ["forensics", "runs", "--store", str(tmp_path / "nowhere")], "no kvledger store at"
    import socket
    busy = socket.socket()                       # a port something else listens on
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    argv = [str(busy.getsockname()[1]) if a == "@busy" else a for a in argv]
    try:
        code = main(argv)
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("kvledger: error: ") and expect in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "kvledger-store").exists()


def test_a_bad_writer_priority_is_one_clear_line_and_takes_no_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLEDGER_WRITER_PRIORITY", "bogus")
    assert main(["replay", "late_write", "--store", str(tmp_path / "store")]) != 0
    err = capsys.readouterr().err.strip()       # (after the blank line the replay's progress display leaves)
    assert err.startswith("kvledger: error: KVLEDGER_WRITER_PRIORITY / writer priority must be idle or normal")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


@pytest.mark.parametrize("argv", [["generate", "--model", "recall", "--prompt", "x"], ["serve"], ["replay", "late_write"]],
                         ids=["generate", "serve", "replay"])
@pytest.mark.parametrize("value", ["bogus", "oneDNN-please", "1"])
def test_a_bad_decode_path_is_one_clear_line_before_anything_is_loaded(argv, value, tmp_path, monkeypatch, capsys):
    """KVLEDGER_DECODE_KERNEL (timed, kernel or onednn) is checked by every command that builds an
    engine before it loads a model, opens a store or listens."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVLEDGER_DECODE_KERNEL", value)
    assert main([*argv, "--store", str(tmp_path / "store")] if argv[0] != "generate" else argv) != 0
    err = capsys.readouterr().err.strip()
    assert err == f"kvledger: error: KVLEDGER_DECODE_KERNEL must be one of timed, kernel, onednn, got {value!r}"
    assert not (tmp_path / "store").exists() and not (tmp_path / "kvledger-store").exists()


KEYS_FILES = {   # keys file text, what the error says
    "not JSON": ('{"k": ', "is not JSON"),
    "empty": ("{}", "expected a JSON object of api-key -> tenant"),
    "no tenant": ('{"k": {"user": "ann"}}', "the value for a key must be a tenant name or"),
    "rpm negative": ('{"k": {"tenant": "acme", "rpm": -1}}', "tenant 'acme': rpm must be an integer in [0,"),
    "tpm as text": ('{"k": {"tenant": "acme", "tpm": "1000"}}', "tenant 'acme': tpm must be an integer"),
    "two keys, two limits": ('{"k1": {"tenant": "acme", "rpm": 5}, "k2": {"tenant": "acme", "rpm": 6}}',
                             "tenant 'acme' has two keys with different rate limits"),
    "a misspelt limit": ('{"k": {"tenant": "acme", "rmp": 5}}', "tenant 'acme': unknown field(s) rmp (known:"),
}

CLUSTER_FILES = {   # cluster.toml text, what the error says
    "not TOML": ("context_length = ", "is not TOML"),
    "an unknown key": ("context_lenght = 1024\n", "unknown key(s) context_lenght (known:"),
    "prefill of numbers": ("prefill = [1, 2]\n", "[[prefill]] #1 must be a table of node_id, pool_tokens, got int"),
    "a misspelt node key": ('[[prefill]]\nnode_id = "p0"\npool_tokns = 64\n', "[[prefill]] #1: unknown key(s) pool_tokns"),
    "decode not a table": ("decode = 5\n", "[decode] must be a table of pool_tokens"),
    "isolation typo": ('isolation_level = "tenants"\n', "isolation_level must be user, tenant, org or none"),
}


@pytest.mark.parametrize("case", list(CLUSTER_FILES))
def test_a_bad_cluster_config_is_named_before_anything_starts(case, tmp_path, capsys):
    text, says = CLUSTER_FILES[case]
    (tmp_path / "cluster.toml").write_text(text)
    assert main(["serve", "--config", str(tmp_path / "cluster.toml"), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and says in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


@pytest.mark.parametrize("case", list(KEYS_FILES))
def test_a_bad_keys_file_is_named_before_anything_starts(case, tmp_path, capsys):
    text, says = KEYS_FILES[case]
    (tmp_path / "keys.json").write_text(text)
    assert main(["serve", "--keys", str(tmp_path / "keys.json"), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvledger: error: --keys {tmp_path / 'keys.json'}") and says in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


def _model_dir(src, tmp_path, breaks: str):
    d = tmp_path / "model"
    shutil.copytree(src, d)
    if breaks == "config":
        (d / "config.json").write_text('{"hidden_size": ')
    elif breaks == "safetensors":
        f = next(d.glob("*.safetensors"))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        (d / "tokenizer.json").write_text("garbage{")
    return d


@pytest.mark.parametrize("breaks", ["config", "safetensors", "tokenizer"])
def test_a_broken_model_directory_is_named(tiny_llama, tmp_path, capsys, breaks):
    d = _model_dir(tiny_llama, tmp_path, breaks)
    assert main(["generate", "--model", str(d), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvledger: error: cannot load the model in {d}") and "Traceback" not in err, err


def test_serve_names_a_broken_model_from_its_engine_process_and_takes_no_store(tiny_llama, tmp_path, capsys):
    """The weights load in the engine process: its error comes back as the server's one line, exit 2,
    before the store is opened (the tokenizer, which the HTTP process loads, is whole here)."""
    d = _model_dir(tiny_llama, tmp_path, "safetensors")
    assert main(["serve", "--model", str(d), "--store", str(tmp_path / "store"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvledger: error: cannot load the model in {d}") and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


def test_a_store_or_report_path_that_cannot_be_written_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    assert main(["report", "--store", str(tmp_path / "s"), "--out", str(tmp_path / "afile")]) == 2
    assert "--out " in capsys.readouterr().err and (tmp_path / "afile").read_text() == "x"
    # a store under a file (not writable by anyone, root included)
    assert main(["replay", "late_write", "--store", str(tmp_path / "afile" / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and "Traceback" not in err, err
    monkeypatch.setenv("KVLEDGER_STORE_SECRET", "not-hex")
    assert main(["replay", "late_write", "--store", str(tmp_path / "new")]) == 2
    assert "KVLEDGER_STORE_SECRET must be hex" in capsys.readouterr().err


# every numeric flag of every command, walked from the parser (a new flag joins the sweep by itself):
# the arguments a command needs besides the flag, and values no flag may take
NEEDS = {"generate": ["--model", "recall", "--prompt", "x"], "replay": ["glm53"], "forensics": ["exposures"],
         "probe": ["--base-url", "http://127.0.0.1:9", "--key-a", "a", "--key-b", "b"], "export": ["--to", "chdb:x"]}
HOSTILE = {int: ["-1", str(2 ** 64), "1.5"], float: ["nan", "inf", "-1e300"]}


def _numeric_flags():
    import argparse

    from engine.commands.main import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.option_strings and a.type in HOSTILE:
                for value in HOSTILE[a.type]:
                    yield pytest.param(name, a.option_strings[-1], value, id=f"{name} {a.option_strings[-1]} {value}")


@pytest.mark.parametrize("name,flag,value", list(_numeric_flags()))
def test_every_numeric_flag_is_bounded_and_names_its_limit(name, flag, value, tmp_path, monkeypatch, capsys):
    from engine.commands import main as entry
    monkeypatch.chdir(tmp_path)
    mod = entry.command(name)

    def accepted(config):
        raise AssertionError(f"{name} {flag} {value} was accepted: {config}")
    monkeypatch.setattr(mod, "run", accepted)
    try:
        code = entry.main([name, *NEEDS.get(name, []), flag, value])
    except SystemExit as e:                      # argparse's own refusal (one line, exit 2)
        code = e.code
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("kvledger: error: ") and flag in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "kvledger-store").exists()
