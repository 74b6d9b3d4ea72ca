"""The bug family (faults 2-7), judged by the oracle of DESIGN.md - a clean re-run of every
response's own tokens against what it read - never by the tag plane.

For each fault: under `vulnerable` the triggering event makes a response read foreign or stale
slots (fault 6: pages are lost instead); under `hardened` nobody reads a foreign slot, the
affected request fails with a clear error (or is served correctly), everyone else's output is
byte-identical to the run without the event, and every pool's free count returns to its initial
value; without the event, both policies show zero exposures. The store's forensics equal the
oracle slot for slot.
"""
from __future__ import annotations

import polars as pl
import pytest

from telemetry.recorder import recording
from engine.disagg.cluster import Guards
from engine.replay.faults import FAULTS, run_fault
from forensics.queries.duckdb import Forensics, sql as fx_sql

_CACHE: dict = {}


def runs(name: str, tmp_path_factory) -> dict:
    """Every run of one fault scenario, computed once per test process."""
    if name not in _CACHE:
        out, key = {}, b"same texts, with and without the event"
        for policy in ("vulnerable", "hardened"):
            store = tmp_path_factory.mktemp(f"{name}-{policy}")
            out[policy] = run_fault(name, policy, recorder=recording(str(store), flush_interval=0.2), canary_key=key)
            out[policy].store = store
            out[f"{policy}-quiet"] = run_fault(name, policy, trigger=False, canary_key=key)
        _CACHE[name] = out
    return _CACHE[name]


FAULT_PARAMS = [pytest.param(name, marks=pytest.mark.xdist_group(f"fault-{name}")) for name in FAULTS]
# what a hardened engine tells the client whose request the event hit (None: it is served correctly)
HARDENED_ERROR = {"late_write": "aborted: client disconnected", "release_timeout": "aborted: client disconnected",
                  "double_free": "failed (the link failed)", "lease_expiry": "prefill lease on its source pages expired",
                  "offload_race": None, "transfer_id_reuse": None}


def oracle_set(res) -> set[tuple]:
    return {tuple(e) for ex in res.exposures.values() for e in ex if e.donor != e.response}


