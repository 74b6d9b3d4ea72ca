"""The tenant-scoped prefix cache: full prompt pages shared by content tag within one cache scope,
never across scopes; the scope comes from the tenant and the isolation level, server-side."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InputError
from engine.llm import LLMEngine
from engine.models import load_model
from engine.kv.pool import KVPool
from engine.request import SamplingParams

SYSTEM = ("You are a careful assistant for the accounts team. Answer in one line. Never reveal the "
          "ledger. ")                                   # 98 tokens: 6 full pages of 16
SP = SamplingParams(max_tokens=12)


def engine(pages: int = 64, **kw) -> LLMEngine:
    model, tok = load_model("recall")
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    return LLMEngine(model, tok, EngineConfig(kv_memory_budget=pages * pb, page_size=16, context_length=512, **kw))


def run(eng: LLMEngine, items: list[tuple[str, str, str]]) -> list:
    """(tenant, user, prompt) one after another, so later ones can hit what earlier ones cached."""
    out = []
    for tenant, user, prompt in items:
        r = eng.new_request(prompt, SP, tenant, user=user)
        eng.enqueue(r)
        eng.run_until_done()
        out.append(r)
    return out


QUESTIONS = ["What is the balance of account 17?", "Who approved invoice 4411?", "List the overdue accounts."]


def test_same_scope_reuses_full_prompt_pages_and_outputs_do_not_change():
    cached = engine(prefix_cache=True)
    plain = engine(prefix_cache=False)
    items = [("acme", "", SYSTEM + q) for q in QUESTIONS]
    a, b = run(cached, items), run(plain, items)
    assert [r.cached_tokens for r in a] == [0, 96, 96]
    assert [r.prefilled_tokens for r in a[1:]] == [len(r.prompt_ids) - 96 for r in a[1:]]
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert all(r.error is None for r in a)                 # the read check passed on every shared page
    cached.allocator.check_integrity()
    assert cached.allocator.num_free == cached.allocator.total


def test_another_tenant_never_shares_even_with_identical_tokens():
    eng = engine(prefix_cache=True)
    a, b = run(eng, [("acme", "", SYSTEM + QUESTIONS[0]), ("globex", "", SYSTEM + QUESTIONS[0])])
    assert b.cached_tokens == 0 and a.scope != b.scope
    assert a.output_ids == b.output_ids


@pytest.mark.parametrize("level,items,hits", [
    ("user", [("acme", "ann", "x"), ("acme", "bob", "x"), ("acme", "ann", "y")], [0, 0, 96]),
    ("tenant", [("acme", "ann", "x"), ("acme", "bob", "x"), ("globex", "ann", "y")], [0, 96, 0]),
    ("org", [("acme", "", "x"), ("acme-eu", "", "x"), ("globex", "", "y")], [0, 96, 0]),
])
def test_isolation_levels_decide_who_shares(level, items, hits):
    eng = engine(prefix_cache=True, isolation_level=level, orgs={"acme": "acme-corp", "acme-eu": "acme-corp"})
    reqs = run(eng, [(t, u, SYSTEM + q) for t, u, q in items])
    assert [r.cached_tokens for r in reqs] == hits


def test_scope_is_derived_server_side_and_bad_settings_are_refused():
    with pytest.raises(InputError, match="isolation_level must be one of"):
        engine(isolation_level="everyone")
    eng = engine(prefix_cache=True, isolation_level="user")
    with pytest.raises(InputError, match="needs a user id"):
        eng.new_request("hello", SP, "acme")
    assert eng.allocator.num_free == eng.allocator.total
    r = eng.new_request("hello", SP, "acme", user="tenant:globex")    # a hostile user id stays inside acme
    assert r.scope == '["user","acme","tenant:globex"]'


# Names a tenant chooses can never forge another scope (issue 16): each case is two requests whose
# names once built the same scope string; they must get different scopes and never share a page.
@pytest.mark.parametrize("level,a,b", [
    ("org", ("acme-corp", ""), ("acme", "")),                  # unmapped tenant named like org acme-corp
    ("user", ("acme", "bob/carol"), ("acme/bob", "carol")),    # the separator inside a name
    ("user", ("acme", 'x","y'), ('acme","x', "y")),            # quotes inside a name
    ("tenant", ("a", ""), ("a\u0000", "")),
])
def test_no_choice_of_names_forges_another_scope(level, a, b):
    eng = engine(prefix_cache=True, isolation_level=level, orgs={"acme": "acme-corp"})
    reqs = run(eng, [(a[0], a[1], SYSTEM + QUESTIONS[0]), (b[0], b[1], SYSTEM + QUESTIONS[0])])
    assert reqs[0].scope != reqs[1].scope
    assert reqs[1].cached_tokens == 0, "identical tokens, different scopes: nothing may be shared"


def test_a_client_salt_narrows_a_scope_and_never_crosses_one():
    eng = engine(prefix_cache=True)
    plain = eng.new_request("hello", SP, "acme")
    salted = eng.new_request("hello", SP, "acme", cache_salt="s1")
    forged = eng.new_request("hello", SP, "globex", cache_salt='"]["tenant","acme')
    assert len({plain.scope, salted.scope, forged.scope}) == 3
    assert salted.scope.startswith(plain.scope[:-1]) and forged.scope.startswith('["tenant","globex"')


def test_a_cached_page_handed_to_someone_else_is_never_a_hit():
    eng = engine(pages=12, prefix_cache=True)
    first = run(eng, [("acme", "", SYSTEM + QUESTIONS[0])])[0]
    full = len(first.prompt_ids) // 16
    assert len(eng.prefix_cache) == full
    run(eng, [("globex", "", "z" * 180)])                     # 12 pages: reuses every freed page
    again = run(eng, [("acme", "", SYSTEM + QUESTIONS[0])])[0]
    assert again.cached_tokens == 0, "acme's cached pages now hold globex's KV: not a hit"
    assert again.error is None and again.output_ids == first.output_ids
    eng.allocator.check_integrity()


def test_sanctioned_sharing_is_never_reported_as_an_exposure(tmp_path):
    from forensics.queries.duckdb import Forensics
    from telemetry import Telemetry
    from engine.replay.oracle import Oracle
    tel = Telemetry(tmp_path, policy="hardened", flush_interval=0.2)
    model, tok = load_model("recall")
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    eng = LLMEngine(model, tok, EngineConfig(kv_memory_budget=64 * pb, page_size=16, context_length=512,
                                             prefix_cache=True, fail_on_violation=False), recorder=tel)
    oracle = Oracle(model)
    eng.observers.append(oracle.observe_step)
    reqs = run(eng, [("acme", "", SYSTEM + q) for q in QUESTIONS])
    tel.close()
    assert [r.cached_tokens for r in reqs] == [0, 96, 96]
    assert all(oracle.exposures(r) == [] for r in reqs)
    fx = Forensics(tmp_path)
    assert fx.exposure_slots().is_empty()
    reads = fx.con.sql("SELECT count(*) FROM page_reads WHERE check_passed AND list_max(found_writers) > 0 "
                       "AND list_contains(found_writers, reader) = false").fetchall()[0][0]
    assert reads > 0, "the shared pages were read, and the ledger shows who wrote them"
    req = fx.requests()
    assert sorted(req["prompt_tokens_cached"].to_list()) == [0, 96, 96]
    snap = fx.query("preflight")
    assert snap["isolation_level"][0] == "tenant"
