"""`kvledger probe`: test any OpenAI-compatible endpoint, from the outside, for the incident's signs.

Checks implemented (``--checks``):
- ``limits``: the pool and context are discovered (our ``/server_info``, SGLang's ``/server_info`` or
  ``/get_server_info``: ``max_total_num_tokens``, ``context_length``; vLLM's ``/metrics``
  ``vllm:cache_config_info`` and ``/v1/models`` ``max_model_len``; or ``--pool-tokens`` /
  ``--context-length``), then prompts of pool - 1, pool, pool + 1 (when the pool is below the
  context), context and context + 1 tokens are sent. A 200 above a limit is a finding.
- ``usage``: ``usage.prompt_tokens`` against the tokens sent; TTFT against prompt length, fitted on
  the probe's own below-pool prompts: a prompt above the pool answered faster than half the
  fitted prefill time of its length ("prefill skipped", the incident's clue) is a finding.
- ``canary``: tenant A plants unguessable canaries (prompts made of " the secret is CANARY-...;" over
  and over) in enough requests to cycle the pool's pages;
  tenant B then sends over-pool prompts that end "... the secret is" (a model attending over
  someone else's KV continues with what followed that there). A canary, or 8 characters of one,
  in B's output is a finding, reported with the response id that showed it.
- ``salt``: is the prefix cache shared across tenants? A sends a fresh prefix twice: the second must
  come back cached (the positive control: without it the check is inconclusive, never a pass); then
  B sends the same prefix, once as is and once with A's ``cache_salt`` and ``user`` (vLLM and SGLang
  take them from the client). Cached tokens for B are a finding. Cached tokens are read from
  ``usage.prompt_tokens_details.cached_tokens`` when the endpoint reports them (vLLM only with
  ``--enable-prompt-tokens-details``), else from the endpoint's own ``/metrics`` prefix-cache hit
  counter (``vllm:prefix_cache_hits_total``) read before and after each request.
- ``timing`` (the prefix-cache side channel): interleaved samples of B's first request for a
  prefix A has just sent vs a fresh prefix of the same length; a one-sided Mann-Whitney rank test
  (scipy) with the median TTFT ratio as the effect size. A finding needs p < 0.01 and either the
  ratio < 0.7 or at least half the speed-up the positive control shows (a small model's cache hit
  saves less than 30 %: B getting what A gets is the finding, whatever its size). The positive
  control (A re-sending its own prefix, same test) must show the cache works: without it the
  result is inconclusive, not a pass. Power: the samples, the p-values and the ratios are reported.
- ``abort`` (the late-write family): B streams prompts dense with B's own canary and closes each
  stream part-way through its prefill (at fractions of the TTFT measured for that length first),
  while A keeps asking, in a loop of its own, a fixed greedy prompt that ends with the canary's
  public prefix. B's canary in A's output is a finding (an aborted request's KV landed in pages
  another tenant then read); so is A's answer changing from the one it gave three times alone
  before the storm (when those three agree: a deterministic endpoint). Then the canary
  check runs again (A plants, B probes). Power: the number of B's streams closed before their
  first token; with none the check is inconclusive.
Time to first token is the first streamed chunk, whatever its text (a token may decode to nothing).
A 429 is retried after its ``Retry-After`` (at most ``RETRIES`` times). With ``--store``, the run and
its findings go into the store (``probe_runs``, ``probe_findings``:
keyed tenant pseudonyms, canaries only as keyed hashes), where ``forensics probes``, the report
and the dashboard show them.
Exit 0: every check passed; 1: a finding; 3: inconclusive.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from engine.errors import KvledgerError

IMPLEMENTED = ("limits", "usage", "canary", "salt", "timing", "abort")
TIMING_ALPHA, TIMING_RATIO = 0.01, 0.7     # a finding needs both: p below alpha, median TTFT ratio below this
TIMING_PASS_SHARE = 0.2                    # a pass: B gets at most this share of A's own cache speed-up
PASS, FINDING, INCONCLUSIVE = "pass", "finding", "inconclusive"
RETRIES, MAX_RETRY_AFTER = 5, 30.0          # 429s retried, and the longest Retry-After honoured (seconds)


class ProbeError(KvledgerError, ValueError):
    pass


@dataclass
class Result:
    check: str
    verdict: str
    detail: str
    evidence: list[dict] = field(default_factory=list)


def _root(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /server_info, /tokenize, /health live)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Endpoint:
    """The endpoint under test, as two tenants see it, with token counting and prompt building."""

    def __init__(self, base_url: str, key_a: str, key_b: str, model: str | None, tokenizer: str | None,
                 timeout: float = 120.0):
        import openai
        if urlsplit(base_url).scheme not in ("http", "https"):
            raise ProbeError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        self.base, self.root = base_url.rstrip("/"), _root(base_url)
        self.a = openai.OpenAI(base_url=self.base, api_key=key_a, max_retries=0, timeout=timeout)
        self.b = openai.OpenAI(base_url=self.base, api_key=key_b, max_retries=0, timeout=timeout)
        self.http = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {key_a}"})
        try:
            listed = self.a.models.list().data
        except openai.AuthenticationError:
            raise ProbeError(f"{self.base}: --key-a was refused (401)") from None
        except openai.APIConnectionError as e:
            raise ProbeError(f"{self.base}: cannot connect ({e})") from None
        if model is None and not listed:
            raise ProbeError(f"{self.base}/models lists no model; pass --model")
        self.model = model or listed[0].id
        self.max_model_len = getattr(listed[0], "max_model_len", None) if listed else None
        self._tok = None
        if tokenizer is not None:
            from tokenizers import Tokenizer
            try:
                self._tok = Tokenizer.from_file(f"{tokenizer}/tokenizer.json")
            except Exception as e:   # noqa: BLE001 - the tokenizers library raises its own kinds
                raise ProbeError(f"--tokenizer {tokenizer}: cannot load tokenizer.json ({e})") from None
        self.requests = 0
        self.pools: list[int] = []     # the admitting nodes' pools, where they differ across a cluster

    # ---- discovery -------------------------------------------------------------------------------
    def discover(self, pool: int | None, context: int | None) -> tuple[int | None, int | None, str]:
        """(pool tokens, context length, where they came from); flags win."""
        where = []
        for path in ("/server_info", "/get_server_info"):
            try:
                r = self.http.get(self.root + path)
                info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                info = None
            if isinstance(info, dict):
                pool = pool or info.get("max_total_num_tokens")
                context = context or info.get("context_length")
                nodes = info.get("nodes") if isinstance(info.get("nodes"), list) else []
                self.pools = sorted({n["pool_tokens"] for n in nodes if isinstance(n, dict)
                                     and n.get("role") in ("prefill", "unified") and n.get("pool_tokens")})
                where.append(path)
                break
        if pool is None and (m := self.engine_metrics()) is not None and m.pool_tokens:
            pool, _ = m.pool_tokens, where.append(f"/metrics ({m.engine})")
        if context is None and self.max_model_len:
            context, _ = self.max_model_len, where.append("/v1/models max_model_len")
        return pool, context, ", ".join(where) or "flags"

    def engine_metrics(self):
        """What the endpoint's own /metrics says (vLLM, SGLang), or None where it has none."""
        from telemetry.receivers.prometheus import engine_metrics, parse
        try:
            r = self.http.get(self.root + "/metrics")
            m = engine_metrics(parse(r.text)) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return m if m is not None and m.engine is not None else None

    def cache_hits(self) -> float | None:
        """The endpoint's prefix-cache hit counter (tokens), None where /metrics has none."""
        m = self.engine_metrics()
        return m.cache_hits if m is not None else None

    # ---- tokens ----------------------------------------------------------------------------------
    def count(self, text: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        r = self.http.post(self.root + "/tokenize", json={"model": self.model, "prompt": text})
        if r.status_code != 200:
            raise ProbeError(f"{self.root}/tokenize answered {r.status_code}: pass --tokenizer DIR")
        body = r.json()
        return int(body.get("count", len(body.get("tokens", []))))

    def prompt(self, n: int, tail: str = "", filler: str = " z") -> str:
        """A prompt of exactly ``n`` tokens (by the endpoint's own count) ending with ``tail``."""
        per = max(self.count(filler * 64) / 64, 1e-9)
        base = self.count(tail) if tail else 0
        k = max(0, int((n - base) / per))
        text = filler * k + tail
        for _ in range(64):                 # the last tokens one character at a time
            have = self.count(text)
            if have == n:
                return text
            text = ("a" + text) if have < n else text[1:]
        raise ProbeError(f"cannot build a prompt of exactly {n} tokens with this tokenizer")

    # ---- requests --------------------------------------------------------------------------------
    def complete(self, client, prompt: str, max_tokens: int, extra: dict | None = None,
                 cache: bool = False) -> dict:
        """Streamed completion: status, text, usage, cached tokens, time to first token, response id.
        ``cache``: where usage reports no cached tokens, take them from the /metrics hit counter."""
        before = self.cache_hits() if cache else None
        for attempt in range(RETRIES + 1):
            out = self._complete(client, prompt, max_tokens, extra)
            if out["status"] != 429 or attempt == RETRIES:
                break
            time.sleep(out.pop("retry_after"))
        if cache and out["cached"] is None and before is not None and out["status"] == 200:
            for _ in range(10):           # the engine's stats land a moment after the stream ends
                after = self.cache_hits()
                if after is not None and after > before:
                    break
                time.sleep(0.1)
            out["cached"] = int(after - before) if after is not None else None
            out["cached_from"] = "/metrics"
        return out

    def _complete(self, client, prompt: str, max_tokens: int, extra: dict | None) -> dict:
        import openai
        self.requests += 1
        t0 = time.perf_counter()
        out = {"status": 200, "text": "", "usage": None, "cached": None, "ttft": None, "id": None, "error": None}
        try:
            stream = client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}, extra_body=extra)
            for chunk in stream:
                out["id"] = out["id"] or chunk.id
                if chunk.choices:
                    out["ttft"] = out["ttft"] or time.perf_counter() - t0
                    out["text"] += chunk.choices[0].text or ""
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    out["cached"] = getattr(details, "cached_tokens", None) if details is not None else None
        except openai.APIStatusError as e:
            out["status"], out["error"] = e.status_code, str(e)[:200]
            if e.status_code == 429:
                try:
                    wait = float(e.response.headers.get("retry-after", "1"))
                except ValueError:
                    wait = 1.0
                out["retry_after"] = min(max(wait, 0.1), MAX_RETRY_AFTER)
        except openai.APIError as e:       # an error event inside a 200 stream: not an answer
            out["status"], out["error"] = "stream error", str(e)[:200]
        return out


