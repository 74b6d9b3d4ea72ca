"""Replay scenarios. ``glm53``: the GLM-5.3 incident, scaled to this machine.

Scale: context 1,048,576 / prefill pool 681,280 tokens (ratio 0.6497) becomes context C /
pool round(0.6497 C) on the smaller prefill node; a "canary" prefill node has a pool >= C (in the
incident it was unaffected, which is how the root cause was found). Several tenants send
background traffic (recall model, text from Python's own ``pydoc_data.topics``, one unguessable
canary in every other prompt, well under 1 % of bytes); a few prompts are longer than the small
prefill pool but within the context.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.disagg.cluster import DisaggCluster, Guards
from engine.errors import KvledgerError, ReadCheckViolation
from engine.llm import LLMEngine
from engine.recorder import RecorderFactory
from engine.models import load_model
from engine.replay.oracle import Exposure, Oracle
from engine.kv.pool import KVPool
from engine.request import Request, SamplingParams
from engine.tags import TagChain

def judge_blocked(oracle: Oracle, reqs: list[Request]) -> dict[int, list[Exposure]]:
    """The oracle's verdict on requests the read check stopped: what they read of others' KV first."""
    return {r.incarnation: oracle.exposures(r) for r in reqs if isinstance(r.error, ReadCheckViolation)}


INCIDENT_CONTEXT, INCIDENT_POOL = 1_048_576, 681_280
SCENARIOS = {"glm53": "the GLM-5.3 reject path: over-pool prompts get a placeholder, decode reads stale pages"}


@dataclass
class ReplayResult:
    policy: str
    mode: str
    context: int
    pools: dict[str, int]
    requests: list[Request]
    over_pool: list[Request]
    exposures: dict[int, list[Exposure]]         # served requests: what each read of others' KV (oracle)
    canaries: dict[str, str]                     # canary -> owning tenant
    pages_balanced: bool = False                 # every pool's free count back to its initial value
    surfaced: list[tuple[int, str, str]] = field(default_factory=list)   # (incarnation, reader tenant, canary)
    telemetry: dict | None = None                # the recorder's close() counts when a store was written
    free_pages: dict[str, tuple[int, int]] = field(default_factory=dict)   # node -> (free, total) at the end
    scenario: str = "glm53"
    affected: list[Request] = field(default_factory=list)   # the requests the triggering event targets
    triggered: bool = True
    # requests the read check stopped (ReadCheckViolation): what they read before it did, by the
    # same oracle - blocked reads, never exposures (they returned nothing)
    blocked: dict[int, list[Exposure]] = field(default_factory=dict)

    @property
    def readers_of_foreign(self) -> dict[int, set[int]]:
        """incarnation -> donors (other incarnations, or -1: bytes nobody wrote) it read, by the oracle."""
        out = {}
        for inc, ex in self.exposures.items():
            donors = {e.donor for e in ex} - {inc}
            if donors:
                out[inc] = donors
        return out

    @property
    def exposure_set(self) -> set[Exposure]:
        """Every (response, donor, node, page, position) a served response read of others' KV."""
        return {e for ex in self.exposures.values() for e in ex if e.donor != e.response}

    @property
    def blocked_set(self) -> set[Exposure]:
        """The same, for what requests stopped by the read check had read before it stopped them."""
        return {e for ex in self.blocked.values() for e in ex if e.donor != e.response}

    @property
    def foreign_readers(self) -> list[Request]:
        return [r for r in self.requests if any(e.donor != r.incarnation for e in self.exposures.get(r.incarnation, []))]


def background_traffic(rng: random.Random, n: int, lo: int, hi: int, canaries: dict[str, str], tenants: list[str],
                token=None):
    # canaries come from the replay's seeded generator: the same --seed replays the same texts (and
    # the same oracle verdict); a different seed gives canaries nobody can guess from another run's
    token = token or (lambda: f"{rng.getrandbits(40):010x}")
    from pydoc_data.topics import topics
    texts = [t for t in topics.values() if len(t) > hi]
    out = []
    for i in range(n):
        tenant = tenants[i % len(tenants)]
        t = rng.choice(texts)
        start = rng.randrange(0, len(t) - hi)
        body = t[start:start + rng.randrange(lo, hi)].encode("ascii", "replace").decode()
        if i % 2 == 0:
            canary = "CANARY-" + token()
            canaries[canary] = tenant
            cut = len(body) // 2
            body = body[:cut] + f" the secret is {canary}; " + body[cut:]
        out.append((tenant, body))
    return out


