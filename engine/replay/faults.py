"""The rest of the GLM-5.3 bug family (faults 2-7), one replay each.

Each scenario runs real multi-tenant traffic through the engine and fires one triggering event:
memory pressure, a client abort, a link failure, a delayed pull, a client reusing its request id.
The fault itself is the deviation the engine's lifecycle code takes when the guard that exists to
prevent it is off (``engine/disagg/cluster.py``, ``engine/kv/block_manager.py``: search "Deviation (fault
N)"). Nothing writes into anyone's page except the engine's own copy paths (model steps, the KV
link, the host DMA). ``trigger=False`` runs the same workload without the event.

Scale: page 16 tokens, context 1024; pools are sized so that pages are reused quickly (a fault
only leaks when freed pages are handed on before the stale copy lands), as on a busy server.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import asdict

from engine.config import EngineConfig
from engine.disagg.cluster import DisaggCluster, Guards, LinkConfig
from engine.errors import InputError
from engine.llm import LLMEngine
from engine.recorder import RecorderFactory
from engine.models import load_model
from engine.replay.oracle import Oracle
from engine.kv.pool import KVPool
from engine.request import Request, SamplingParams, Status
from engine.replay.glm53 import ReplayResult, background_traffic, judge_blocked

PAGE, CONTEXT = 16, 1024

FAULTS = {
    "offload_race": "fault 2: a page freed while its host offload is in flight; the preempted request reloads "
                    "another request's KV (unified)",
    "late_write": "fault 3: a client aborts during prefill; the transfer still lands, in decode pages already "
                  "given to another request",
    "double_free": "fault 4: a link failure's error path frees decode pages twice; two requests get the same page",
    "lease_expiry": "fault 5: decode's pull is delayed past prefill's lease; prefill frees and reuses the source "
                    "pages before the pull reads them",
    "transfer_id_reuse": "fault 6: a client reuses its request id while the first is in flight; the second transfer "
                         "is never registered and its source pages are never released (capacity lost, nothing read)",
    "release_timeout": "fault 7: a client aborts mid-transfer; the deferred release times out before one unbounded "
                       "transfer call lands",
}
MODES = {name: "unified" if name == "offload_race" else "disaggregated" for name in FAULTS}


class _Replay:
    """Model, oracle, optional telemetry and tenant text shared by the fault scenarios."""

    def __init__(self, name: str, policy: str, guards: Guards | None, seed: int, recorder: RecorderFactory | None,
                 canary_key: bytes | None):
        self.name, self.policy = name, policy
        self.guards = guards or Guards.policy(policy)
        self.model, self.tok = load_model("recall")
        self.page_bytes = KVPool.page_bytes_for(self.model.num_layers, self.model.kv_dim, PAGE)
        self.oracle = Oracle(self.model, seed)
        self.rng = random.Random(seed)
        # seed 0 is the documented layout; any other seed also varies the layout (prompt and answer
        # lengths) within what keeps each scenario's race possible (n below)
        self.shape = random.Random(f"kvledger-layout/{seed}") if seed else None
        self.canaries: dict[str, str] = {}
        # canaries are keyed by a secret derived from the seed (the same --seed replays the same texts
        # and verdict); pass a key to replay the same texts with and without the triggering event
        self._canary_key = canary_key or hashlib.blake2b(f"kvledger-canary/{seed}".encode(), digest_size=16).digest()
        self._canary_no = itertools.count()
        self.tel = None
        if recorder is not None:
            label = policy if self.guards == Guards.policy(policy) else "custom"
            guards = asdict(self.guards) if MODES[name] == "disaggregated" else {
                g: getattr(self.guards, g) for g in ("read_check", "deferred_release", "double_free_check")}
            self.tel = recorder(policy=label, model_name="recall", guards=guards)

    def cfg(self, tokens: int, node: str, **kw) -> EngineConfig:
        return EngineConfig(kv_memory_budget=tokens // PAGE * self.page_bytes, page_size=PAGE, context_length=CONTEXT,
                            node_id=node, max_num_seqs=8, check_reads=True, **kw)

    def n(self, base: int, more: int) -> int:
        """``base`` tokens, or (a seed other than 0) up to ``more`` more: growing only, so a pool each
        scenario overfills stays overfilled."""
        return base if self.shape is None else base + self.shape.randint(0, more)

    def text(self, tenant: str, tokens: int) -> str:
        """Prose of exactly ``tokens`` tokens (byte tokenizer) from ``tenant``, with a canary inside."""
        body = background_traffic(self.rng, 1, tokens, tokens + 1, self.canaries, [tenant], self._canary)[0][1]
        return (body * (tokens // max(len(body), 1) + 1))[:tokens]

    def _canary(self) -> str:
        return hashlib.blake2b(str(next(self._canary_no)).encode(), key=self._canary_key, digest_size=5).hexdigest()

    def cluster(self, prefill_tokens: list[int], decode_tokens: int, link: LinkConfig) -> DisaggCluster:
        names = [f"prefill{i}" for i in range(len(prefill_tokens))]
        cl = DisaggCluster(self.model, self.tok, [self.cfg(t, n) for t, n in zip(prefill_tokens, names)],
                           self.cfg(decode_tokens, "decode0"), self.guards, link=link, recorder=self.tel)
        for n in cl.nodes:
            n.observers.append(self.oracle.observe_step)
        cl.landing_observers.append(self.oracle.observe_landing)
        return cl

    def result(self, nodes: list[LLMEngine], reqs: list[Request], affected: list[Request], triggered: bool) -> ReplayResult:
        free = {n.cfg.node_id: (n.allocator.num_free, n.allocator.total) for n in nodes}
        pools = {n.cfg.node_id: n.pool.capacity_tokens for n in nodes}
        exposures = {r.incarnation: self.oracle.exposures(r) for r in reqs if r.error is None}
        res = ReplayResult(self.policy, MODES[self.name], CONTEXT, pools, reqs, [], exposures, self.canaries,
                           all(f == t for f, t in free.values()), free_pages=free, scenario=self.name,
                           affected=affected, triggered=triggered, blocked=judge_blocked(self.oracle, reqs))
        if self.tel is not None:
            res.telemetry = self.tel.close()
        for r in reqs:
            out = self.tok.decode(r.output_ids)
            res.surfaced += [(r.incarnation, r.tenant, c) for c, owner in self.canaries.items()
                             if c in out and owner != r.tenant]
        return res


def _drive(cl: DisaggCluster, event, progress=None, max_steps: int = 5000) -> None:
    """Step the cluster; ``event(cl)`` runs after every step until it returns True (fired)."""
    fired = event is None
    for _ in range(max_steps):
        if not cl.has_work():
            break
        cl.step()
        if not fired:
            fired = bool(event(cl))
        if progress:
            progress(1)
    else:
        raise RuntimeError(f"replay did not finish in {max_steps} cluster steps")
    cl.close()


def _submit(cl: DisaggCluster, items) -> list[Request]:
    return [cl.submit(text, SamplingParams(max_tokens=mt), tenant, prefill_node=node, rid=rid)
            for tenant, text, mt, node, rid in items]


# ---- faults 3 and 7: a client abort while decode's pages are (or will be) written ------------------
def _abort_race(rp: _Replay, trigger: bool, on_wire: bool, progress=None) -> ReplayResult:
    """A (acme, 760 tokens) fills most of decode's pool; B (initech) waits for decode pages. The
    client of A disconnects - during A's prefill (fault 3) or once A's transfer is on the wire
    (fault 7). B gets A's pages; whatever of A's transfer lands afterwards lands in B's KV."""
    cl = rp.cluster([1024, 1024], 1024, LinkConfig(slots_per_tick=64, batch_slots=64, release_timeout_ticks=4))
    reqs = _submit(cl, [("globex", rp.text("globex", rp.n(200, 60)), rp.n(40, 16), 1, ""),
                        ("acme", rp.text("acme", rp.n(760, 40)), 8, 0, ""),
                        ("initech", rp.text("initech", rp.n(300, 40)), rp.n(48, 16), 1, "")])
    a = reqs[1]

    def event(cl: DisaggCluster) -> bool:
        half = cl.halves.get(a.incarnation)
        if half is None:
            return False
        # fault 7: A's transfer has started and not finished; fault 3: A is still being prefilled
        ready = (half.job is not None and half.job.started) if on_wire else (
            half.job is None and half.preq.status is Status.PREFILLING)
        if ready:
            cl.abort(a, "client disconnected")
        return ready

    _drive(cl, event if trigger else None, progress)
    return rp.result(cl.nodes, reqs, [a], trigger)