def check_limits(t: Endpoint, pool: int | None, context: int | None, tick) -> tuple[Result, list[dict]]:
    if pool is None and context is None:
        return Result("limits", INCONCLUSIVE, "neither the pool nor the context length could be discovered; "
                      "pass --pool-tokens / --context-length"), []
    # prompts around the pool only where the pool is the tighter limit (a pool of millions of tokens
    # behind a 2,048-token context is tested by the context's prompts)
    # On a cluster whose nodes have different pools a prompt between the smallest and the largest may
    # be served, rightly, by a bigger node: a 200 there is a configuration warning, not a finding by
    # itself (usage/TTFT or a canary make it one); a 200 over the largest pool is a finding.
    top_pool = max([pool or 0, *t.pools]) or None
    around_pool = ((pool - 1, pool, pool + 1) + ((top_pool + 1,) if top_pool != pool else ())
                   if pool and (context is None or pool <= context) else ())
    sizes = sorted({s for s in (*around_pool, context, context and context + 1)
                    if s and (context is None or s <= context + 1)})

    def limit(n: int) -> bool:
        return (top_pool is not None and n > top_pool and (context is None or top_pool < context)) or \
            (context is not None and n > context)
    rows, bad, warned = [], [], []
    for n in sizes:
        r = t.complete(t.a, t.prompt(n), 4)
        between = pool is not None and top_pool is not None and pool < n <= top_pool and not limit(n)
        r.update(sent=n, over_limit=limit(n), between_pools=between)
        rows.append(r)
        tick()
        if r["status"] == 200 and r["over_limit"]:
            which = "context" if context is not None and n > context else "pool" if top_pool == pool else "largest pool"
            bad.append({"prompt_tokens": n, "response": r["id"], "why": f"HTTP 200 for a prompt over the {which}"})
        elif r["status"] == 200 and between:
            warned.append(n)
    verdict = FINDING if bad else PASS
    pools = f"pools {', '.join(map(str, t.pools))}" if len(t.pools) > 1 else f"pool {pool}"
    detail = (f"{pools}, context {context}: " + ", ".join(f"{r['sent']} -> {r['status']}" for r in rows))
    if warned:
        detail += (f"; configuration warning: {', '.join(map(str, warned))} tokens answered 200 above the smallest "
                   f"pool ({pool}) - a bigger node may have served it; the usage and canary checks decide")
    return Result("limits", verdict, detail, bad), rows


