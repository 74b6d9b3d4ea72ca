"""Per-tenant rate limits, counted in the HTTP process before a request reaches the engine.

Three limits per tenant, as OpenAI's API and LiteLLM's proxy count them:

- ``rpm``: requests per minute;
- ``tpm``: tokens per minute, a request charged its prompt plus its ``max_tokens`` when it is
  admitted, and given back what it did not generate when it ends (a request refused before it ran
  gives all of it back);
- ``max_parallel_requests``: requests in flight at once.

The per-minute limits are token buckets that refill continuously (a tenant at rest has a full
minute's allowance; one that used it gets it back at ``limit / 60`` per second), so a burst of a
minute's worth is allowed and the long-run rate is the limit. A refusal is a 429 in OpenAI's shape
(``code: rate_limit_exceeded``, ``type: requests | tokens``) with ``Retry-After`` in seconds and
the ``x-ratelimit-*`` headers OpenAI sends; a request larger than the tenant's whole ``tpm`` can
never pass and says so, with ``x-should-retry: false`` (the ``openai`` client then does not retry).
Every limit is off unless set: in the keys file per tenant, or for all tenants by
``--tenant-rpm``, ``--tenant-tpm``, ``--tenant-max-parallel``.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from engine.errors import InputError

FIELDS = ("rpm", "tpm", "max_parallel_requests")
MAX_LIMIT = 1 << 40


class Limits(NamedTuple):
    rpm: int = 0                      # 0: no limit
    tpm: int = 0
    max_parallel_requests: int = 0

    def __bool__(self) -> bool:
        return any(self)

    def over(self, default: "Limits") -> "Limits":
        """These limits, each one not set taken from ``default``."""
        return Limits(*(mine or theirs for mine, theirs in zip(self, default)))


class _Bucket:
    """A token bucket of ``per_minute`` tokens refilling at ``per_minute / 60`` per second."""

    def __init__(self, per_minute: int, now: float):
        self.capacity, self.rate, self.level, self.t = float(per_minute), per_minute / 60.0, float(per_minute), now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
        self.t = now

    def wait(self, n: float) -> float:
        """Seconds until ``n`` tokens are there (0: now)."""
        return max(0.0, (n - self.level) / self.rate)

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.level) / self.rate


class Refusal(NamedTuple):
    limit: str                        # "requests" | "tokens" | "parallel_requests"
    message: str
    retry_after: float | None         # None: never (larger than the limit itself)
    headers: dict


@dataclass
class Grant:
    """What one admitted request holds; ``release`` (idempotent) gives back its parallel slot and
    the tokens it did not use."""
    limiter: "RateLimiter | None"
    tenant: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    headers: dict | None = None
    released: bool = False

    def release(self, req=None) -> None:
        if self.released or self.limiter is None:
            return
        self.released = True
        # it ran when it finished cleanly or got as far as a token (a stream dropped mid-way keeps what it
        # used: disconnecting is no way around the limit); refused or aborted before that: all back
        ran = req is not None and (getattr(req, "error", None) is None or bool(req.output_ids)
                                   or getattr(req, "first_token_at", None) is not None)
        unused = self.max_tokens - len(req.output_ids) if ran else self.prompt_tokens + self.max_tokens
        self.limiter._release(self.tenant, max(0, unused))


class _State:
    def __init__(self, limits: Limits, now: float):
        self.limits = limits
        self.requests = _Bucket(limits.rpm, now) if limits.rpm else None
        self.tokens = _Bucket(limits.tpm, now) if limits.tpm else None
        self.parallel = 0


class RateLimiter:
    """The limits of every tenant (``per_tenant`` over ``default``), checked and charged at once."""

    def __init__(self, default: Limits = Limits(), per_tenant: dict[str, Limits] | None = None,
                 clock: Callable[[], float] = time.monotonic, on_refuse: Callable[[str, str], None] | None = None):
        self.default, self.per_tenant, self.clock = default, dict(per_tenant or {}), clock
        self.on_refuse = on_refuse
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()

    def limits(self, tenant: str) -> Limits:
        return self.per_tenant.get(tenant, Limits()).over(self.default)

    @property
    def enabled(self) -> bool:
        return bool(self.default) or any(self.per_tenant.values())

    def admit(self, tenant: str, prompt_tokens: int, max_tokens: int) -> "Grant | Refusal":
        """Charge one request of ``prompt_tokens + max_tokens`` to the tenant, or say which limit
        refuses it (nothing is charged then)."""
        lim = self.limits(tenant)
        if not lim:
            return Grant(None, tenant)
        now, cost = self.clock(), prompt_tokens + max_tokens
        with self._lock:
            st = self._states.get(tenant)
            if st is None:
                st = self._states[tenant] = _State(lim, now)
            for b in (st.requests, st.tokens):
                if b is not None:
                    b.refill(now)
            refusal = self._refusal(st, cost, prompt_tokens, max_tokens)
            if refusal is None:
                if st.requests is not None:
                    st.requests.level -= 1
                if st.tokens is not None:
                    st.tokens.level -= cost
                st.parallel += 1
            headers = _headers(st)
        if refusal is not None:
            if self.on_refuse is not None:
                self.on_refuse(tenant, refusal.limit)
            return refusal._replace(headers={**headers, **refusal.headers})
        return Grant(self, tenant, prompt_tokens, max_tokens, headers)

    def _refusal(self, st: _State, cost: int, prompt_tokens: int, max_tokens: int) -> Refusal | None:
        lim = st.limits
        if st.tokens is not None and cost > st.tokens.capacity:
            return Refusal("tokens", f"request too large: prompt ({prompt_tokens}) + max_tokens ({max_tokens}) = "
                           f"{cost} tokens; this tenant's limit is {lim.tpm} tokens per minute (lower max_tokens or "
                           "shorten the prompt)", None, {"x-should-retry": "false"})
        if lim.max_parallel_requests and st.parallel >= lim.max_parallel_requests:
            return Refusal("parallel_requests", f"rate limit reached on parallel requests: {st.parallel} in flight, "
                           f"the limit is {lim.max_parallel_requests}; retry when one ends", 1.0, {})
        if st.requests is not None and st.requests.level < 1:
            w = st.requests.wait(1)
            return Refusal("requests", f"rate limit reached on requests per min (RPM): limit {lim.rpm}; "
                           f"please try again in {_duration(w)}", w, {})
        if st.tokens is not None and st.tokens.level < cost:
            w = st.tokens.wait(cost)
            return Refusal("tokens", f"rate limit reached on tokens per min (TPM): limit {lim.tpm}, available "
                           f"{max(0, int(st.tokens.level))}, requested {cost}; please try again in {_duration(w)}", w, {})
        return None

    def _release(self, tenant: str, unused_tokens: int) -> None:
        with self._lock:
            st = self._states.get(tenant)
            if st is None:
                return
            st.parallel = max(0, st.parallel - 1)
            if st.tokens is not None and unused_tokens:
                st.tokens.refill(self.clock())
                st.tokens.level = min(st.tokens.capacity, st.tokens.level + unused_tokens)


def _headers(st: _State) -> dict:
    """OpenAI's x-ratelimit-* headers for the limits the tenant has."""
    h = {}
    for name, b in (("requests", st.requests), ("tokens", st.tokens)):
        if b is not None:
            h[f"x-ratelimit-limit-{name}"] = str(int(b.capacity))
            h[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(b.level)))
            h[f"x-ratelimit-reset-{name}"] = _duration(b.reset())
    return h


def _duration(s: float) -> str:
    """Seconds as OpenAI writes them in x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    if s < 1:
        return f"{max(0, math.ceil(s * 1000))}ms"
    if s < 60:
        return f"{math.ceil(s * 10) / 10:g}s"
    m, rest = divmod(math.ceil(s), 60)
    return f"{m}m{rest}s"


def parse_limits(entry: dict, where: str) -> Limits:
    """The limit fields of one keys-file entry (absent: not set); InputError names what is wrong."""
    vals = []
    for f in FIELDS:
        v = entry.get(f, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LIMIT:
            raise InputError(f"{where}: {f} must be an integer in [0, {MAX_LIMIT}] (0: no limit), got {v!r}")
        vals.append(v)
    return Limits(*vals)