def late_write(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    return _abort_race(rp, trigger, on_wire=False, progress=progress)


def release_timeout(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    return _abort_race(rp, trigger, on_wire=True, progress=progress)


# ---- fault 4: the link fails A's transfer; its error path releases twice ----------------------------
def double_free(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    """A (acme) holds most of decode's pool; B, C and D (three tenants) wait for decode pages.
    The link fails A's transfer before its first call lands. Unchecked, A's pages enter the free list
    twice: D is given pages B already holds, and one overwrites the other's KV."""
    cl = rp.cluster([1024, 1024], 1024, LinkConfig(slots_per_tick=64, batch_slots=64, release_timeout_ticks=4))
    reqs = _submit(cl, [("globex", rp.text("globex", rp.n(200, 60)), rp.n(40, 16), 1, ""),
                        ("acme", rp.text("acme", rp.n(760, 40)), 8, 0, "")]
                   + [(t, rp.text(t, rp.n(300, 40)), rp.n(32, 16), 1, "") for t in ("initech", "globex", "umbrella")])
    a = reqs[1]
    if trigger:
        cl.fail_transfer(a, after_calls=0)
    _drive(cl, None, progress)
    return rp.result(cl.nodes, reqs, [a], trigger)


# ---- fault 5: decode pulls late; prefill's lease on the source pages has ended ----------------------
def lease_expiry(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    """A (acme) and C (globex) share a small prefill pool; C waits for A's pages. Decode pulls KV
    (NIXL-style) and prefill keeps the source pages for a 3-tick lease. Decode's pull of A is
    delayed 5 ticks: unguarded, the lease frees A's source pages, C's prefill writes into them,
    and the pull then reads C's KV into A's decode pages."""
    cl = rp.cluster([512, 1024], 2048, LinkConfig(slots_per_tick=64, batch_slots=64, release_timeout_ticks=4,
                                                  prefill_lease_ticks=3))
    reqs = _submit(cl, [("acme", rp.text("acme", rp.n(400, 48)), rp.n(24, 8), 0, ""),
                        ("globex", rp.text("globex", rp.n(400, 48)), rp.n(24, 8), 0, ""),
                        ("initech", rp.text("initech", rp.n(300, 60)), rp.n(24, 8), 1, "")])
    a = reqs[0]
    if trigger:
        cl.link.stall("prefill0", 5)              # decode's pulls from prefill0 are delayed 5 ticks
    _drive(cl, None, progress)
    return rp.result(cl.nodes, reqs, [a], trigger)


# ---- fault 6: a client reuses its request id while the first is in flight ---------------------------
def transfer_id_reuse(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    """acme's client sends request "req-42", then retries with the same id while the first is still
    being transferred (other tenants' traffic around it). Unguarded, prefill registers transfers by
    the client's id: the retry's transfer is taken for a retransmission and never registered, and
    its source pages are never released."""
    cl = rp.cluster([1024, 1024], 2048, LinkConfig(slots_per_tick=64, batch_slots=64, release_timeout_ticks=4))
    text, answer = rp.text("acme", rp.n(400, 80)), rp.n(16, 8)
    reqs = _submit(cl, [("acme", text, answer, 0, "req-42"), ("globex", rp.text("globex", rp.n(300, 60)), answer, 1, ""),
                        ("acme", text, answer, 0, "req-42" if trigger else "req-43"),
                        ("initech", rp.text("initech", rp.n(300, 60)), answer, 1, "")])
    _drive(cl, None, progress)
    return rp.result(cl.nodes, reqs, [reqs[2]], trigger)


# ---- fault 2: host offload still reading a page that was already handed on --------------------------
def offload_race(rp: _Replay, trigger: bool, progress=None) -> ReplayResult:
    """Unified node, 40 pages. Two tenants decode long answers; a burst of two more requests
    (the trigger) runs the pool dry and the newest running request is swapped out to the host
    tier. Unguarded, its device pages go back before the offload DMA has read them; the request
    that needed a page writes into one, the DMA copies that, and the swapped request later
    reloads and reads it."""
    g = rp.guards
    eng = LLMEngine(rp.model, rp.tok, rp.cfg(640, "unified0", host_memory_budget=64 << 20,
                                             fail_on_violation=g.read_check, deferred_release=g.deferred_release,
                                             detect_double_free=g.double_free_check), recorder=rp.tel)
    eng.observers.append(rp.oracle.observe_step)
    sizes, answer = [rp.n(150, 24) for _ in range(4)], rp.n(120, 16)     # drawn alike with and without the event
    items = list(zip(("acme", "globex", "initech", "umbrella"), sizes))[: 4 if trigger else 2]
    reqs = []
    for tenant, n in items:
        r = eng.new_request(rp.text(tenant, n), SamplingParams(max_tokens=answer), tenant)
        eng.enqueue(r)
        reqs.append(r)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if progress:
            progress(1)
        if steps > 5000:
            raise RuntimeError("replay did not finish in 5000 steps")
    return rp.result([eng], reqs, [r for r in reqs if r.preemptions], trigger)


RUNNERS = {"offload_race": offload_race, "late_write": late_write, "double_free": double_free,
           "lease_expiry": lease_expiry, "transfer_id_reuse": transfer_id_reuse, "release_timeout": release_timeout}


def run_fault(name: str, policy: str = "vulnerable", seed: int = 0, trigger: bool = True, guards: Guards | None = None,
              recorder: RecorderFactory | None = None, progress=None,
              canary_key: bytes | None = None) -> ReplayResult:
    """Replay fault ``name`` under ``policy`` (or explicit ``guards``); see FAULTS."""
    if name not in RUNNERS:
        raise InputError(f"unknown fault scenario {name!r}; known: {', '.join(RUNNERS)}")
    return RUNNERS[name](_Replay(name, policy, guards, seed, recorder, canary_key), trigger, progress)
