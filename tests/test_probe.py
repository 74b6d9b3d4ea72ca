"""`kvledger probe` proven on our own server: the incident's signs found from the outside under
`vulnerable` (exit 1, with the response that showed each), nothing found under `hardened` (exit 0),
and bad input refused before a request is sent."""
from __future__ import annotations

import json

import pytest

from forensics.cli import main
from tests.test_serve import ONE_SMALL_PREFILL, Server

pytestmark = pytest.mark.xdist_group("serve")


@pytest.mark.parametrize("policy", ["vulnerable", "hardened"])
def test_the_probe_finds_the_incident_from_outside_only_where_it_happens(tmp_path, capsys, policy):
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", policy, config=ONE_SMALL_PREFILL)
    try:
        code = main(["probe", "--base-url", s.url + "/v1", "--key-a", "key-a", "--key-b", "key-b", "--format", "json"])
        rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
        # preflight from the outside: the same server's /server_info, node by node
        assert main(["preflight", "--endpoint", s.url + "/v1"]) == (1 if policy == "vulnerable" else 0)
        assert ("prefill0 cannot hold" in capsys.readouterr().err) is (policy == "vulnerable")
    finally:
        assert s.stop() == 0
    assert set(rows) == {"limits", "usage", "canary"}
    assert rows["limits"]["target"]["pool_tokens"] == 656 and rows["limits"]["target"]["context_length"] == 1024
    if policy == "vulnerable":
        assert code == 1 and {r["verdict"] for r in rows.values()} == {"finding"}, rows
        assert {e["prompt_tokens"] for e in rows["limits"]["evidence"]} == {657, 1024}     # 200 over the pool
        assert any("prefill skipped" in e["why"] for e in rows["usage"]["evidence"])
        assert all(e["response"].startswith("cmpl-") for e in rows["canary"]["evidence"])
    else:
        assert code == 0 and {r["verdict"] for r in rows.values()} == {"pass"}, rows


@pytest.mark.parametrize("argv,error", [
    (["--checks", "limits,frobnicate"], "unknown check(s) ['frobnicate']"),
    (["--checks", "timing"], "not implemented yet"),
    (["--samples", "0"], "--samples must be in [1, 200]"),
    (["--pool-tokens", "-5"], "--pool-tokens must be in [2"),
    (["--base-url", "ftp://example"], "must be an http(s) URL"),
    (["--base-url", "http://127.0.0.1:9/v1"], "cannot connect"),
])
def test_bad_probe_input_is_refused_before_any_request(capsys, argv, error):
    base = {"--base-url": "http://127.0.0.1:9/v1", "--key-a": "a", "--key-b": "b"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert main(["probe", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger: error: ") and error in err and "Traceback" not in err, err
