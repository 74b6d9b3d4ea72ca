"""Per-tenant rate limits (engine.server.limits) on a clock the test moves: what each limit
refuses, what it says, and what a request gives back when it ends."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.errors import InputError
from engine.server.limits import Grant, Limits, RateLimiter, Refusal, _duration, parse_limits


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ran(n_out: int):
    return SimpleNamespace(output_ids=[0] * n_out, error=None)


def test_requests_per_minute_refill_continuously():
    clock = Clock()
    lim = RateLimiter(Limits(rpm=3), clock=clock)
    grants = [lim.admit("acme", 10, 5) for _ in range(3)]
    assert all(isinstance(g, Grant) for g in grants)
    assert grants[0].headers["x-ratelimit-remaining-requests"] == "2" and grants[2].headers["x-ratelimit-limit-requests"] == "3"
    r = lim.admit("acme", 10, 5)
    assert isinstance(r, Refusal) and r.limit == "requests" and r.retry_after == pytest.approx(20.0)
    assert "requests per min (RPM): limit 3" in r.message and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert isinstance(lim.admit("globex", 10, 5), Grant)            # another tenant has its own bucket
    clock.t += 19.9
    assert isinstance(lim.admit("acme", 10, 5), Refusal)
    clock.t += 0.2                                                    # one request's worth refilled (60 s / 3)
    assert isinstance(lim.admit("acme", 10, 5), Grant)
    clock.t += 3600                                                   # a tenant at rest: one minute's worth, no more
    assert sum(isinstance(lim.admit("acme", 1, 1), Grant) for _ in range(5)) == 3


CASES = {   # limits, (prompt, max_tokens) of the requests before, the request, the limit that refuses it (None: admitted)
    "tokens within tpm": (Limits(tpm=100), [(40, 20)], (20, 20), None),
    "tokens over what is left": (Limits(tpm=100), [(40, 20)], (30, 20), "tokens"),
    "one request larger than tpm": (Limits(tpm=100), [], (90, 20), "tokens"),
    "parallel": (Limits(max_parallel_requests=2), [(1, 1), (1, 1)], (1, 1), "parallel_requests"),
    "no limits": (Limits(), [(10 ** 6, 10 ** 6)] * 50, (10 ** 6, 10 ** 6), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_limit_refuses_what_it_should(case):
    limits, before, (prompt, max_tokens), refused_by = CASES[case]
    lim = RateLimiter(limits, clock=Clock())
    for p, m in before:
        assert isinstance(lim.admit("acme", p, m), Grant)
    r = lim.admit("acme", prompt, max_tokens)
    assert (r.limit if isinstance(r, Refusal) else None) == refused_by
    if case == "one request larger than tpm":            # can never pass: the client is told not to retry
        assert r.retry_after is None and r.headers["x-should-retry"] == "false" and "request too large" in r.message


def test_a_request_gives_back_its_slot_and_the_tokens_it_did_not_use():
    clock = Clock()
    lim = RateLimiter(Limits(tpm=100, max_parallel_requests=1), clock=clock)
    g = lim.admit("acme", 30, 50)
    assert isinstance(lim.admit("acme", 1, 1), Refusal)              # its one slot is taken
    g.release(_ran(10))                                              # generated 10 of 50: 40 back
    g.release(_ran(10))                                              # idempotent
    assert lim._states["acme"].tokens.level == pytest.approx(100 - 80 + 40)
    g2 = lim.admit("acme", 30, 20)
    g2.release(SimpleNamespace(output_ids=[], error=RuntimeError("refused by the engine")))   # never ran: all back
    assert lim._states["acme"].tokens.level == pytest.approx(60)
    g3 = lim.admit("acme", 30, 20)
    g3.release(None)                                                 # never admitted: all back
    assert lim._states["acme"].parallel == 0 and lim._states["acme"].tokens.level == pytest.approx(60)
    g4 = lim.admit("acme", 30, 20)                                   # dropped after 5 tokens: keeps what it used
    g4.release(SimpleNamespace(output_ids=[0] * 5, error=RuntimeError("client disconnected"), first_token_at=1.0))
    assert lim._states["acme"].tokens.level == pytest.approx(60 - 50 + 15)


def test_per_tenant_limits_override_the_default_one_field_at_a_time():
    lim = RateLimiter(Limits(rpm=10, tpm=1000), {"acme": Limits(rpm=2)})
    assert lim.limits("acme") == Limits(2, 1000, 0) and lim.limits("globex") == Limits(10, 1000, 0)
    assert not RateLimiter().enabled and lim.enabled


def test_refusals_are_counted_by_tenant_and_limit():
    seen = []
    lim = RateLimiter(Limits(rpm=1), clock=Clock(), on_refuse=lambda t, k: seen.append((t, k)))
    lim.admit("acme", 1, 1)
    lim.admit("acme", 1, 1)
    assert seen == [("acme", "requests")]


@pytest.mark.parametrize("seconds, text", [(0.02, "20ms"), (0.0, "0ms"), (1.5, "1.5s"), (20.0, "20s"), (360.0, "6m0s"),
                                           (61.2, "1m2s")])
def test_durations_are_written_as_openai_writes_them(seconds, text):
    assert _duration(seconds) == text


@pytest.mark.parametrize("entry, says", [({"rpm": -1}, "rpm must be an integer in [0,"), ({"tpm": "100"}, "tpm must be"),
                                         ({"max_parallel_requests": True}, "max_parallel_requests must be"),
                                         ({"rpm": 2 ** 41}, "rpm must be an integer in [0, 1099511627776]")])
def test_bad_limits_in_a_keys_entry_are_named(entry, says):
    with pytest.raises(InputError, match=says.replace("[", r"\[")):
        parse_limits(entry, "--keys k.json: tenant 'acme'")
