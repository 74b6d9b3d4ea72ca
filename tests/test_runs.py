"""Forensic truth whatever history the store holds (issue 16): several runs in one store, exact
labels, evidence levels that mean what they say, blocked reads, same-tenant exposure, seeds.

Every comparison is against the time-aware oracle (engine/replay/oracle.py), never against the ledger."""
from __future__ import annotations

import json

import pytest

from telemetry.recorder import recording
from engine.disagg.cluster import Guards
from engine.replay.faults import run_fault
from engine.replay.glm53 import glm53
from forensics.queries.duckdb import Forensics
from engine.commands.main import main
from tests.conftest import MIXED

pytestmark = pytest.mark.xdist_group("runs")


def slot_set(slots) -> set[tuple]:
    return set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"]))


def split_blocked(fx: Forensics) -> tuple[set[tuple], set[tuple]]:
    """(exposed, blocked) slot sets from the store: blocked = the reader was stopped by the read check."""
    req = fx.requests()
    stopped = set(req.filter(req["error_type"] == "ReadCheckViolation")["incarnation"])
    slots = slot_set(fx.exposure_slots())
    return {s for s in slots if s[0] not in stopped}, {s for s in slots if s[0] in stopped}


def test_a_store_of_several_runs_answers_the_union_of_each_runs_answer(mixed):
    store, results = mixed
    truth = set().union(*(r.exposure_set for r in results))
    assert truth, "the vulnerable runs expose something"
    exposed, blocked = split_blocked(Forensics(store))
    assert exposed == truth                                      # precision = recall = 1.0
    assert blocked == set().union(*(r.blocked_set for r in results))
    for res in results:                                          # --run: each run alone, by its boot id
        alone, _ = split_blocked(Forensics(store, run=res.telemetry["boot"]))
        assert alone == res.exposure_set, res.scenario
    for fx in (Forensics(store), Forensics(store, run=results[1].telemetry["boot"])):
        chk = fx.verify_index()                                  # the index of four runs: the join's answer
        assert fx.indexed and chk.ok and chk.join_rows > 0, chk
    assert main(["forensics", "verify-index", "--store", str(store)]) == 0