def glm53(policy: str = "vulnerable", mode: str = "disaggregated", seed: int = 0, context: int = 1024,
          victims: int = 3, background: int = 12, max_tokens: int = 96, progress=None,
          guards: Guards | None = None, recorder: RecorderFactory | None = None, processes: bool = False,
          tenants: tuple[str, ...] = ("acme", "globex", "initech")) -> ReplayResult:
    """Run the scaled incident. With ``recorder`` (e.g. ``telemetry.recording(store)``), every node
    records spans, metrics and the page ledger through the recorder it opens (protection and
    recording are separate: both policies record). ``processes``:
    each prefill node is its own OS process writing into decode's pool through shared memory.
    ``tenants``: who sends the background traffic (the over-pool prompts are tenant umbrella's)."""
    guards = guards or Guards.policy(policy)
    if mode not in ("disaggregated", "unified"):
        raise KvledgerError(f"unknown mode {mode!r}: expected 'disaggregated' or 'unified'")
    if processes and mode != "disaggregated":
        raise KvledgerError("processes=True needs mode 'disaggregated' (prefill nodes in their own processes)")
    model, tok = load_model("recall")
    page = 16
    pb = KVPool.page_bytes_for(model.num_layers, model.kv_dim, page)
    small = round(context * INCIDENT_POOL / INCIDENT_CONTEXT)
    cfg = lambda tokens, node: EngineConfig(kv_memory_budget=(tokens // page) * pb, page_size=page,  # noqa: E731
                                            context_length=context, node_id=node, max_num_seqs=8,
                                            check_reads=True, fail_on_violation=guards.read_check,
                                            preflight="fit" if guards == Guards.policy("hardened") else "record")
    rng = random.Random(seed)
    canaries: dict[str, str] = {}
    tenants = list(tenants)
    traffic = background_traffic(rng, background, small // 2, int(small * 0.95), canaries, tenants)
    long_ones = [("umbrella", background_traffic(rng, 1, small + page, context - max_tokens - 8, {}, ["x"])[0][1])
                 for _ in range(victims)]
    # waves: background first (cycles the decode pool), then long prompts mixed with the rest
    waves = [traffic[: background // 2], traffic[background // 2:] + long_ones]
    oracle = Oracle(model, seed)
    tel = None
    if recorder is not None:
        from dataclasses import asdict
        tel = recorder(policy=policy if guards == Guards.policy(policy) else "custom", model_name="recall",
                       guards=asdict(guards) if mode == "disaggregated" else {"read_check": guards.read_check})
    reqs: list[Request] = []
    over: list[Request] = []
    if progress:
        progress(0, total=sum(len(w) for w in waves))      # finished requests of how many
    if mode == "unified":
        nodes, pools = _unified(model, tok, cfg, small, waves, oracle, tel, max_tokens, progress, reqs, over)
    else:
        nodes, pools = _disaggregated(model, tok, cfg, small, context, guards, waves, oracle, tel, max_tokens,
                                      progress, processes, reqs, over)
    free = {n.cfg.node_id: (n.allocator.num_free, n.allocator.total) for n in nodes}
    balanced = all(f == t for f, t in free.values())
    exposures = {r.incarnation: oracle.exposures(r) for r in reqs if r.error is None}
    res = ReplayResult(policy, mode, context, pools, reqs, over, exposures, canaries, balanced, free_pages=free,
                       blocked=judge_blocked(oracle, reqs))
    if tel is not None:
        res.telemetry = tel.close()
    for r in reqs:
        text = tok.decode(r.output_ids)
        for c, owner in canaries.items():
            if c in text and owner != r.tenant:
                res.surfaced.append((r.incarnation, r.tenant, c))
    return res


def _unified(model, tok, cfg, small: int, waves, oracle, tel, max_tokens: int, progress, reqs, over) -> tuple[list, dict]:
    """One node: the over-pool prompts get the node's error (admission, or the pool check)."""
    eng = LLMEngine(model, tok, cfg(small, "unified0"), recorder=tel)
    eng.observers.append(oracle.observe_step)
    pools = {"unified0": eng.pool.capacity_tokens}
    for wave in waves:
        for tenant, text in wave:
            sp = SamplingParams(max_tokens=max_tokens if tenant == "umbrella" else 8)
            try:
                r = eng.new_request(text, sp, tenant)
                error = None
            except KvledgerError as e:          # e.g. hardened fitted the context to the pool: longer than it
                r = Request(tok.encode(text), sp, tenant, eng.scope_for(tenant), TagChain(b"rejected"),
                            prompt_tokens_billed=len(tok.encode(text)))
                error = e
            try:
                if error is not None:
                    raise error
                eng.check_fits_pool(len(r.prompt_ids))
                eng.enqueue(r)
            except KvledgerError as e:          # unified: the over-pool prompt gets its error
                eng.rec.request_arrived(eng, r)
                eng.rec.rejected(eng, r, f"admission:{eng.cfg.node_id}", e)
                r.fail(e)
            reqs.append(r)
            over += [r] if len(r.prompt_ids) > eng.pool.capacity_tokens else []
        eng.run_until_done(progress)
    nodes = [eng]
    return nodes, pools


def _disaggregated(model, tok, cfg, small: int, context: int, guards, waves, oracle, tel, max_tokens: int, progress,
                   processes: bool, reqs, over) -> tuple[list, dict]:
    """A small prefill node (the incident's pool), a canary prefill node and a decode node: the
    over-pool prompts go through the small one, half the background through each."""
    if processes:
        from engine.disagg.procs import ProcessCluster as Cluster
    else:
        Cluster = DisaggCluster   # noqa: N806
    cluster = Cluster(model, tok, [cfg(small, "prefill0"), cfg(2 * context, "prefill1-canary")],
                      cfg(2 * context, "decode0"), guards, recorder=tel)
    for n in cluster.nodes:
        n.observers.append(oracle.observe_step)
    cluster.landing_observers.append(oracle.observe_landing)
    pools = {n.cfg.node_id: n.pool.capacity_tokens for n in cluster.nodes}
    reported = 0                    # finished requests the progress bar has been told of
    for wave in waves:
        for i, (tenant, text) in enumerate(wave):
            sp = SamplingParams(max_tokens=max_tokens if tenant == "umbrella" else 8)
            node = 0 if tenant == "umbrella" or i % 2 == 0 else 1
            r = cluster.submit(text, sp, tenant, prefill_node=node)   # a rejection comes back failed
            reqs.append(r)
            over += [r] if len(r.prompt_ids) > cluster.prefills[node].pool.capacity_tokens else []
        while cluster.has_work():
            cluster.step()
            if progress:
                finished = sum(r.is_finished for r in reqs)
                progress(finished - reported)
                reported = finished
    cluster.close()
    nodes = cluster.nodes
    return nodes, pools
