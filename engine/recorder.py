"""What the engine tells a recorder, from its real read and write paths (contract).

The engine calls these at the exact points where things happen; ``telemetry.Telemetry`` turns
them into spans, metrics and page-ledger rows. The base class records nothing, so an engine
without telemetry pays a method call per step and nothing per read.

Every call hands over the engine's own state (the StepOutput tensors the attention op used, the
block table being released, the transfer's slot sets) - a recorder never recomputes or guesses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from engine.llm import LLMEngine
    from engine.request import Request
    from engine.runner import StepOutput


class TransferRecord(NamedTuple):
    transfer_id: int
    seq: int                     # transfer sequence number on the source node
    incarnation: int
    src_node: str
    dst_node: str
    reserved: torch.Tensor       # logical positions decode reserved
    sent: torch.Tensor           # logical positions prefill sent
    landed: torch.Tensor         # logical positions whose records landed
    landed_lclock: torch.Tensor  # receiver's logical clock when each landed
    landed_pages: torch.Tensor   # where each landed
    landed_offsets: torch.Tensor
    landed_gen: torch.Tensor     # the destination page's generation when it landed
    landed_tags: torch.Tensor    # the content tags inside the landed records
    landed_writers: torch.Tensor
    checksum_src: str
    checksum_dst: str | None     # None: decode did not verify
    outcome: str                 # admitted | rejected: <reason> | abandoned: <reason>
    submitted_at: float          # perf_counter seconds
    landed_at: float


class LandedRecords(NamedTuple):
    """One landed call of a KV transfer: the records it wrote into the receiver's pool, as they
    landed (reported when it lands, before the receiver's next step can read them - not when the
    whole transfer completes)."""
    incarnation: int             # the receiving request
    positions: torch.Tensor      # logical positions whose records landed in this call
    lclock: torch.Tensor         # receiver's logical clock when each landed
    generation: torch.Tensor     # the destination page's generation when it landed
    tags: torch.Tensor           # the content tags inside the landed records
    writers: torch.Tensor
    pages: torch.Tensor          # where each landed
    offsets: torch.Tensor


class Recorder:
    """No-op recorder; subclasses override what they record."""

    def node_started(self, engine: "LLMEngine") -> None:
        """Once per node, after its pool is sized (config snapshot, preflight)."""

    def request_arrived(self, engine: "LLMEngine", req: "Request") -> None:
        """A request (incarnation) was accepted by a node; called before any page is taken for it."""

    def step(self, engine: "LLMEngine", out: "StepOutput") -> None:
        """After a model step: the slots it wrote and everything its attention read."""

    def pages_moved(self, engine: "LLMEngine", req: "Request", path: str, pages: list[int],
                    positions: torch.Tensor) -> None:
        """Records copied by a path other than a model step: offload (host pages), reload."""

    def pages_released(self, engine: "LLMEngine", req: "Request", pages: list[int], kind: str = "immediate",
                       ended_by: str = "immediate", hold_ns: int = 0) -> None:
        """A request's device pages went back to the free list."""

    def pages_held(self, engine: "LLMEngine", req: "Request", pages: list[int], why: str) -> None:
        """A deferred release started holding ``pages`` (an in-flight copy may still touch them)."""

    def records_landed(self, engine: "LLMEngine", landed: LandedRecords) -> None:
        """One call of a KV transfer wrote records into ``engine``'s pool (on the link's thread,
        while the engine waits for the link's tick)."""

    def transfer_landed(self, engine: "LLMEngine", rec: TransferRecord) -> None:
        """A KV transfer's writes drained into ``engine``'s pool, and decode's verdict on it."""

    def guard_checked(self, engine: "LLMEngine", guard: str, failed: bool, count: int = 1) -> None:
        """A guard ran ``count`` checks (liveness: a guard that is on but never runs is visible)."""

    def rejected(self, engine: "LLMEngine", req: "Request", where: str, error: BaseException) -> None:
        """A request was rejected at the router, a prefill node or decode, with its original error."""

    def request_finished(self, engine: "LLMEngine", req: "Request") -> None:
        """The request reached a terminal state on ``engine``."""

    def close(self) -> dict | None:
        """Flush everything (clean shutdown); a recorder that writes a store returns its counts."""


NULL_RECORDER = Recorder()


class RunRecorder(Protocol):
    """A recorder that writes one run into a store (``telemetry.Telemetry``): what the server and
    the replays read back from it besides the contract above."""
    boot: str                                       # this run's boot id (every row it writes carries it)

    def pseudonym(self, name: str) -> str:
        """The keyed pseudonym the store knows ``name`` (a tenant, a scope) by."""

    def guard_tallies(self) -> dict[str, dict[tuple[str, str], int]]:
        """node -> (guard, "pass" | "fail") -> checks run so far."""

    @property
    def spans_unexported(self) -> int:
        """Spans ended and not (yet) in the store."""

    def close(self) -> dict:
        """Flush and seal; the run's counts (segments, rows, spans exported and dropped)."""


class RecorderFactory(Protocol):
    """Opens a run's recorder once the caller knows its labels: what a command hands the engine
    (``telemetry.recorder.recording(store)``) so that the engine never builds telemetry itself."""

    def __call__(self, *, policy: str, guards: dict[str, bool], model_name: str,
                 isolation_level: str = "tenant") -> "Recorder":
        ...
