"""The KV link: a worker that writes slot records (K/V + content tag + writer, one copy per call,
like one-sided RDMA writes) from a source pool into a destination pool, paced one tick per cluster
step (a call of n records takes ceil(n / slots_per_tick) ticks), so replays are reproducible."""
from __future__ import annotations

import hashlib
import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, NamedTuple

import torch

from engine.errors import KvledgerError
from engine.kv.pool import KVPool


@dataclass(slots=True, frozen=True)
class LinkConfig:
    slots_per_tick: int = 128               # link bandwidth: records per cluster step
    batch_slots: int = 128                  # records per transfer call when transfer_batch_bound is on
    release_timeout_ticks: int = 4          # a deferred release gives up after this many ticks
    prefill_lease_ticks: int | None = None  # pull model: how long prefill keeps source pages for decode

    def call_ticks(self, n: int) -> int:
        return -(-n // self.slots_per_tick)


class TransferError(KvledgerError):
    pass


def records_checksum(records: torch.Tensor) -> str:
    """BLAKE2b over slot records (K/V + tags) in logical token order."""
    return hashlib.blake2b(records.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


@dataclass(eq=False)
class TransferJob:
    transfer_id: int
    incarnation: int
    key: object                   # what the sender registers the transfer under (room, or (room, incarnation))
    src: KVPool
    dst: KVPool
    positions: torch.Tensor       # logical token positions sent, in order
    src_pages: torch.Tensor
    src_offsets: torch.Tensor
    dst_pages: torch.Tensor
    dst_offsets: torch.Tensor
    checksum_src: str
    first_token: int
    dst_clock: Callable[[], int]  # the receiver's logical clock, ticked once per landed call
    seq: int = 0                  # transfer sequence number on the source node
    src_node: str = ""
    submitted_at: float = 0.0
    batch_slots: int | None = None          # None: the whole transfer in one call (unbounded)
    lease_until: int | None = None          # link tick when the prefill lease on the source pages ends
    fail_after_calls: int | None = None     # the link fails this transfer after that many calls
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    sent: int = 0                           # positions [0, sent) were read from the source
    calls: int = 0
    landed: list = field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.calls > 0


class LinkStatus(StrEnum):
    """How a transfer left the link."""
    DRAINED = "drained"          # every call landed
    CANCELLED = "cancelled"      # stopped at a call boundary
    FAILED = "failed"            # the link failed it (its writes never reported drained)


class Completion(NamedTuple):
    job: TransferJob
    status: LinkStatus
    landed: torch.Tensor         # logical positions whose records landed
    landed_lclock: torch.Tensor  # receiver's logical clock when each landed
    landed_gen: torch.Tensor     # the destination page's generation when each landed
    landed_tags: torch.Tensor    # content tags inside the landed records
    landed_writers: torch.Tensor
    landed_pages: torch.Tensor
    landed_offsets: torch.Tensor


class Link:
    """The KV link: a worker thread performs one-sided record writes, paced by ``tick`` (one tick
    per cluster step; the caller waits for the tick's writes). Each source node has its own lane
    (its own queue pair): lanes progress side by side, one call at a time each."""

    def __init__(self, cfg: LinkConfig, observers: list):
        self.cfg = cfg
        self.now = 0
        self._lanes: dict[str, deque[TransferJob]] = {}
        self._calls: dict[str, tuple[TransferJob, slice, torch.Tensor, int]] = {}
        self._stall_until: dict[str, int] = {}
        self._observers = observers       # (job, slice of job.positions) after each landed call, on the worker
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ticks: queue.Queue[bool | None] = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kv-link", daemon=True)
        self._worker.start()

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def in_flight(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def submit(self, job: TransferJob) -> None:
        with self._lock:
            self._lanes.setdefault(job.src_node, deque()).append(job)

    def _on_wire(self, job: TransferJob) -> bool:
        call = self._calls.get(job.src_node)
        return call is not None and call[0] is job

    def cancel(self, job: TransferJob) -> Completion | None:
        """Stop sending at the next call boundary. A job with no call on the wire is removed now
        (its completion is returned); one mid-call completes as 'cancelled' when that call lands."""
        with self._lock:
            job.cancelled = True
            lane = self._lanes.get(job.src_node, deque())
            if job in lane and not self._on_wire(job):
                lane.remove(job)
                return self._complete(job, LinkStatus.CANCELLED)
        return None

    def stall(self, lane: str, ticks: int) -> None:
        """A lane makes no progress for ``ticks`` ticks (a busy NIC, a decode pull delayed)."""
        self._stall_until[lane] = self.now + ticks

    def tick(self) -> list[Completion]:
        self._ticks.put(True)
        out = self._done.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        self._ticks.put(None)

    def _run(self) -> None:
        while self._ticks.get() is not None:
            try:
                with self._lock:
                    self.now += 1
                    out = [c for lane in list(self._lanes) for c in self._advance(lane)]
            except BaseException as e:     # surfaced on the caller's thread
                out = e
            self._done.put(out)

    def _advance(self, name: str) -> list[Completion]:
        lane, out = self._lanes[name], []
        if self.now <= self._stall_until.get(name, 0):
            return out
        while name not in self._calls and lane:
            job = lane[0]
            if job.cancelled or (job.fail_after_calls is not None and job.calls >= job.fail_after_calls):
                lane.popleft()
                out.append(self._complete(job, LinkStatus.CANCELLED if job.cancelled else LinkStatus.FAILED))
                continue
            left = len(job.positions) - job.sent
            n = left if job.batch_slots is None else min(job.batch_slots, left)
            sl = slice(job.sent, job.sent + n)
            recs = job.src.read_records(job.src_pages[sl], job.src_offsets[sl]).clone()   # the source is read now
            job.sent += n
            job.calls += 1
            self._calls[name] = (job, sl, recs, self.now + self.cfg.call_ticks(n) - 1)
        call = self._calls.get(name)
        if call is not None and call[3] <= self.now:
            job, sl, recs, _ = self._calls.pop(name)
            pages, offs = job.dst_pages[sl], job.dst_offsets[sl]
            job.dst.write_records(pages, offs, recs)        # lands: K/V and tags in one copy
            n = pages.numel()
            job.landed.append((job.positions[sl], torch.full((n,), job.dst_clock(), dtype=torch.long),
                               job.dst.generation[pages].clone(), job.dst.record_tags(recs),
                               job.dst.record_writers(recs), pages, offs))
            for obs in self._observers:
                obs(job, sl)
            if job.sent == len(job.positions) or job.cancelled:
                lane.popleft()
                out.append(self._complete(job, LinkStatus.CANCELLED if job.sent < len(job.positions) else LinkStatus.DRAINED))
        return out

    @staticmethod
    def _complete(job: TransferJob, status: LinkStatus) -> Completion:
        empty = job.positions[:0]
        cols = [torch.cat([c[i] for c in job.landed]) if job.landed else empty for i in range(7)]
        return Completion(job, status, *cols)