@pytest.mark.parametrize("name", FAULT_PARAMS)
def test_vulnerable_the_event_exposes_foreign_kv(name, tmp_path_factory):
    res = runs(name, tmp_path_factory)["vulnerable"]
    if name == "transfer_id_reuse":
        assert res.readers_of_foreign == {}, "fault 6 reads nothing..."
        assert not res.pages_balanced, "...it loses pages"
        free, total = res.free_pages["prefill0"]
        assert total - free == -(-len(res.affected[0].prompt_ids) // 16)       # exactly the retry's source pages
        return
    readers = res.readers_of_foreign
    assert readers, f"{name}: the oracle must see someone read foreign or stale KV"
    served = {r.incarnation for r in res.requests if r.error is None}
    assert set(readers) <= served


@pytest.mark.parametrize("name", FAULT_PARAMS)
def test_hardened_nobody_reads_foreign_kv_and_only_the_affected_request_fails(name, tmp_path_factory):
    rs = runs(name, tmp_path_factory)
    res, quiet = rs["hardened"], rs["hardened-quiet"]
    assert res.readers_of_foreign == {} and oracle_set(res) == set()
    assert res.pages_balanced, res.free_pages
    want = HARDENED_ERROR[name]
    for r in res.affected:
        if want is None:
            assert r.error is None, r.error
        else:
            assert r.error is not None and want in str(r.error), r.error
            assert r.output_ids == [], "no token is generated for a request that failed before decode"
    others = [r for r in res.requests if r not in res.affected or want is None]
    assert all(r.error is None for r in others), [str(r.error) for r in others if r.error]
    # byte-identical to the same workload without the event (the event's extra requests aside)
    common = min(len(res.requests), len(quiet.requests))
    for r, q in zip(res.requests[:common], quiet.requests[:common]):
        if r in res.affected and want is not None:
            continue
        assert r.output_ids == q.output_ids, f"{r.tenant}'s output changed"


@pytest.mark.parametrize("name", FAULT_PARAMS)
def test_without_the_event_nothing_is_exposed_in_either_policy(name, tmp_path_factory):
    rs = runs(name, tmp_path_factory)
    for policy in ("vulnerable", "hardened"):
        quiet = rs[f"{policy}-quiet"]
        assert oracle_set(quiet) == set() and quiet.pages_balanced, (policy, quiet.free_pages)
        assert all(r.error is None for r in quiet.requests)


@pytest.mark.parametrize("name", FAULT_PARAMS)
def test_forensics_from_the_store_equal_the_oracle(name, tmp_path_factory):
    rs = runs(name, tmp_path_factory)
    for policy in ("vulnerable", "hardened"):
        res = rs[policy]
        fx = Forensics(res.store)
        slots = fx.exposure_slots()
        found = set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"]))
        stopped = set(fx.requests().filter(pl.col("error_type") == "ReadCheckViolation")["incarnation"])
        exposed = {s for s in found if s[0] not in stopped}
        assert exposed == oracle_set(res), f"{policy}: precision and recall must be exactly 1.0"
        assert found - exposed == res.blocked_set, f"{policy}: blocked reads equal the oracle's too"
        chk = fx.verify_index()         # the answers above came from the exposure index: the join agrees
        assert fx.indexed and chk.ok and chk.join_rows == slots.height, (policy, chk)
        join = fx.con.sql(fx_sql("exposure_slots")).pl()         # the join alone equals the oracle too
        assert set(join.select("response", "donor", "node", "page", "position").rows()) == found


# ---- fix x fault: which single guard (or set) stops which fault -----------------------------------------
MATRIX = [
    # (fault, guards on, stops it?)
    ("offload_race", ["deferred_release"], True),
    ("offload_race", ["read_check"], True),          # the reader fails instead of using the stale copy
    ("offload_race", ["checksum", "landed_set_check"], False),
    ("late_write", ["cancel_both_halves"], True),    # the prefill half stops: nothing is sent
    ("late_write", ["deferred_release"], False),     # prefill carries on; the hold times out before it sends
    ("double_free", ["single_release"], True),
    ("double_free", ["double_free_check"], True),
    ("double_free", ["deferred_release", "cancel_both_halves"], False),
    ("lease_expiry", ["deferred_release"], True),
    ("lease_expiry", ["checksum"], True),            # the pulled records do not match the sender's checksum
    ("lease_expiry", ["landed_set_check"], False),   # every reserved slot did land - with someone else's KV
    ("transfer_id_reuse", ["incarnation_ids"], True),
    ("transfer_id_reuse", ["deferred_release", "single_release"], False),
    ("release_timeout", ["deferred_release", "cancel_both_halves", "transfer_batch_bound"], True),
    ("release_timeout", ["deferred_release", "cancel_both_halves"], False),   # one unbounded call outlasts the timeout
    ("release_timeout", ["deferred_release"], False),
]


@pytest.mark.parametrize("name,on,stops", [pytest.param(*m, marks=pytest.mark.xdist_group(f"fault-{m[0]}"),
                                                        id=f"{m[0]}-{'+'.join(m[1])}") for m in MATRIX])
def test_fix_by_fault_matrix(name, on, stops):
    res = run_fault(name, guards=Guards.only(*on))
    if name == "transfer_id_reuse":
        assert res.pages_balanced is stops, res.free_pages
        return
    leaked = oracle_set(res)
    assert (not leaked) is stops, leaked
    if stops:
        assert res.pages_balanced, res.free_pages


@pytest.mark.xdist_group("fault-late_write")
def test_cli_replays_a_fault_and_names_every_scenario(capsys, tmp_path):
    from engine.commands.main import main
    assert main(["replay", "--list"]) == 0
    listed = {line.split("\t")[0] for line in capsys.readouterr().out.splitlines()}
    assert listed == {"glm53", *FAULTS}
    assert main(["replay", "late_write", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "responses that read foreign slots: 2" in out and "next: kvledger forensics exposures" in out
    assert main(["replay", "late_write", "--no-trigger", "--no-store"]) == 0
    assert "responses that read foreign slots: 0" in capsys.readouterr().out
    assert main(["replay", "offload_race", "--mode", "disaggregated"]) == 2
    assert "runs in unified mode only" in capsys.readouterr().err


# ---- held-out seeds: another seed is another layout, and forensics still equal the oracle -------------
@pytest.mark.parametrize("name", FAULT_PARAMS)
def test_another_seed_is_another_layout_and_forensics_still_equal_the_oracle(name, tmp_path_factory):
    """Seed 0 is the documented layout; seed 7 draws other prompt and answer lengths (issue 33: the
    six scenarios had one layout for every seed). The race still happens and the store still
    answers exactly what the oracle saw."""
    base = runs(name, tmp_path_factory)["vulnerable"]
    store = tmp_path_factory.mktemp(f"{name}-seed7")
    res = run_fault(name, "vulnerable", seed=7, recorder=recording(str(store), flush_interval=0.2))
    shape = lambda r: [(len(q.prompt_ids), q.sampling.max_tokens) for q in r.requests]  # noqa: E731
    assert shape(res) != shape(base), "seed 7 gave seed 0's layout"
    if name == "transfer_id_reuse":
        assert res.readers_of_foreign == {} and not res.pages_balanced
    else:
        assert res.readers_of_foreign, f"{name}: the race no longer happens on seed 7"
    fx = Forensics(store)
    slots = fx.exposure_slots()
    found = set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"]))
    stopped = set(fx.requests().filter(pl.col("error_type") == "ReadCheckViolation")["incarnation"])
    assert {s for s in found if s[0] not in stopped} == oracle_set(res)