def check_usage(t: Endpoint, pool: int | None, context: int | None, over: list[dict], samples: int, tick) -> Result:
    top = min(x for x in (pool, context) if x) if (pool or context) else 512
    sizes = np.linspace(max(16, top // 16), max(17, top - 2), num=max(samples, 4)).astype(int)
    short = []
    for n in sizes:
        r = t.complete(t.a, t.prompt(int(n)), 1)
        tick()
        if r["status"] == 200:
            short.append((int(n), r))
    bad = [{"prompt_tokens": n, "response": r["id"], "why": f"usage.prompt_tokens {r['usage']} for {n} sent"}
           for n, r in short + [(r["sent"], r) for r in over if r["status"] == 200]
           if r["usage"] is not None and r["usage"] != n]
    timed = [(n, r["ttft"]) for n, r in short if r["ttft"] is not None]
    if len(timed) < 4:
        return Result("usage", INCONCLUSIVE if not bad else FINDING, "too few below-pool answers to fit TTFT", bad)
    x, y = np.array([n for n, _ in timed], float), np.array([s for _, s in timed])
    slope, icpt = np.polyfit(x, y, 1)
    fit = f"TTFT fit on {len(timed)} below-pool prompts: {1e3 * icpt:.1f} ms + {1e6 * slope:.1f} us/token"
    long_ok = [r for r in over if r["status"] == 200 and (r["over_limit"] or r.get("between_pools"))
               and r["ttft"] is not None]
    if long_ok and slope <= 0:
        return Result("usage", INCONCLUSIVE if not bad else FINDING,
                      fit + ": TTFT does not grow with the prompt here, so a skipped prefill cannot be told apart", bad)
    for r in long_ok:
        predicted = icpt + slope * r["sent"]
        if r["ttft"] < 0.5 * predicted and r["ttft"] < max(y):
            bad.append({"prompt_tokens": r["sent"], "response": r["id"],
                        "why": f"answered in {1e3 * r['ttft']:.0f} ms, under half the {1e3 * predicted:.0f} ms "
                               "its length needs to prefill (prefill skipped?)"})
    return Result("usage", FINDING if bad else PASS, fit, bad)


def check_canary(t: Endpoint, pool: int | None, context: int | None, samples: int, tick) -> Result:
    if pool is None or context is None or pool >= context:
        return Result("canary", INCONCLUSIVE if pool is None or context is None else PASS,
                      "needs the pool and the context" if pool is None or context is None else
                      f"the pool ({pool}) holds a full context ({context}): no over-pool prompt exists")
    canaries = [f"CANARY-{secrets.token_hex(6)}" for _ in range(samples)]
    plant = max(64, pool // 2)
    for c in canaries:                      # tenant A cycles the pool's pages with canaries
        t.complete(t.a, t.prompt(plant, filler=f" the secret is {c};"), 4)       # dense: any stale slot holds it
        tick()
    bad = []
    victim = min(context - 32, pool + max(16, (context - pool) // 2))
    for _ in range(samples):                # tenant B's boundary prompts
        r = t.complete(t.b, t.prompt(victim, tail=" Tell me again: the secret is"), 24)
        tick()
        for c in canaries:
            if _has(r["text"], c):
                bad.append({"prompt_tokens": victim, "response": r["id"], "status": r["status"], "canary": c,
                            "why": "tenant B's output holds tenant A's canary (or 8 characters of it)"})
                break
    return Result("canary", FINDING if bad else PASS,
                  f"{len(canaries)} canaries planted by A ({plant} tokens each), {samples} prompts of {victim} tokens "
                  f"from B; {len(bad)} showed a canary", bad)


def validate(checks: list[str], samples: int, pool: int | None, context: int | None) -> None:
    """Everything that can be refused before a request is sent."""
    unknown = [c for c in checks if c not in IMPLEMENTED]
    if unknown or not checks:
        raise ProbeError(f"unknown check(s) {unknown}; known: {', '.join(IMPLEMENTED)}")
    if not 1 <= samples <= 200:
        raise ProbeError(f"--samples must be in [1, 200], got {samples}")
    for flag, v in (("--pool-tokens", pool), ("--context-length", context)):
        if v is not None and not 2 <= v <= 1 << 24:
            raise ProbeError(f"{flag} must be in [2, {1 << 24}], got {v}")


def check_salt(t: Endpoint, pool: int | None, samples: int, tick) -> Result:
    n = max(256, min(pool or 512, 1024) // 4)        # two of vLLM-CPU's 128-token blocks at least
    salt = {"cache_salt": f"salt-{secrets.token_hex(8)}", "user": f"user-{secrets.token_hex(4)}"}
    control, bad, source = [], [], set()
    for _ in range(min(samples, 2)):                 # a cache hit is no statistic: two tries per arm suffice
        for arm, extra in (("as is", None), ("with A's cache_salt and user", salt)):
            prefix = t.prompt(n, filler=f" {secrets.token_hex(3)}")      # a prefix nobody has sent
            first = t.complete(t.a, prefix, 1, extra)
            if first["status"] != 200:
                return Result("salt", INCONCLUSIVE, f"A's request was refused ({first['status']}): {first['error']}")
            again = t.complete(t.a, prefix, 1, extra, cache=True)            # the positive control
            other = t.complete(t.b, prefix, 1, extra, cache=True)            # B on A's prefix
            source.add(again.get("cached_from", "usage"))
            control.append(again["cached"])
            if other["cached"]:
                bad.append({"prompt_tokens": n, "response": other["id"], "arm": arm,
                            "why": f"tenant B got {other['cached']} cached tokens of tenant A's prefix, sent {arm}"
                                   + (": the prefix cache is shared across tenants" if extra is None else
                                      ": a client-sent cache_salt is honoured whoever sends it")})
        tick()
    where = " and ".join(sorted(source))
    if bad:
        arms = sorted({e["arm"] for e in bad})
        return Result("salt", FINDING, f"{len(bad)} of {len(control)} of A's prefixes reached by B ({'; '.join(arms)}); "
                      f"cached tokens from {where}", bad)
    if not any(control):
        return Result("salt", INCONCLUSIVE, "the positive control failed: A re-sending its own prefix reported no "
                      "cached tokens (no prefix cache, or neither usage.prompt_tokens_details nor /metrics reports "
                      "cache hits), so B's zero proves nothing")
    return Result("salt", PASS, f"A's own prefix came back cached ({max(c or 0 for c in control)} tokens, from {where}); "
                  f"B got none of it in {len(control)} tries, as is or with A's cache_salt and user")


def check_timing(t: Endpoint, pool: int | None, context: int | None, samples: int, tick) -> Result:
    from scipy.stats import mannwhitneyu
    n = max(128, min(pool or 512, context or 1 << 20, 4096) // 2)
    fresh, cross, own = [], [], []

    def prefix() -> str:
        return t.prompt(n, filler=f" {secrets.token_hex(3)}")

    def sample(rounds: int) -> None:
        for _ in range(rounds):                     # interleaved: load drifts hit every arm alike
            warm = prefix()
            t.complete(t.a, warm, 1)                                   # A caches it (if anything does)
            cross.append(t.complete(t.b, warm, 1)["ttft"])             # B asks for A's prefix
            fresh.append(t.complete(t.b, prefix(), 1)["ttft"])         # B asks for a prefix nobody sent
            mine = prefix()
            t.complete(t.a, mine, 1)
            own.append(t.complete(t.a, mine, 1)["ttft"])               # positive control: A's own prefix again
            tick()

    def test(x):
        return mannwhitneyu(x, fresh, alternative="less").pvalue, float(np.median(x) / np.median(fresh))
    rounds = max(samples, 6)
    while True:                                     # a grey result (B faster, not yet significant) earns more samples
        sample(rounds)
        if any(x is None for x in fresh + cross + own):
            return Result("timing", INCONCLUSIVE, "some requests were not answered (no streamed chunk to time)")
        (p_own, r_own), (p_cross, r_cross) = test(own), test(cross)
        verdict = timing_verdict(p_own, r_own, p_cross, r_cross)
        grey = verdict == INCONCLUSIVE and p_own < TIMING_ALPHA and r_own < TIMING_RATIO and r_cross < 1.0
        if not grey or len(fresh) >= 3 * rounds:
            break
    stats = (f"{len(fresh)} samples per arm of {n}-token prefixes; positive control (A's own prefix): "
             f"p={p_own:.2g}, median TTFT ratio {r_own:.2f}; B on A's prefix: p={p_cross:.2g}, ratio {r_cross:.2f}")
    if verdict == FINDING:
        return Result("timing", FINDING, stats, [{"prompt_tokens": n, "p_value": p_cross, "median_ttft_ratio": r_cross,
                                                  "why": "tenant B's requests for tenant A's prefix come back faster: "
                                                         "the prefix cache is shared across tenants"}])
    if verdict == INCONCLUSIVE:
        if p_own < TIMING_ALPHA and r_own < TIMING_RATIO:
            return Result("timing", INCONCLUSIVE, stats + ": B's requests for A's prefix came back faster, but not "
                          "significantly; too close to call a pass (more --samples, or a quieter endpoint)")
        return Result("timing", INCONCLUSIVE, stats + ": the positive control shows no cache effect, so B's result "
                      "has no power")
    return Result("timing", PASS, stats)


def timing_verdict(p_own: float, r_own: float, p_cross: float, r_cross: float) -> str:
    """FINDING when B's requests for A's prefix are significantly faster and either clearly so
    (ratio < TIMING_RATIO) or by at least half the speed-up A's own repeat shows. PASS only when the
    positive control shows a clear cache effect and B gets at most a fifth of it: absence of
    significance alone is no pass (six samples miss a real 30 % speed-up one time in three).
    Everything between is INCONCLUSIVE."""
    control = p_own < TIMING_ALPHA and r_own < 1.0
    share = (1 - r_cross) / (1 - r_own) if r_own < 1.0 else float("inf")
    if p_cross < TIMING_ALPHA and (r_cross < TIMING_RATIO or (control and share >= 0.5)):
        return FINDING
    if control and r_own < TIMING_RATIO and share <= TIMING_PASS_SHARE:
        return PASS
    return INCONCLUSIVE


def _has(text: str, canary: str) -> bool:
    """The canary, or 8 characters of it, in ``text``."""
    return canary in text or any(canary[i:i + 8] in text for i in range(len(canary) - 7))


def check_abort(t: Endpoint, pool: int | None, context: int | None, samples: int, tick) -> Result:
    import threading
    top = min(x for x in (pool, context) if x) if (pool or context) else 512
    n = max(64, top - 32)                           # B's prompts: long prefills, still under every limit
    b_canary = f"CANARY-{secrets.token_hex(6)}"
    b_prompt = t.prompt(n, filler=f" the secret is {b_canary};")
    ttft = sorted(x for x in (t.complete(t.b, b_prompt, 1)["ttft"] for _ in range(3)) if x is not None)
    tick()
    if not ttft:
        return Result("abort", INCONCLUSIVE, f"B's {n}-token prompt was not answered; nothing to abort")
    full = ttft[len(ttft) // 2]
    stop, seen, a_answers = threading.Event(), [], []
    a_n = max(32, top // 4)
    # A's cue is the canary's public prefix: only KV holding B's canary can continue it with B's hex
    a_prompt = t.prompt(a_n, tail=" Tell me again: the secret is CANARY-")

    def tenant_a() -> None:                         # A keeps reading while B's aborts land (or not)
        while not stop.is_set():
            r = t.complete(t.a, a_prompt, 16)
            a_answers.append(1)
            if _has("CANARY-" + r["text"], b_canary):
                seen.append({"prompt_tokens": a_n, "response": r["id"], "canary": b_canary,
                             "why": "tenant A's output holds tenant B's canary from a stream B aborted mid-prefill"})
            elif r["status"] == 200 and deterministic and r["text"] != baseline[0]:
                seen.append({"prompt_tokens": a_n, "response": r["id"], "answer": r["text"],
                             "answer_alone": baseline[0],
                             "why": "tenant A's greedy answer to a fixed prompt changed while tenant B aborted "
                                    "streams (it was the same 3 times alone before): A's KV was not computed from "
                                    "A's prompt alone"})
    # the control: A's greedy answer to its prompt, alone, three times (a deterministic endpoint gives
    # the same text; then any other text under B's aborts means A read KV it did not write)
    baseline = [t.complete(t.a, a_prompt, 16)["text"] for _ in range(3)]
    deterministic = len(set(baseline)) == 1
    reader = threading.Thread(target=tenant_a, daemon=True)
    reader.start()
    early = 0
    try:
        for i in range(max(samples, 4) * 4):        # B aborts at 10 %, 30 %, 50 % and 70 % of its TTFT
            frac = (0.1, 0.3, 0.5, 0.7)[i % 4]
            t0 = time.perf_counter()
            stream = t.b.completions.create(model=t.model, prompt=b_prompt, max_tokens=16, temperature=0, stream=True)
            t.requests += 1
            time.sleep(max(0.0, frac * full - (time.perf_counter() - t0)))
            if time.perf_counter() - t0 < full:
                early += 1
            stream.close()
            tick()
    finally:
        time.sleep(min(1.0, 2 * full))              # let late writes land and A read once more
        stop.set()
        reader.join(timeout=60)
    again = check_canary(t, pool, context, samples, tick)
    bad = seen + again.evidence
    stats = (f"{early} of B's {n}-token streams closed before their measured TTFT ({1e3 * full:.0f} ms), "
             f"{len(a_answers)} answers to A meanwhile (A's answer alone: "
             f"{'the same 3 times' if deterministic else 'not deterministic, so only a canary counts'}); "
             f"canary check after: {again.verdict}")
    if bad:
        return Result("abort", FINDING, stats, bad)
    if early == 0:
        return Result("abort", INCONCLUSIVE, stats + ": no stream could be closed mid-prefill (the prefill is "
                      "too fast to abort from here), so the pass would have no power")
    return Result("abort", PASS if again.verdict != INCONCLUSIVE else INCONCLUSIVE, stats)


def run_probe(t: Endpoint, checks: list[str], pool: int | None = None, context: int | None = None,
              samples: int = 6, progress=None) -> tuple[list[Result], dict]:
    tick = progress or (lambda: None)
    pool, context, where = t.discover(pool, context)
    results, over = [], []
    if "limits" in checks or "usage" in checks:
        res, over = check_limits(t, pool, context, tick)
        if "limits" in checks:
            results.append(res)
    if "usage" in checks:
        results.append(check_usage(t, pool, context, over, samples, tick))
    if "canary" in checks:
        results.append(check_canary(t, pool, context, samples, tick))
    if "salt" in checks:
        results.append(check_salt(t, pool, samples, tick))
    if "timing" in checks:
        results.append(check_timing(t, pool, context, samples, tick))
    if "abort" in checks:
        results.append(check_abort(t, pool, context, samples, tick))
    meta = {"base_url": t.base, "model": t.model, "pool_tokens": pool, "context_length": context,
            "discovered_from": where, "requests": t.requests}
    return results, meta


def exit_code(results: list[Result]) -> int:
    verdicts = {r.verdict for r in results}
    return 1 if FINDING in verdicts else 3 if INCONCLUSIVE in verdicts else 0


def record(writer, results: list[Result], meta: dict, key_a: str, key_b: str) -> None:
    """Into the store: a ``probe_runs`` row per check and a ``probe_findings`` row per finding, with
    keyed pseudonyms for the API keys and canaries (``Keys.pseudonym``), never the values."""
    import pyarrow as pa
    ph = writer.keys.pseudonym
    n = len(results)
    now = time.time_ns()
    writer.submit("probe_runs", pa.table({
        "ts": pa.array([now] * n, pa.timestamp("ns")), "base_url": [meta["base_url"]] * n, "model": [meta["model"]] * n,
        "tenant_a_h": [ph(key_a)] * n, "tenant_b_h": [ph(key_b)] * n,
        "pool_tokens": pa.array([meta["pool_tokens"]] * n, pa.int64()),
        "context_length": pa.array([meta["context_length"]] * n, pa.int64()),
        "discovered_from": [meta["discovered_from"]] * n, "check_name": [r.check for r in results],
        "verdict": [r.verdict for r in results], "detail": [r.detail for r in results],
        "requests": pa.array([meta["requests"]] * n, pa.int32())}))
    rows = [(r.check, e) for r in results for e in r.evidence]
    if rows:
        def clean(e: dict) -> dict:          # model output may hold canary fragments: stdout only
            return {k: v for k, v in e.items() if k not in ("canary", "answer", "answer_alone")}
        writer.submit("probe_findings", pa.table({
            "check_name": [c for c, _ in rows], "response_id": [e.get("response") for _, e in rows],
            "prompt_tokens": pa.array([e.get("prompt_tokens") for _, e in rows], pa.int64()),
            "canary_h": [ph(e["canary"]) if e.get("canary") else None for _, e in rows],
            "why": [e["why"] for _, e in rows], "evidence": [json.dumps(clean(e)) for _, e in rows]}))


def as_json(results: list[Result], meta: dict) -> str:
    return json.dumps([{**asdict(r), **{"target": meta}} for r in results])
