"""`kvledger probe` proven on our own server: the incident's signs found from the outside under
`vulnerable` (exit 1, with the response that showed each), nothing found under `hardened` (exit 0),
and bad input refused before a request is sent."""
from __future__ import annotations

import json
import time

import pytest

from forensics.queries.duckdb import Forensics
from engine.commands.main import main
from tests.test_serve import ONE_SMALL_PREFILL, Server

pytestmark = pytest.mark.xdist_group("serve")


@pytest.mark.parametrize("policy", ["vulnerable", "hardened"])
def test_the_probe_finds_the_incident_from_outside_only_where_it_happens(tmp_path, capsys, policy):
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", policy, config=ONE_SMALL_PREFILL)
    try:
        code = main(["probe", "--base-url", s.url + "/v1", "--key-a", "key-a", "--key-b", "key-b", "--format", "json",
                     "--checks", "limits,usage,canary"])
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


def _probe(tmp_path, capsys, config: str, samples: int, checks: str) -> tuple[int, dict]:
    """Some checks against a fresh unified, hardened server with ``config``: (exit code, rows by check)."""
    s = Server(tmp_path, "--mode", "unified", "--policy", "hardened", config=config)
    try:
        code = main(["probe", "--base-url", s.url + "/v1", "--key-a", "key-a", "--key-b", "key-b", "--format", "json",
                     "--checks", checks, "--samples", str(samples)])
    finally:
        assert s.stop() == 0
    return code, {r["check"]: r for r in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("isolation", ["tenant", "none"])
def test_the_cache_side_channels_are_found_only_where_the_cache_is_shared(tmp_path, capsys, isolation):
    """`none` is one global scope (what an engine without per-tenant salts does). salt: B sending A's
    salt reaches A's cached prefix. timing: interleaved samples, a one-sided rank test and an effect
    size. Under `tenant` both positive controls (A's own prefix comes back cached, and faster) hold,
    so the passes have power."""
    code, rows = _probe(tmp_path, capsys, f'context_length = 1024\nisolation_level = "{isolation}"\n', 10,
                        "salt,timing")
    salt, timing = rows["salt"], rows["timing"]
    assert "positive control (A's own prefix): p=" in timing["detail"], timing
    if isolation == "none":
        assert code == 1 and salt["verdict"] == "finding" and salt["evidence"], salt
        assert timing["verdict"] == "finding" and timing["evidence"][0]["median_ttft_ratio"] < 0.7, timing
    else:
        assert code == 0 and salt["verdict"] == "pass" and "came back cached" in salt["detail"], salt
        assert timing["verdict"] == "pass", timing


# two prefill nodes (round robin: A's short prefill can land before B's long one), no over-pool
# prompt possible (every pool holds the context), a decode pool B's prompt nearly fills
ABORT_CLUSTER = ('context_length = 1024\nprefix_cache = false\n[[prefill]]\nnode_id = "prefill0"\npool_tokens = 2048\n'
                 '[[prefill]]\nnode_id = "prefill1"\npool_tokens = 2048\n[decode]\npool_tokens = 1152\n')


@pytest.mark.parametrize("policy", ["vulnerable", "hardened"])
def test_the_abort_check_finds_late_writes_and_records_the_run_in_the_store(tmp_path, capsys, policy):
    """B closes streams mid-prefill while A repeats a greedy prompt: under `vulnerable` B's transfers
    still land in decode pages A got meanwhile, and A's answer changes (the server's own ledger
    agrees: A read B's KV); under `hardened` nothing changes. The run goes into a store: verdicts
    and findings readable by `forensics probes` and the report, no API key or canary in clear."""
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", policy, config=ABORT_CLUSTER)
    pstore = tmp_path / "probes"
    try:
        code = main(["probe", "--base-url", s.url + "/v1", "--key-a", "key-a", "--key-b", "key-b", "--format", "json",
                     "--checks", "abort", "--samples", "2", "--store", str(pstore)])
    finally:
        assert s.stop() == 0
    out = capsys.readouterr().out
    row = json.loads(out)[0]
    assert "closed before their measured TTFT" in row["detail"] and "the same 3 times" in row["detail"], row
    exposed = Forensics(s.store).exposures()
    if policy == "vulnerable":
        assert code == 1 and row["verdict"] == "finding" and row["evidence"], row
        assert exposed.height > 0 and all("foreign" in k for k in exposed["kinds"].to_list())
    else:
        assert code == 0 and row["verdict"] == "pass", row
        assert exposed.height == 0
    fx = Forensics(pstore)
    probes = fx.query("probes")
    assert probes.rows(named=True)[0]["verdict"] == row["verdict"]
    assert probes["findings"].to_list() == [len(row["evidence"])]
    from forensics.report import build
    assert build(pstore)["external_probes"][0]["check"] == "abort"
    raw = b"".join(f.read_bytes() for f in pstore.rglob("*") if f.is_file())
    assert b"key-a" not in raw and b"key-b" not in raw and b"CANARY-" not in raw


def test_without_a_prefix_cache_the_salt_check_is_inconclusive_never_a_pass(tmp_path, capsys):
    code, rows = _probe(tmp_path, capsys, "prefix_cache = false\n", 2, "salt")
    assert code == 3 and rows["salt"]["verdict"] == "inconclusive" and "positive control failed" in rows["salt"]["detail"]


@pytest.mark.parametrize("argv,error", [
    (["--checks", "limits,frobnicate"], "unknown check(s) ['frobnicate']"),
    (["--store", "/dev/null"], "--store /dev/null: store path /dev/null exists and is not a directory"),
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


TWO_POOLS = ('context_length = 1024\n[[prefill]]\nnode_id = "prefill0"\npool_tokens = 656\n'
             '[[prefill]]\nnode_id = "prefill1"\npool_tokens = 1200\n')


def test_on_a_cluster_of_unequal_pools_a_200_between_them_is_a_warning_not_a_finding(tmp_path, capsys):
    """A hardened server whose prefill nodes hold 656 and 1,200 tokens: a prompt of 657-1,024 tokens
    answered 200 may have been served by the bigger node, rightly. The probe says so and passes,
    whichever node round robin picks; only usage/TTFT or canary evidence would make it a finding
    (the usage check takes those 200s as its candidates; the limits check alone is run here)."""
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", "hardened", config=TWO_POOLS)
    try:
        code = main(["probe", "--base-url", s.url + "/v1", "--key-a", "key-a", "--key-b", "key-b", "--format", "json",
                     "--checks", "limits"])
    finally:
        assert s.stop() == 0
    rows = {r["check"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and rows["limits"]["verdict"] == "pass", rows
    assert rows["limits"]["detail"].startswith("pools 656, 1200, context 1024"), rows["limits"]
    assert "1025 -> 400" in rows["limits"]["detail"]                         # over the context: refused
    if "1024 -> 200" in rows["limits"]["detail"]:
        assert "configuration warning" in rows["limits"]["detail"]


def test_a_429_is_retried_after_its_retry_after(monkeypatch):
    """The probe's request path against an endpoint that answers 429 twice (Retry-After: 0.2), then
    streams: one answer, three requests, the waits honoured."""
    import httpx
    import openai

    from forensics.probe import Endpoint
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            return httpx.Response(429, headers={"Retry-After": "0.2"},
                                  json={"error": {"message": "slow down", "type": "requests"}})
        body = ('data: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", '
                '"choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n'
                'data: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [], '
                '"usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())
    t = Endpoint.__new__(Endpoint)
    t.model, t.requests, t.root = "m", 0, "http://x"
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    out = t.complete(client, "a b c", 1)
    assert out["status"] == 200 and out["id"] == "cmpl-1" and out["usage"] == 3 and len(calls) == 3
    assert out["ttft"] is not None                         # the first chunk times it, though its text is empty
    assert calls[1] - calls[0] >= 0.19 and calls[2] - calls[1] >= 0.19 and t.requests == 3


@pytest.mark.parametrize("p_own,r_own,p_cross,r_cross,want", [
    (0.0076, 0.69, 0.0011, 0.71, "finding"),      # seen against a real vLLM: B gets what A gets, just under 30 %
    (0.001, 0.40, 0.001, 0.45, "finding"),
    (0.001, 0.40, 0.30, 0.98, "pass"),            # the cache works for A and not for B
    (0.001, 0.40, 0.004, 0.90, "pass"),           # significant but a sliver of the control's speed-up
    (0.0011, 0.65, 0.032, 0.70, "inconclusive"),  # seen against a real vLLM: B nearly as fast as A, p short of alpha
    (0.001, 0.40, 0.30, 0.80, "inconclusive"),    # a third of A's speed-up, not significant: no pass either
    (0.40, 0.95, 0.50, 1.00, "inconclusive"),     # no cache effect even for A: no power
    (0.001, 0.75, 0.40, 0.99, "inconclusive"),    # A's effect too small to call B's absence a pass
])
def test_the_timing_verdict_weighs_b_against_the_positive_control(p_own, r_own, p_cross, r_cross, want):
    from forensics.probe import timing_verdict
    assert timing_verdict(p_own, r_own, p_cross, r_cross) == want
