"""Request state: one explicit state machine with a single terminal predicate.

    disaggregated: decode WAITING --bootstrap--> TRANSFERRING --KV landed--> DECODING
                   prefill PREFILLING --first token--> TRANSFERRING --drained--> FINISHED_LENGTH
    WAITING --admit--> PREFILLING --first token--> DECODING --eos/length--> FINISHED_STOPPED/LENGTH
       ^                   |  ^                       |  ^
       |                   v  |                       v  |
       +--- recompute --- (preempted)  SWAPPED <------+--+  (host tier: pages offloaded, later reloaded)
    any non-terminal state --> FINISHED_ABORTED | FINISHED_ERROR

``is_finished`` is the ONE terminal predicate: every queue and every admission check asks it,
and it reads ``status`` only - errors are never stored beside the status where a check could
miss them.
"""
from __future__ import annotations

import enum
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from engine.errors import KvledgerError

if TYPE_CHECKING:       # annotations only: the HTTP process of `kvledger serve` imports this without torch
    import torch

    from engine.tags import TagChain


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    SWAPPED = "swapped"
    TRANSFERRING = "transferring"   # disaggregated: KV in flight (prefill: pages held; decode: pages reserved)
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # members are equal only to themselves: hashed by identity in C (Enum's own __hash__ is a Python
    # call, and a step asks for a status in a set a few dozen times)
    __hash__ = object.__hash__


TERMINAL = frozenset({Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED,
                      Status.FINISHED_ERROR})
_ALLOWED = {
    Status.WAITING: {Status.PREFILLING, Status.TRANSFERRING},
    Status.PREFILLING: {Status.DECODING, Status.SWAPPED, Status.WAITING, Status.TRANSFERRING},
    Status.TRANSFERRING: {Status.DECODING, Status.FINISHED_STOPPED, Status.FINISHED_LENGTH},
    Status.DECODING: {Status.SWAPPED, Status.WAITING} | {Status.FINISHED_STOPPED, Status.FINISHED_LENGTH},
    Status.SWAPPED: {Status.PREFILLING, Status.DECODING},
}
for _s in list(_ALLOWED):
    _ALLOWED[_s] = _ALLOWED[_s] | {Status.FINISHED_ABORTED, Status.FINISHED_ERROR}


class IllegalTransition(KvledgerError):
    pass


# Incarnation ids: unique per attempt, even across processes, restarts, machines and reused client
# ids. 63 bits: a random 40-bit prefix drawn per process (and again whenever its 23-bit counter runs
# out), so ids of different boots collide only if two of their prefixes do (about n^2 / 2^41 for n
# prefixes drawn into one store: 1 in 45,000 for 10,000 restarts).
_COUNTER_BITS = 23
_ids_lock = threading.Lock()
_prefix = 0
_counter = iter(())


def _draw_prefix() -> None:
    global _prefix, _counter
    _prefix = int.from_bytes(os.urandom(5), "little") or 1
    _counter = itertools.count(1)


def new_incarnation() -> int:
    with _ids_lock:
        n = next(_counter, 1 << _COUNTER_BITS)
        if n >= 1 << _COUNTER_BITS:
            _draw_prefix()
            n = next(_counter)
        return (_prefix << _COUNTER_BITS) | n


def new_boot_id() -> str:
    """A run's id, new at every start of a deployment: 16 hex chars, the start's unix seconds (so
    ids sort by start) then 32 random bits (so two machines starting in the same second differ)."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{os.urandom(4).hex()}"


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True, eq=False)
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    tenant: str
    scope: str
    chain: TagChain
    rid: str = ""
    incarnation: int = field(default_factory=new_incarnation)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # [0, num_computed) of all_ids have K/V in the pool at block_table; page_gens[i] is the
    # generation granted for block_table[i] (the read check compares against it).
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    page_gens: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    error: BaseException | None = None
    # Where an engine without the single-terminal-predicate guard parks a rejection (SGLang's
    # set_finish_with_abort): beside the status, where `is_finished` does not look.
    to_finish: BaseException | None = None
    prompt_tokens_billed: int = 0
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    prefill_started_at: float | None = None
    prefilled_tokens: int = 0          # prompt tokens whose KV this request's own compute (or transfer) produced
    cached_tokens: int = 0             # prompt tokens served from the prefix cache (pages shared by content tag)
    transfer_started_at: float | None = None
    transfer_landed_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    on_finish: list[Callable[["Request"], None]] = field(default_factory=list)   # called once, on the terminal transition
    user: str = ""             # with tenant and cache_salt: what the scope was derived from (another node
    cache_salt: str = ""       # of the cluster derives the same scope from them)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        """The single terminal predicate."""
        return self.status in TERMINAL

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def transition(self, new: Status) -> None:
        if new not in _ALLOWED.get(self.status, ()):
            raise IllegalTransition(f"request {self.incarnation}: {self.status.name} -> {new.name} is not allowed")
        self.status = new
        if new in TERMINAL:
            self.finished_at = time.perf_counter()
            callbacks, self.on_finish = self.on_finish, []     # called once; a finished request then holds
            for callback in callbacks:                          # no reference to the engine that ran it
                callback(self)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.transition(Status.FINISHED_ERROR)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival
