"""``kvledger replay``: the GLM-5.3 incident, or one fault of its bug family, judged by the oracle."""
from __future__ import annotations

from dataclasses import dataclass

from engine.commands.options import DEFAULT_STORE, add_store, check_writable_store
from engine.config import decode_path
from engine.errors import InputError

MAX_REPLAY_CONTEXT = 131_072
GLM53_DEFAULTS = {"mode": "disaggregated", "context_length": 1024, "victims": 4, "max_tokens": 160}


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    scenario: str | None
    list_only: bool = False
    policy: str = "vulnerable"
    mode: str = "disaggregated"
    processes: bool = False
    trigger: bool = True
    store: str | None = DEFAULT_STORE            # None: record nothing
    seed: int = 0
    context_length: int = 1024
    victims: int = 4
    max_tokens: int = 160
    format: str = "text"


def add_arguments(r) -> None:
    r.add_argument("scenario", nargs="?", help="scenario name; --list names them")
    r.add_argument("--list", action="store_true", help="list the scenarios")
    r.add_argument("--policy", choices=["vulnerable", "hardened"], default="vulnerable",
                   help="vulnerable (default: the incident's engine, guards off) or hardened (every guard on)")
    r.add_argument("--mode", choices=["disaggregated", "unified"], default=None,
                   help="glm53: disaggregated (default) or unified; each fault scenario has its own mode")
    r.add_argument("--processes", action="store_true",
                   help="glm53: each prefill node is its own OS process writing KV into decode's pool through shared memory")
    r.add_argument("--no-trigger", action="store_true",
                   help="fault scenarios: the same workload without the triggering event (expect zero exposures)")
    add_store(r, "where spans, metrics and the page ledger land")
    r.add_argument("--no-store", action="store_true", help="record nothing (the oracle still judges the run)")
    r.add_argument("--seed", type=int, default=0,
                   help="seeds the traffic, the canaries and the oracle: the same seed replays the same run (default 0)")
    r.add_argument("--context-length", type=int, default=None,
                   help="glm53: scaled context, 256..131072 (default 1024); pools keep the incident's ratio")
    r.add_argument("--victims", type=int, default=None, help="glm53: prompts longer than the small prefill pool (default 4)")
    r.add_argument("--max-tokens", type=int, default=None, help="glm53: tokens each over-pool request generates (default 160)")
    r.add_argument("--format", choices=["text", "json"], default="text",
                   help="text (default): the tables; json: one object - pools, every request's outcome and the "
                        "donors it read (by the oracle), canaries, free pages, what reached the store")


def make_config(a) -> ReplayConfig:
    decode_path()                   # KVLEDGER_DECODE_KERNEL checked before anything is loaded
    from engine.replay import FAULTS, MODES, SCENARIOS
    known = {**SCENARIOS, **FAULTS}
    if a.list:
        return ReplayConfig(None, list_only=True)
    if a.scenario is None:
        raise InputError("replay needs a SCENARIO (see kvledger replay --list)")
    if a.scenario not in known:
        raise InputError(f"unknown scenario {a.scenario!r}; known: {', '.join(known)}")
    if not 0 <= a.seed < 1 << 63:
        raise InputError(f"--seed must be in [0, 2**63), got {a.seed}")
    if not a.no_store:
        check_writable_store(a.store)
    store = None if a.no_store else a.store
    if a.scenario in FAULTS:
        given = [f for f, v in (("--context-length", a.context_length), ("--victims", a.victims),
                                ("--max-tokens", a.max_tokens)) if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} apply to glm53 only; fault scenario {a.scenario} replays a fixed "
                             "workload (its triggering event is --no-trigger's switch)")
        mode = MODES[a.scenario]
        if a.mode not in (None, mode):
            raise InputError(f"scenario {a.scenario} runs in {mode} mode only (got --mode {a.mode})")
        return ReplayConfig(a.scenario, policy=a.policy, mode=mode, trigger=not a.no_trigger, store=store, seed=a.seed,
                            format=a.format)
    d = GLM53_DEFAULTS
    c = ReplayConfig(a.scenario, policy=a.policy, mode=a.mode or d["mode"], processes=a.processes, store=store,
                     seed=a.seed, context_length=d["context_length"] if a.context_length is None else a.context_length,
                     victims=d["victims"] if a.victims is None else a.victims,
                     max_tokens=d["max_tokens"] if a.max_tokens is None else a.max_tokens, format=a.format)
    _check_glm53(c, a.no_trigger)
    return c


def _check_glm53(c: ReplayConfig, no_trigger: bool) -> None:
    if not 256 <= c.context_length <= MAX_REPLAY_CONTEXT:
        raise InputError(f"--context-length must be in [256, {MAX_REPLAY_CONTEXT}] for a replay on this machine, "
                         f"got {c.context_length}")
    if not 0 <= c.victims <= 1024:
        raise InputError(f"--victims must be >= 0 and at most 1024, got {c.victims}")
    if c.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {c.max_tokens}")
    room = c.context_length - round(c.context_length * 681_280 / 1_048_576) - 24
    if c.victims and c.max_tokens >= room:
        raise InputError(f"--max-tokens {c.max_tokens} leaves no room for a prompt longer than the small prefill pool "
                         f"within context {c.context_length}: it must be < {room}")
    if c.processes and c.mode != "disaggregated":
        raise InputError("--processes runs prefill nodes as their own processes: it needs --mode disaggregated")
    if no_trigger:
        raise InputError("--no-trigger applies to the fault scenarios; glm53's trigger is its over-pool prompts "
                         "(--victims 0)")


def run(c: ReplayConfig) -> int:
    from engine.commands import replay_view as view
    from engine.replay import FAULTS, SCENARIOS
    if c.list_only:
        for name, what in {**SCENARIOS, **FAULTS}.items():
            print(f"{name}\t{what}")
        return 0
    recorder = None
    if c.store is not None:
        from telemetry.recorder import recording
        recorder = recording(c.store)
    if c.scenario in FAULTS:
        from engine.replay import run_fault
        res = view.with_progress(f"replaying {c.scenario} ({c.policy}, {c.mode})", lambda progress: run_fault(
            c.scenario, c.policy, seed=c.seed, trigger=c.trigger, recorder=recorder, progress=progress), unit="steps")
        view.print_json(res, c.store) if c.format == "json" else view.print_fault(res, c.store)
        return 0
    from engine.replay import glm53
    res = view.with_progress(f"replaying {c.scenario} ({c.policy}, {c.mode})", lambda progress: glm53(
        c.policy, c.mode, seed=c.seed, context=c.context_length, victims=c.victims, max_tokens=c.max_tokens,
        progress=progress, recorder=recorder, processes=c.processes))
    view.print_json(res, c.store) if c.format == "json" else view.print_glm53(res, c.store)
    return 0
