"""The GLM-5.3 incident, reproduced (vulnerable) and closed (hardened), judged by the oracle of
DESIGN.md (clean re-run of each response's own tokens), never by the tag plane."""
from __future__ import annotations

import pytest

from engine.disagg.cluster import Guards
from engine.replay.glm53 import glm53

from tests.conftest import GLM53_SMALL as SMALL

pytestmark = pytest.mark.xdist_group("glm53")


@pytest.fixture
def vulnerable(glm53_vulnerable):
    return glm53_vulnerable[0]


@pytest.fixture
def hardened(glm53_hardened):
    return glm53_hardened[0]


def test_every_pool_returns_to_its_initial_free_count(vulnerable, hardened):
    assert vulnerable.pages_balanced and hardened.pages_balanced


def test_pools_keep_the_incident_ratio(vulnerable):
    assert vulnerable.pools["prefill0"] < vulnerable.context <= vulnerable.pools["prefill1-canary"]
    assert abs(vulnerable.pools["prefill0"] / vulnerable.context - 681_280 / 1_048_576) < 0.02


def test_vulnerable_over_pool_responses_succeed_and_read_foreign_slots(vulnerable):
    assert len(vulnerable.over_pool) == SMALL["victims"]
    for r in vulnerable.over_pool:
        assert r.error is None and r.finish_reason == "length"               # HTTP 200
        assert r.prompt_tokens_billed == len(r.prompt_ids)                    # billed for the long prompt
        donors = {e.donor for e in vulnerable.exposures[r.incarnation]} - {r.incarnation}
        assert donors, "the oracle must see foreign or stale slots in every over-pool response"
    assert set(vulnerable.foreign_readers) == set(vulnerable.over_pool), "nobody else reads foreign slots"


def test_hardened_rejects_with_the_original_error_and_nobody_reads_foreign_slots(vulnerable, hardened):
    assert len(hardened.over_pool) == SMALL["victims"]
    for r in hardened.over_pool:
        assert r.finish_reason == "error" and "larger than node prefill0's KV pool" in str(r.error)
        assert r.output_ids == []
    assert hardened.foreign_readers == []
    assert all(not ex for ex in hardened.exposures.values())
    # every other request's output is byte-identical to the vulnerable run's
    others_v = [r.output_ids for r in vulnerable.requests if r not in vulnerable.over_pool]
    others_h = [r.output_ids for r in hardened.requests if r not in hardened.over_pool]
    assert others_v == others_h


def test_unified_vulnerable_errors_instead_of_leaking(glm53_unified):
    res = glm53_unified[0]
    assert res.over_pool and all(r.finish_reason == "error" for r in res.over_pool)
    assert res.foreign_readers == []


@pytest.mark.parametrize("guard", ["landed_set_check", "read_check", "checksum"])
def test_single_guards_against_the_incident(guard):
    """Fix x fault: the landed-set check alone and the read check alone stop the incident; the
    checksum alone does not (prefill checksums its one placeholder token, decode verifies exactly that)."""
    only = Guards(**{f: f == guard for f in Guards.__dataclass_fields__})
    res = glm53("vulnerable", "disaggregated", guards=only, **SMALL)
    assert res.pages_balanced, res.free_pages
    leaked = [r for r in res.over_pool if r.error is None and res.exposures[r.incarnation]]
    if guard == "checksum":
        assert len(leaked) == SMALL["victims"]
    else:
        assert leaked == [] and all(r.finish_reason == "error" for r in res.over_pool)
