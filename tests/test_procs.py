"""Process mode: prefill nodes are separate OS processes writing KV into decode's pool through
shared memory; everything but the handoff is DisaggCluster's own code."""
from __future__ import annotations

import os

import pytest

from telemetry.recorder import recording
from engine.config import EngineConfig
from engine.disagg.cluster import DisaggCluster, Guards
from engine.errors import KvledgerError
from engine.models import load_model
from engine.replay.oracle import Oracle
from engine.kv.pool import KVPool
from engine.disagg.procs import ProcessCluster
from engine.request import SamplingParams

pytestmark = pytest.mark.xdist_group("procs")

TEXTS = [("acme", "The quarterly numbers for the northern region are ready; the secret is CANARY-77aa. " * 3),
         ("globex", "Meeting notes: move the launch to Thursday and tell nobody about CANARY-9b1f. " * 4),
         ("initech", "Reminder: the TPS reports need the new cover sheet from now on, see memo 12. " * 2),
         ("acme", "Draft reply to the auditor about invoice 4411 and the missing approvals. " * 3)]


def cfgs(model, prefill_tokens=(512, 1024), decode_tokens=1024):
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, 16)
    mk = lambda t, n: EngineConfig(kv_memory_budget=t // 16 * pb, page_size=16, context_length=1024,  # noqa: E731
                                   node_id=n, max_num_seqs=8)
    return [mk(t, f"prefill{i}") for i, t in enumerate(prefill_tokens)], mk(decode_tokens, "decode0")


def serve(cls, guards, texts, **kw):
    model, tok = load_model("recall")
    pre, dec = cfgs(model)
    cl = cls(model, tok, pre, dec, guards, **kw)
    oracle = Oracle(model)
    cl.decode.observers.append(oracle.observe_step)
    cl.landing_observers.append(oracle.observe_landing)
    try:
        reqs = [cl.submit(t, SamplingParams(max_tokens=16), tenant, prefill_node=i % 2) for i, (tenant, t) in enumerate(texts)]
        cl.run_until_done()
    finally:
        cl.close()
    return cl, reqs, oracle


def test_prefill_processes_write_into_decodes_shared_pool_and_serve_the_same_tokens():
    cl, reqs, oracle = serve(ProcessCluster, Guards.policy("hardened"), TEXTS)
    _, ref, _ = serve(DisaggCluster, Guards.policy("hardened"), TEXTS)
    assert all(r.error is None for r in reqs), [str(r.error) for r in reqs if r.error]
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert {n.pid for n in cl.prefills}.isdisjoint({os.getpid()}) and len({n.pid for n in cl.prefills}) == 2
    assert all(f == t for f, t in cl.free_pages().values()), cl.free_pages()
    assert not os.path.exists(cl.shared_path), "the shared pool file is removed on close"
    assert all(oracle.exposures(r) == [] for r in reqs)


def test_the_incident_reproduces_across_processes():
    """The reject path is the router's code, shared: a prompt over prefill0's 512-token pool gets
    the placeholder, the child writes one slot, decode trusts it and reads stale KV."""
    long = ("umbrella", "Confidential merger terms for the board, page 1 of 1: " + "x y z " * 110)
    cl, reqs, oracle = serve(ProcessCluster, Guards.policy("vulnerable"), TEXTS[:2] + [long] + TEXTS[2:])
    victim = reqs[2]
    assert len(victim.prompt_ids) > 512 and victim.error is None
    assert {e.donor for e in oracle.exposures(victim)} - {victim.incarnation}, "stale KV read"
    cl2, reqs2, _ = serve(ProcessCluster, Guards.policy("hardened"), TEXTS[:2] + [long] + TEXTS[2:])
    assert "larger than node prefill0's KV pool" in str(reqs2[2].error)


def test_a_prefill_process_that_cannot_start_is_a_clear_error_and_leaves_nothing_behind():
    model, tok = load_model("recall")
    pre, dec = cfgs(model)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with pytest.raises(KvledgerError, match="prefill node prefill0 failed to start: .*unknown model"):
        ProcessCluster(model, tok, pre, dec, Guards.policy("hardened"), model_spec="/nonexistent/model")
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ours = f"kvledger-pool-{os.getpid()}-"          # /dev/shm may be shared with other processes' pools
    assert not {f for f in after - before if f.startswith(ours)}


def test_an_abort_holds_decode_pages_until_the_prefill_process_acknowledges_it():
    model, tok = load_model("recall")
    pre, dec = cfgs(model)
    cl = ProcessCluster(model, tok, pre, dec, Guards.policy("hardened"))
    try:
        reqs = [cl.submit(t, SamplingParams(max_tokens=16), tenant, prefill_node=0) for tenant, t in TEXTS]
        gone = reqs[1]
        cl.abort(gone, "client disconnected")
        assert gone.finish_reason == "abort"
        held = [h for h in cl.holds if h.incarnation == gone.incarnation]
        assert held and held[0].held.pages, "the child may still be writing: decode holds the pages"
        cl.run_until_done()
        assert cl.holds == []
    finally:
        cl.close()
    assert all(r.error is None for r in reqs if r is not gone)
    assert all(f == t for f, t in cl.free_pages().values()), cl.free_pages()


def test_glm53_across_processes_forensics_equal_the_oracle(tmp_path):
    from engine.replay.glm53 import glm53
    from forensics.queries.duckdb import Forensics
    from tests.conftest import GLM53_SMALL
    res = glm53("vulnerable", processes=True, recorder=recording(str(tmp_path), flush_interval=0.2), **GLM53_SMALL)
    truth = {tuple(e) for ex in res.exposures.values() for e in ex if e.donor != e.response}
    assert truth and res.pages_balanced, res.free_pages
    fx = Forensics(tmp_path)
    slots = fx.exposure_slots()
    assert set(zip(slots["response"], slots["donor"], slots["node"], slots["page"], slots["position"])) == truth
    assert set(fx.query("preflight")["node"]) == {"prefill0", "prefill1-canary", "decode0"}


HOLDER = """
import sys, time
from engine.disagg.cluster import Guards
from engine.models import load_model
from engine.disagg.procs import ProcessCluster
from tests.test_procs import cfgs
model, tok = load_model("recall")
pre, dec = cfgs(model)
cl = ProcessCluster(model, tok, pre, dec, Guards.policy("hardened"))
print(cl.shared_path, *[r.proc.pid for r in cl._remotes], flush=True)
time.sleep(600)
"""


def test_kill_9_of_a_process_run_leaves_no_child_and_no_pool_file():
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    path, *children = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(Path(f"/proc/{c}").exists() and "Z" not in
                                         Path(f"/proc/{c}/stat").read_text().split()[2] for c in children):
        time.sleep(0.1)
    alive = [c for c in children if Path(f"/proc/{c}").exists() and "Z" not in Path(f"/proc/{c}/stat").read_text().split()[2]]
    assert children and not alive, "prefill processes die with the router"
    # the pool file was unlinked as soon as every child had mapped it: kill -9 leaves nothing behind
    # (a file an older build left is still reaped by the next start: reap_stale_pools)
    assert not os.path.exists(path), "the shared pool outlived a kill -9"