def test_forensics_runs_lists_each_run_with_its_policy(mixed, capsys):
    store, results = mixed
    assert main(["forensics", "runs", "--store", str(store), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["boot"] for r in rows] == [r.telemetry["boot"] for r in results]
    assert [r["policy"] for r in rows] == [p for _, p in MIXED]
    assert [r["exposed_responses"] for r in rows] == [len(r.readers_of_foreign) for r in results]
    boot = results[1].telemetry["boot"]
    assert main(["forensics", "exposures", "--store", str(store), "--run", boot[:10], "--format", "json"]) == 0
    assert {r["boot"] for r in json.loads(capsys.readouterr().out)} == {boot}
    assert main(["forensics", "exposures", "--store", str(store), "--run", "zz"]) == 2
    assert "no run with that boot id" in capsys.readouterr().err


@pytest.mark.parametrize("query", ["exposures", "tenants", "scores", "runs", "transfers", "preflight", "guards"])
def test_every_answer_is_the_same_byte_for_byte_on_every_call(mixed, capsys, query):
    store, _ = mixed
    outs = []
    for _ in range(2):
        assert main(["forensics", query, "--store", str(store), "--format", "json"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("[")


def test_labels_stale_co_holder_and_foreign_follow_generation_and_holding(mixed):
    store, results = mixed
    slots = Forensics(store, run=results[1].telemetry["boot"]).exposure_slots()        # double_free
    kinds = set(slots["kind"])
    assert "co-holder" in kinds and "stale" not in kinds, kinds     # the donor wrote in a *later* generation
    co = slots.filter(slots["kind"] == "co-holder")
    assert (co["write_generation"] >= co["generation"]).all()
    late = Forensics(store, run=results[0].telemetry["boot"]).exposure_slots()         # late_write
    assert set(late["kind"]) == {"foreign"}, "the late write's request no longer held the page it landed in"
    every = Forensics(store).exposure_slots()
    stale = every.filter(every["kind"] == "stale")
    assert (stale["write_generation"] < stale["generation"]).all()


def test_boilerplate_every_prompt_holds_is_never_surfaced(mixed):
    store, results = mixed
    res = results[3]                                             # offload_race: shared boilerplate only
    ex = Forensics(store, run=res.telemetry["boot"]).exposures()
    assert ex.height and not res.surfaced
    assert set(ex["evidence"]) == {"read"}


def test_reads_the_check_stopped_are_blocked_never_exposures(tmp_path):
    res = run_fault("offload_race", guards=Guards.only("read_check"), recorder=recording(str(tmp_path), flush_interval=0.2))
    assert res.blocked_set and not res.exposure_set, "the oracle judges the failed requests too"
    fx = Forensics(tmp_path)
    exposed, blocked = split_blocked(fx)
    assert blocked == res.blocked_set and exposed == set()
    ex = fx.exposures()
    assert set(ex["evidence"]) == {"blocked"}
    assert fx.query("scores").is_empty() and fx.query("tenants").is_empty()


def test_a_tenant_is_never_told_it_was_exposed_to_other_customers_by_itself(tmp_path, capsys):
    store = tmp_path / "store"
    res = glm53("vulnerable", recorder=recording(str(store), flush_interval=0.2), context=1024, victims=3, background=8,
                max_tokens=16, seed=3, tenants=("umbrella",))
    assert res.exposure_set, "umbrella's over-pool prompts read umbrella's own stale KV"
    out = tmp_path / "report"
    assert main(["report", "--store", str(store), "--out", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["counts"]["donor_tenants"] == rep["counts"]["recipient_tenants"] == 0
    assert rep["counts"]["cross_tenant_responses"] == 0
    assert rep["counts"]["same_tenant_only_responses"] == len(res.readers_of_foreign)
    assert {n["role"] for n in rep["notifications"]} == {"same-tenant"}
    assert all("other customers" not in n["statement"] and "your own" in n["statement"] for n in rep["notifications"])
    tenants = Forensics(store).query("tenants")
    assert tenants["same_tenant"].all()


def test_a_seed_reproduces_the_replay_and_its_verdict():
    a, b = (glm53("vulnerable", context=1024, victims=2, background=6, max_tokens=12, seed=5) for _ in range(2))
    assert a.canaries == b.canaries
    assert [r.output_ids for r in a.requests] == [r.output_ids for r in b.requests]
    shape = lambda res: sorted((res.requests.index(next(r for r in res.requests if r.incarnation == e.response)),  # noqa: E731
                                e.node, e.page, e.position) for e in res.exposure_set)
    assert shape(a) == shape(b) and shape(a)


def test_unified_hardened_replays_its_own_workload(capsys, monkeypatch):
    """Hardened fits the context to the small pool; the over-pool prompts are then longer than the
    context itself, and are refused with that error - the replay still runs (it used to exit 2)."""
    monkeypatch.setenv("COLUMNS", "250")                     # one table row per line
    assert main(["replay", "glm53", "--mode", "unified", "--policy", "hardened", "--no-store", "--victims", "2",
                 "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "longer than the context length" in out and "responses that read foreign slots: 0" in out


def test_the_oracle_names_the_donor_as_of_the_read_even_when_the_page_is_rewritten_after_it():
    """B reads A's pages; then A lets go and E writes the very same bytes (the same text: K/V does not
    depend on the tenant) into the very same slots. The donor of B's read is A - who had written
    them when B read - not E, the last writer by the end of the run."""
    from engine.replay.oracle import Oracle
    from engine.request import SamplingParams
    from tests.test_recall import CONTEXT_A, _point_at_foreign_pages, recall_engine
    eng = recall_engine(check_reads=False)
    oracle = Oracle(eng.model)
    eng.observers.append(oracle.observe_step)
    a, b = _point_at_foreign_pages(eng)
    eng.run_until_done()                                     # B reads A's pages and finishes
    pages = list(a.block_table)
    eng.abort(a)
    e = eng.add_request(CONTEXT_A, SamplingParams(max_tokens=2), tenant="eve")
    eng.run_until_done()
    assert set(e.block_table[: len(pages) - 1]) <= set(pages), "precondition: E rewrote A's pages"
    donors = {x.donor for x in oracle.exposures(b)} - {b.incarnation}
    assert donors == {a.incarnation}, (donors, a.incarnation, e.incarnation)


def test_the_exposure_index_is_the_same_from_a_per_step_ledger(tmp_path):
    """Read runs coalesced (the default) or one page_reads row per read step: the index the writer
    keeps gives the join's answer either way, and the same exposures."""
    sets = {}
    for coalesce in (True, False):
        store = tmp_path / str(coalesce)
        run_fault("double_free", "vulnerable", recorder=recording(str(store), flush_interval=0.2, coalesce=coalesce))
        fx = Forensics(store)
        chk = fx.verify_index()
        assert fx.indexed and chk.ok and chk.join_rows > 0, (coalesce, chk)
        sets[coalesce] = {(r, d, p, s) for r, d, p, s in
                          fx.exposure_slots().select("response", "donor", "page", "position").rows()}
    def relative(s: set) -> set:        # incarnations start at a new base every run: compare them from it
        base = min(x[0] for x in s)
        return {(r - base, d if d == -1 else d - base, p, q) for r, d, p, q in s}
    assert relative(sets[True]) == relative(sets[False])
