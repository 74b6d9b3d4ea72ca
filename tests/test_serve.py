"""`kvledger serve` as clients, attackers and operators meet it: the official `openai` client
against a real server on a loopback port, bad bodies as a table, scopes only narrowed by clients,
a disconnect storm, the incident live under `vulnerable` and refused under `hardened`, SIGTERM,
kill -9 and a restart on the same store, and a real Prometheus firing the shipped alert."""
from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

from forensics.queries.duckdb import Forensics
from telemetry.store import verify

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"key-a": "acme", "key-b": "globex", "key-u": {"tenant": "initech", "user": "ann"},
        "key-r": {"tenant": "metered", "rpm": 3, "tpm": 2000}, "key-p": {"tenant": "narrow", "max_parallel_requests": 1}}
pytestmark = pytest.mark.xdist_group("serve")
SECRET_TEXT = "The board approved the merger with Globex at 41 dollars a share; announce on Friday. " * 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str, store: Path | None = None, config: str | None = None):
        self.port, self.store = _port(), store or tmp / "store"
        keys = tmp / "keys.json"
        keys.write_text(json.dumps(KEYS))
        argv = [sys.executable, "-m", "engine.commands", "serve", "--keys", str(keys), "--store", str(self.store),
                "--port", str(self.port), "--drain-timeout", "5", *args]
        if config:
            (tmp / "cluster.toml").write_text(config)
            argv += ["--config", str(tmp / "cluster.toml")]
        self.log = open(tmp / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            assert self.proc.poll() is None, (tmp / f"server-{self.port}.log").read_text()
        raise AssertionError("server did not come up")

    def client(self, key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str, **labels) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                series, value = line.rsplit(" ", 1)
                got = series[len(name):].strip("{}")
                if all(part in got.split(",") for part in want.split(",") if part):
                    total += float(value)
        return total

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


@pytest.fixture(scope="session")
def unified(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("unified"), "--mode", "unified", "--policy", "hardened", "--max-num-seqs", "24",
               "--max-num-batched-tokens", "1024")
    yield s
    assert s.stop() == 0


def test_completion_chat_and_stream_in_the_openai_shape(unified):
    c = unified.client()
    r = c.completions.create(model="recall", prompt="Remember: the secret is CANARY-x9Fq2; keep it. Later: the secret is",
                             max_tokens=14, temperature=0)
    assert r.choices[0].text == " CANARY-x9Fq2;" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 67 and r.usage.completion_tokens == 14 and r.id.startswith("cmpl-")
    chat = c.chat.completions.create(model="recall", messages=[{"role": "user", "content": "ping ping ping"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    parts = list(c.completions.create(model="recall", prompt="abc abc abc", max_tokens=8, stream=True,
                                      stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == " abc abc"
    assert parts[-1].usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="recall", messages=[{"role": "user", "content": "xy xy xy"}],
                                            max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in c.models.list().data] == ["recall"]
    tok = httpx.post(unified.url + "/tokenize", json={"prompt": "héllo"}, headers={"Authorization": "Bearer key-a"}).json()
    assert tok["count"] == 6 and tok["max_model_len"] == 1024
    info = httpx.get(unified.url + "/server_info").json()
    assert info["policy"] == "hardened" and info["nodes"][0]["pool_tokens"] == info["max_total_num_tokens"] == 2048
    assert (info["nodes"][0]["max_num_seqs"], info["nodes"][0]["max_num_batched_tokens"]) == (24, 1024)   # the flags
    assert info["nodes"][0]["dtype"] == "float32"


LONG = "z" * 1500
BAD = {   # body (dict: JSON; bytes: raw), headers, status, what the error says
    "no key": ({"prompt": "x"}, {}, 401, "missing or unknown API key"),
    "unknown key": ({"prompt": "x"}, {"Authorization": "Bearer nope"}, 401, "missing or unknown API key"),
    "malformed JSON": (b'{"prompt": ', None, 400, "not JSON"),
    "not an object": (b"[1, 2]", None, 400, "must be a JSON object"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, None, 400, "nested too deep"),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe"}', None, 400, "not valid UTF-8"),
    "missing prompt": ({"max_tokens": 3}, None, 400, "prompt: Field required"),
    "wrong type": ({"prompt": "x", "max_tokens": "three"}, None, 400, "max_tokens"),
    "max_tokens 0": ({"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens: Input should be greater than or equal to 1"),
    "max_tokens absurd": ({"prompt": "x", "max_tokens": 10 ** 9}, None, 400, "less than or equal to 4096"),
    "temperature nan": (b'{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    "n 2": ({"prompt": "x", "n": 2}, None, 400, "n: unsupported value"),
    "logprobs": ({"prompt": "x", "logprobs": 2}, None, 400, "logprobs"),
    "stop": ({"prompt": "x", "stop": ["\n"]}, None, 400, "stop"),
    "unknown field": ({"prompt": "x", "frobnicate": 1}, None, 400, "frobnicate: unsupported parameter"),
    "empty token prompt": ({"prompt": []}, None, 400, "prompt is empty"),
    "token out of vocabulary": ({"prompt": [1, 999999]}, None, 400, "outside the vocabulary"),
    "over context": ({"prompt": LONG}, None, 400, "longer than the context length 1024"),
    "wrong model": ({"prompt": "x", "model": "gpt-5"}, None, 404, "does not exist"),
    "oversized body": ({"prompt": "x" * (1 << 20)}, None, 413, "limit"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_gets_a_clear_4xx_in_the_openai_error_shape(unified, case):
    body, headers, status, says = BAD[case]
    headers = {"Authorization": "Bearer key-a"} if headers is None else headers
    kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers}
    r = httpx.post(unified.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"], err
    if case == "over context":
        assert err["code"] == "context_length_exceeded"


def test_the_official_client_sees_the_same_errors(unified):
    with pytest.raises(openai.AuthenticationError):
        unified.client("nope").completions.create(model="recall", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|longer than the context"):
        unified.client().completions.create(model="recall", prompt=LONG)


def test_a_client_salt_or_user_only_narrows_the_cache_scope(unified):
    def cached(key: str, **extra) -> int:
        r = unified.client(key).completions.create(model="recall", prompt=SECRET_TEXT + " And", max_tokens=1,
                                                   extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached("key-a") == 0
    assert cached("key-a") > 0                              # acme's own prefix, reused
    assert cached("key-b") == 0                             # globex: identical tokens, another scope
    assert cached("key-a", cache_salt="s1") == 0            # narrowed: acme + salt is a scope of its own
    assert cached("key-a", user="bob") == 0
    assert cached("key-b", cache_salt='"]["tenant","acme') == 0 and cached("key-b", user="acme") == 0
    assert cached("key-a") > 0


def test_a_tenants_rate_limits_refuse_it_alone_with_retry_after(unified):
    """key-r: 3 requests and 2000 tokens a minute; key-p: one request in flight. The official client
    gets RateLimitError (429, OpenAI's shape and headers); other tenants are untouched; a request the
    engine refuses gives its tokens back; a stream that ends (or is dropped) frees its slot."""
    metered = unified.client("key-r")
    raw = metered.completions.with_raw_response.create(model="recall", prompt="hello there", max_tokens=5)
    assert raw.headers["x-ratelimit-limit-requests"] == "3" and raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 2000 - (11 + 5)
    assert raw.parse().usage.completion_tokens == 5
    with pytest.raises(openai.RateLimitError, match="request too large") as big:        # can never pass: no retry
        metered.completions.create(model="recall", prompt="x" * 1990, max_tokens=20)
    assert big.value.response.headers["x-should-retry"] == "false" and big.value.body["type"] == "tokens"
    for _ in range(2):         # over the context: 400 from the engine, and the 1510 tokens charged come back
        with pytest.raises(openai.BadRequestError, match="context"):
            metered.completions.create(model="recall", prompt=LONG, max_tokens=10)
    with pytest.raises(openai.RateLimitError, match=r"requests per min \(RPM\): limit 3") as rpm:
        metered.completions.create(model="recall", prompt="hello", max_tokens=1)
    e = rpm.value
    assert e.status_code == 429 and e.body["code"] == "rate_limit_exceeded" and e.body["type"] == "requests"
    assert 1 <= int(e.response.headers["retry-after"]) <= 20 and e.response.headers["x-ratelimit-remaining-requests"] == "0"
    tok = httpx.post(unified.url + "/tokenize", json={"prompt": "hello"}, headers={"Authorization": "Bearer key-r"})
    assert tok.status_code == 429 and tok.json()["error"]["type"] == "requests"     # /tokenize is no way around it
    assert unified.client("key-a").completions.create(model="recall", prompt="hello", max_tokens=1).usage  # acme is not limited
    narrow = unified.client("key-p")
    with narrow.completions.create(model="recall", prompt="tell me more", max_tokens=300, stream=True) as live:
        next(iter(live))                                     # its one request is in flight
        with pytest.raises(openai.RateLimitError, match="parallel requests: 1 in flight, the limit is 1"):
            narrow.completions.create(model="recall", prompt="and another", max_tokens=1)
    deadline = time.time() + 30                              # dropped mid-stream: aborted, and its slot freed
    while True:
        try:
            narrow.completions.create(model="recall", prompt="and another", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.time() < deadline, "the dropped stream's slot was never given back"
            time.sleep(0.2)
    assert unified.metric("kvledger_rate_limited_total", limit="requests") >= 1
    assert unified.metric("kvledger_rate_limited_total", limit="parallel_requests") >= 1
    text = httpx.get(unified.url + "/metrics").text
    assert "metered" not in text and "narrow" not in text               # tenants as pseudonyms only


def test_the_dashboard_on_the_serving_store_shows_requests_served_after_it_opened(unified, monkeypatch):
    """The dashboard's data layer (the same Panels the page renders) on the store the server is
    writing: requests served after the first look appear within the flush interval plus a refresh."""
    from tests.streamlit_app import app_test

    from dashboard.data import Panels
    before = Panels(unified.store).ttft().height
    prompts = [f"live request {i} asks about the weather" for i in range(3)]
    done = [unified.client("key-b").completions.create(model="recall", prompt=p, max_tokens=4) for p in prompts]
    deadline = time.time() + 20                      # flush interval (2 s) + span export (0.5 s) + slack
    while time.time() < deadline and Panels(unified.store).ttft().height < before + len(done):
        time.sleep(0.5)
    assert Panels(unified.store).ttft().height >= before + len(done)
    monkeypatch.setenv("KVLEDGER_STORE", str(unified.store))
    at = app_test(str(ROOT / "dashboard" / "app.py"), 120)
    at.run()
    assert not at.exception and not any("UNVERIFIED" in e.value for e in at.error)


def test_a_disconnect_storm_loses_no_page(unified):
    for _ in range(12):
        with httpx.stream("POST", unified.url + "/v1/completions", headers={"Authorization": "Bearer key-b"},
                          json={"prompt": SECRET_TEXT, "max_tokens": 400, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break                                   # one token seen, then the client goes away
    deadline = time.time() + 60
    while time.time() < deadline and unified.metric("kvledger_queue_depth") > 0:
        time.sleep(0.2)
    assert unified.metric("kvledger_queue_depth") == 0
    assert unified.metric("kvledger_pool_pages", node="unified0", state="used") == 0
    assert unified.metric("kvledger_requests_total", outcome="aborted") >= 12     # by the abort path, named so


def test_a_dropped_non_streamed_request_is_let_go_not_run_to_max_tokens(unified):
    """A client that stops waiting for a non-streamed answer: its request is aborted while its tokens
    are still coming (not only when they pause), so it never runs to its max_tokens."""
    before = unified.metric("kvledger_requests_total", outcome="aborted")
    for _ in range(4):
        try:
            httpx.post(unified.url + "/v1/completions", headers={"Authorization": "Bearer key-b"},
                       json={"prompt": SECRET_TEXT[:200], "max_tokens": 700}, timeout=0.4)
        except httpx.TimeoutException:
            pass                                             # the client gives up and closes its connection
    deadline = time.time() + 60
    while time.time() < deadline and unified.metric("kvledger_queue_depth") > 0:
        time.sleep(0.2)
    assert unified.metric("kvledger_queue_depth") == 0
    assert unified.metric("kvledger_pool_pages", node="unified0", state="used") == 0
    assert unified.metric("kvledger_requests_total", outcome="aborted") - before == 4     # none ran to the end


ONE_SMALL_PREFILL = "context_length = 1024\n[[prefill]]\nnode_id = \"prefill0\"\npool_tokens = 656\n"


def _incident_traffic(server: Server) -> list:
    """Background from two tenants into decode's pages, then over-pool prompts from a third."""
    out = []
    for i in range(6):
        key = "key-a" if i % 2 else "key-b"
        out.append(server.client(key).completions.create(model="recall", prompt=SECRET_TEXT[: 300 + 40 * i] + " so",
                                                         max_tokens=8))
    for _ in range(2):
        try:
            out.append(server.client("key-u").completions.create(model="recall", prompt="Q" * 900, max_tokens=16))
        except openai.BadRequestError as e:
            out.append(e)
    return out


@pytest.mark.parametrize("policy", ["vulnerable", "hardened"])
def test_the_incident_live_and_prevented(tmp_path, policy):
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", policy, config=ONE_SMALL_PREFILL)
    try:
        long = _incident_traffic(s)[-2:]
        if policy == "vulnerable":      # HTTP 200, billed for the whole prompt, computed over others' KV
            assert all(r.usage.prompt_tokens == 900 for r in long)
            assert s.metric("kvledger_foreign_reads_total", outcome="served") > 0
            assert s.metric("kvledger_prompt_tokens_billed_total") > s.metric("kvledger_prompt_tokens_prefilled_total")
        else:
            assert all(isinstance(e, openai.BadRequestError) and e.code == "context_length_exceeded" for e in long)
            assert s.metric("kvledger_foreign_reads_total") == 0
    finally:
        assert s.stop() == 0
    fx = Forensics(s.store)
    ex = fx.exposures()
    assert (ex.height > 0) is (policy == "vulnerable")
    chk = fx.verify_index()                 # live traffic through the server: its exposure index = the join
    assert fx.indexed and chk.ok and (chk.join_rows > 0 or policy == "hardened"), chk


def test_kill_9_then_restart_on_the_same_store_continues_it(tmp_path):
    store = tmp_path / "store"
    first = Server(tmp_path, store=store)
    first.client().completions.create(model="recall", prompt="before the crash, before", max_tokens=4)
    deadline = time.time() + 30                              # durable: a reader sees it while the server runs
    while time.time() < deadline and Forensics(store).requests().height < 1:
        time.sleep(0.3)
    engine_pid = int(re.search(r"engine process (\d+)", (tmp_path / f"server-{first.port}.log").read_text())[1])
    assert engine_pid != first.proc.pid                      # the engine runs in a process of its own
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    deadline = time.time() + 10                              # ... and dies with the server (PR_SET_PDEATHSIG)
    while time.time() < deadline and Path(f"/proc/{engine_pid}").exists() and \
            Path(f"/proc/{engine_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.1)
    assert not Path(f"/proc/{engine_pid}").exists() or \
        Path(f"/proc/{engine_pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    second = Server(tmp_path, store=store)
    second.client("key-b").completions.create(model="recall", prompt="after the restart, after", max_tokens=4)
    assert second.stop() == 0                                # SIGTERM: drain, flush, seal, exit 0
    v = verify(store)
    assert v.ok and v.sealed, v.broken
    runs = Forensics(store).query("runs")
    assert runs.height == 2 and runs["requests"].to_list() == [1, 1]


def test_promtool_passes_the_shipped_alert_rules():
    promtool = shutil.which("promtool")
    assert promtool, "Debian's prometheus package provides promtool (.ci/run installs it)"
    r = subprocess.run([promtool, "test", "rules", "tests/prometheus/alerts_test.yml"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _firing(prom: str) -> list[dict]:
    body = httpx.get(prom + "/api/v1/alerts", timeout=5).json()
    return [a for a in body["data"]["alerts"] if a["state"] == "firing"]


def _alerts(prom: str) -> set[str]:
    return {a["labels"]["alertname"] for a in _firing(prom)}


RULES = ROOT / "telemetry" / "prometheus" / "kvledger-alerts.yml"


def test_every_shipped_alert_is_tested_firing_and_resolving_and_has_a_runbook():
    import re

    import yaml
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = [t for u in yaml.safe_load((ROOT / "tests" / "prometheus" / "alerts_test.yml").read_text())["tests"]
             for t in u["alert_rule_test"]]
    readme = (ROOT / "README.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", readme, re.M)}
    for r in rules:
        name = r["alert"]
        fired = [t["eval_time"] for t in tests if t["alertname"] == name and t["exp_alerts"]]
        quiet = [t["eval_time"] for t in tests if t["alertname"] == name and not t["exp_alerts"]]
        minutes = lambda t: int(t.rstrip("m"))  # noqa: E731
        assert fired, f"{name}: no promtool case fires it"
        assert any(minutes(q) > minutes(f) for q in quiet for f in fired), f"{name}: no case shows it resolving"
        assert r["labels"]["severity"] in ("critical", "warning") and r["annotations"]["summary"]
        url = r["annotations"]["runbook_url"]
        assert url.startswith("README.md#") and url.split("#")[1] in anchors, f"{name}: {url} is not a README heading"
        # a counter is only ever read through a window: a bare one would fire until the server restarts
        bare = re.sub(r"(increase|rate)\([^\]]*\]\)", "", r["expr"])
        assert "_total" not in bare, f"{name}: reads a counter without increase()/rate()"


@pytest.mark.parametrize("policy", ["vulnerable", "hardened"])
def test_a_real_prometheus_scraping_the_server_fires_the_alert_only_when_exposed(tmp_path, policy):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is needed (.ci/run installs it)"
    s = Server(tmp_path, "--mode", "disaggregated", "--policy", policy, config=ONE_SMALL_PREFILL)
    pport = _port()
    cfg = tmp_path / "prometheus.yml"
    # the shipped rules, their windows and `for:` shortened to seconds so one test sees them fire and resolve
    import re
    rules = tmp_path / "kvledger-alerts.yml"
    rules.write_text(re.sub(r"for: \d+m", "for: 1s", re.sub(r"\[\d+m\]", "[15s]", RULES.read_text())))
    cfg.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                               "rule_files": [str(rules)],
                               "scrape_configs": [{"job_name": "kvledger",
                                                   "static_configs": [{"targets": [f"127.0.0.1:{s.port}"]}]}]}))
    prom = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{pport}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{pport}"
    try:
        up = time.time() + 60            # a counter is seen increasing only by a Prometheus already scraping it
        while time.time() < up:
            try:
                if httpx.get(url + "/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        _incident_traffic(s)
        deadline, firing, scraped = time.time() + 90, set(), False
        while time.time() < deadline:
            try:
                q = httpx.get(url + "/api/v1/query", params={"query": "kvledger_requests_total"}, timeout=5).json()
                scraped = scraped or bool(q["data"]["result"])
                firing = _alerts(url)
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if "KvledgerForeignKVRead" in firing or (policy == "hardened" and scraped and time.time() > deadline - 80):
                break
            time.sleep(1)
        assert scraped, "Prometheus scraped the server's /metrics"
        if policy == "vulnerable":
            assert {"KvledgerForeignKVRead", "KvledgerPoolSmallerThanContext", "KvledgerReadCheckOff"} <= firing, firing
            read = next(a for a in _firing(url) if a["labels"]["alertname"] == "KvledgerForeignKVRead")
            assert read["labels"]["job"] == "kvledger" and read["labels"]["instance"] == f"127.0.0.1:{s.port}"
            assert read["annotations"]["runbook_url"] == "README.md#kvledgerforeignkvread"
            # the traffic stopped: once the window has passed, the exposure alert resolves by itself
            # (the server's configuration has not changed: the pool and read-check alerts stay)
            gone = time.time() + 60
            while time.time() < gone and "KvledgerForeignKVRead" in _alerts(url):
                time.sleep(1)
            still = _alerts(url)
            assert "KvledgerForeignKVRead" not in still and "KvledgerPoolSmallerThanContext" in still, still
        else:
            time.sleep(3)                                    # a few more evaluations on the scraped series
            firing = _alerts(url)
            assert not firing & {"KvledgerForeignKVRead", "KvledgerUsageDishonest", "KvledgerPoolSmallerThanContext",
                                 "KvledgerReadCheckOff", "KvledgerStoreWriterFailing", "KvledgerTargetDown"}
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        assert s.stop() == 0


def test_chat_uses_the_models_template_when_it_has_one_and_the_plain_one_otherwise(tmp_path):
    from engine.server import protocol as P
    from engine.server.app import PLAIN_TEMPLATE, State, _chat_template, render_chat
    msgs = [P.ChatMessage(role="system", content="be brief"), P.ChatMessage(role="user", content="hi")]
    plain = State(None, None, "m", None, None, {}, 1024)
    assert render_chat(plain, msgs) == PLAIN_TEMPLATE.format(role="system", content="be brief") + \
        PLAIN_TEMPLATE.format(role="user", content="hi") + "assistant:"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")}))
    templated = State(None, None, "m", None, None, {}, 1024, chat_template=_chat_template(str(tmp_path)))
    assert render_chat(templated, msgs) == "<|system|>be brief<|user|>hi<|assistant|>"
    assert _chat_template("recall") is None


def test_an_engine_failure_of_one_request_is_a_500_for_that_request_only(tmp_path):
    """In process (FastAPI's TestClient, the engine loop on its thread): the read check failing one
    request mid-decode - stood in for here by failing it the way the engine does - answers that
    request 500 in the OpenAI error shape; the request beside it is served."""
    from fastapi.testclient import TestClient

    from engine.config import EngineConfig
    from engine.errors import ReadCheckViolation
    from engine.llm import LLMEngine
    from engine.models import load_model
    from engine.server.app import State, create_app
    from engine.server.backend import ApiKeys
    from engine.server.loop import EngineLoop
    from engine.server.metrics import ServerMetrics
    model, tok = load_model("recall")
    eng = LLMEngine(model, tok, EngineConfig(kv_memory_budget=8 << 20, context_length=512))
    real_step = eng.step

    def step():
        out = real_step()
        for req in list(eng.scheduler.running):
            if b"POISON" in bytes(req.prompt_ids) and len(req.output_ids) >= 2 and not req.is_finished:
                eng._finish(req, error=ReadCheckViolation(req.incarnation, req.block_table[:1], 1))
        return out
    eng.step = step
    metrics = ServerMetrics(lambda t: t, "hardened", {"read_check": True})
    loop = EngineLoop(eng, on_finish=lambda r: metrics.finished(r, "ok" if r.error is None else "error"))
    state = State(loop, tok, "recall", ApiKeys(None), metrics, {}, 512)
    with TestClient(create_app(state)) as client:
        bad = client.post("/v1/completions", json={"prompt": "POISON pill, pill", "max_tokens": 8})
        good = client.post("/v1/completions", json={"prompt": "a healthy one, healthy", "max_tokens": 8})
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "read_check_violation"
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    assert eng.allocator.num_free == eng.allocator.total


def test_a_port_already_in_use_is_a_clear_error_before_anything_starts(tmp_path):
    """The port is tried before the store or the engine process exists: one error line, exit 2,
    nothing created. (Lost in a race after that check, uvicorn's bind failure still exits 1 with the
    store sealed: the path is the same as before the check.)"""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = subprocess.run([sys.executable, "-m", "engine.commands", "serve", "--store", str(tmp_path / "s"),
                            "--port", str(busy.getsockname()[1])], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("kvledger: error: --port ") and "cannot listen" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists(), r.stderr


def test_two_signals_under_load_end_in_one_clean_exit_with_a_sealed_store(tmp_path):
    """A second SIGTERM 50 ms after the first forces uvicorn out without its lifespan shutdown; the
    engine process is still stopped, so the server exits 0 and its store verifies and is sealed (it
    used to close its port and never exit, the store unsealed)."""
    s = Server(tmp_path, "--mode", "unified")
    clients = []

    def load() -> None:
        try:
            httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer key-b"},
                       json={"prompt": SECRET_TEXT[:200], "max_tokens": 700}, timeout=60)
        except httpx.HTTPError as e:
            clients.append(type(e).__name__)
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    assert s.stop() == 0                                   # (already exiting: it waits and closes the log)
    for t in threads:
        t.join(60)
    v = verify(s.store)
    assert v.ok and v.sealed, v


def test_sigterm_drains_within_its_timeout_and_answers_what_it_cuts_and_the_metrics_key_holds(tmp_path):
    """--drain-timeout 2 under load: the engine's drain clock starts with the signal (not after
    uvicorn's own wait), so the server is gone in about the timeout; requests still running at the
    deadline get 503 `server_shutting_down` as JSON, streams an error event then [DONE] - never
    uvicorn's text/plain 500 or a stream cut mid-body."""
    key = "operator-" + "k" * 20           # (the same server also shows --metrics-key guarding /metrics)
    # a context long enough that no request can finish inside the drain, however fast the engine
    s = Server(tmp_path, "--mode", "unified", "--drain-timeout", "2", "--metrics-key", key,
               config="context_length = 4200\n[unified]\npool_tokens = 20000\n")
    for path in ("/metrics", "/server_info"):
        assert httpx.get(s.url + path).status_code == 401
        assert httpx.get(s.url + path, headers={"Authorization": "Bearer key-a"}).status_code == 401   # a tenant's key
        r = httpx.get(s.url + path, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.text
    assert httpx.get(s.url + "/health").status_code == 200                         # liveness stays open
    out = []

    def load(stream: bool) -> None:
        body = {"prompt": SECRET_TEXT[:100], "max_tokens": 4000, "stream": stream}
        if stream:
            with httpx.stream("POST", s.url + "/v1/completions", headers={"Authorization": "Bearer key-b"},
                              json=body, timeout=60) as r:
                out.append(("stream", r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data:")][-2:]))
        else:
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer key-b"}, json=body, timeout=60)
            out.append(("whole", r.status_code, r.headers.get("content-type"), r.json()))
    threads = [threading.Thread(target=load, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    assert s.stop() == 0
    took = time.monotonic() - t0
    for t in threads:
        t.join(60)
    assert len(out) == 4, out
    for o in out:
        if o[0] == "whole":
            assert o[1:3] == (503, "application/json") and o[3]["error"]["code"] == "server_shutting_down", o
        else:
            assert o[1] == 200 and '"server_shutting_down"' in o[2][0] and o[2][1] == "data: [DONE]", o
    assert took < 2 + 20, took                   # a liveness bound (it was the timeout twice over, plus)
    assert verify(s.store).sealed


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_incremental_detokenizing_adds_up_to_one_decode_of_the_whole_output(tiny_llama, data):
    """The SSE path decodes only the new ids and a window before them (not the whole output per
    token): the deltas, in any step sizes, add up to one decode of everything, and hold back a
    partial UTF-8 character until it is whole (byte tokenizer, multi-byte text)."""
    from engine.models.tokenizer import ByteTokenizer, HFTokenizer
    from engine.server.app import Decoder
    bpe = HFTokenizer.from_dir(tiny_llama)
    tok, ids = data.draw(st.one_of(
        st.tuples(st.just(bpe), st.lists(st.integers(3, 511), min_size=1, max_size=60)),
        st.tuples(st.just(ByteTokenizer()),
                  st.text(alphabet="aé€😀 ,.", min_size=1, max_size=30).map(lambda t: list(t.encode()))),
    ))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=len(ids)))) | {len(ids)})
    dec, deltas, last = Decoder(tok), [], 0
    for i, cut in enumerate(cuts):
        deltas.append(dec.add(ids[last:cut], final=i == len(cuts) - 1))
        last = cut
    assert "".join(deltas) == tok.decode(ids) == dec.text
    if "\ufffd" not in tok.decode(ids):
        assert not any("\ufffd" in d for d in deltas)
