"""Disaggregated prefill/decode: a router, prefill nodes, a decode node and an asynchronous KV
transfer - and the SGLang (< v0.5.20) reject path that leaked other tenants' KV (GLM-5.3).

Handoff, as in SGLang: the router bootstraps decode with the prompt length, decode reserves pages
for the whole prompt; the prefill node computes KV and a worker thread writes the records (K/V +
content tag + writer, one copy per batch, like one-sided RDMA writes) into decode's reserved
slots, then signals completion; decode admits the request and generates.

Guards (each a switch; `hardened` turns on all, `vulnerable` none):
    terminal_predicate      a rejection sets the status (is_finished) - not a field beside it
    reject_before_bootstrap the router asks the prefill node's limits before decode reserves anything
    landed_set_check        decode admits only if the landed slot set equals the reserved set
    checksum                decode verifies the sender's checksum (logical token order) before generating
    read_check              the read-time provenance check fails the reader (recording is always on)
"""
from __future__ import annotations

import hashlib
from collections import deque
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from engine.config import EngineConfig
from engine.errors import InputError, KvledgerError, OutOfPages
from engine.llm import LLMEngine
from engine.pool import KVPool
from engine.recorder import NULL_RECORDER, Recorder, TransferRecord
from engine.request import Request, SamplingParams, Status

PLACEHOLDER_TOKEN = 0   # what set_finish_with_abort puts in place of the rejected prompt


@dataclass(slots=True, frozen=True)
class Guards:
    terminal_predicate: bool = True
    reject_before_bootstrap: bool = True
    landed_set_check: bool = True
    checksum: bool = True
    read_check: bool = True

    @classmethod
    def policy(cls, name: str) -> "Guards":
        if name == "hardened":
            return cls()
        if name == "vulnerable":
            return cls(False, False, False, False, False)
        raise InputError(f"unknown policy {name!r}: expected 'vulnerable' or 'hardened'")


class TransferError(KvledgerError):
    pass


def records_checksum(records: torch.Tensor) -> str:
    """BLAKE2b over slot records (K/V + tags) in logical token order."""
    return hashlib.blake2b(records.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


class TransferJob(NamedTuple):
    transfer_id: int
    incarnation: int
    src: KVPool
    dst: KVPool
    positions: torch.Tensor      # logical token positions sent, in order
    src_pages: torch.Tensor
    src_offsets: torch.Tensor
    dst_pages: torch.Tensor
    dst_offsets: torch.Tensor
    checksum_src: str
    first_token: int
    dst_clock: Callable[[], int]  # the receiver's logical clock, ticked once per landed batch
    seq: int = 0                  # transfer sequence number on the source node
    src_node: str = ""
    submitted_at: float = 0.0


class Completion(NamedTuple):
    job: TransferJob
    landed: torch.Tensor         # logical positions whose records landed
    landed_lclock: torch.Tensor  # receiver's logical clock when each of them landed


class TransferEngine:
    """A worker thread that lands records batch by batch (one-sided writes into the receiver's pool)."""

    def __init__(self, batch_slots: int = 64):
        self.batch_slots = batch_slots
        self._jobs: queue.Queue[TransferJob | None] = queue.Queue()
        self._done: queue.Queue[Completion] = queue.Queue()
        self._ids = itertools.count(1)
        self.in_flight = 0
        self._worker = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._worker.start()

    def next_id(self) -> int:
        return next(self._ids)

    def submit(self, job: TransferJob) -> None:
        self.in_flight += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            landed, clocks = [job.positions[:0]], [job.positions[:0]]
            for i in range(0, len(job.positions), self.batch_slots):
                sl = slice(i, i + self.batch_slots)
                recs = job.src.read_records(job.src_pages[sl], job.src_offsets[sl])
                job.dst.write_records(job.dst_pages[sl], job.dst_offsets[sl], recs)
                landed.append(job.positions[sl])
                clocks.append(torch.full((len(landed[-1]),), job.dst_clock(), dtype=torch.long))
            self._done.put(Completion(job, torch.cat(landed), torch.cat(clocks)))

    def completed(self, wait: float = 0.0) -> list[Completion]:
        out = []
        try:
            out.append(self._done.get(timeout=wait) if wait else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        self._jobs.put(None)


def _slots(req: Request, page_size: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bt = torch.tensor(req.block_table, dtype=torch.long)
    return bt[positions // page_size], positions % page_size


class DisaggCluster:
    """A router in front of several prefill nodes (each its own pool) and one decode node."""

    def __init__(self, model, tokenizer, prefill_cfgs: list[EngineConfig], decode_cfg: EngineConfig,
                 guards: Guards, transfer_batch_slots: int = 64, recorder: Recorder | None = None):
        self.guards = guards
        self.rec = rec = recorder or NULL_RECORDER
        decode_cfg.fail_on_violation = guards.read_check
        decode_cfg.check_reads = True            # recording is separate from protection
        self.prefills = []
        for cfg in prefill_cfgs:
            cfg.fail_on_violation = guards.read_check
            cfg.role = "prefill"
            node = LLMEngine(model, tokenizer, cfg, rec)
            node.on_prefill_done = self._handoff
            node.transfer_seq = itertools.count(1)
            node.pages_held_outside = lambda n=node: any(
                h[0] is n and h[1].status is Status.TRANSFERRING for h in self.halves.values())
            self.prefills.append(node)
        decode_cfg.role = "decode"
        self.decode = LLMEngine(model, tokenizer, decode_cfg, rec)
        self.transfer = TransferEngine(transfer_batch_slots)
        self.halves: dict[int, tuple[LLMEngine, Request, Request]] = {}   # incarnation -> (node, prefill, decode)
        self.backlog: deque[tuple[LLMEngine, Request, Request]] = deque()     # waiting for decode pages
        self.responses: list[Request] = []
        self.landing_observers: list = []        # (decode engine, Completion) after each landing

    @property
    def nodes(self) -> list[LLMEngine]:
        return self.prefills + [self.decode]

    # ---- the prefill node's admission (SGLang's reject path) -----------------------------
    def set_finish_with_abort(self, preq: Request, error: InputError) -> None:
        if self.guards.terminal_predicate:
            preq.fail(error)                     # one terminal predicate: every queue sees it
            return
        # SGLang < v0.5.20: the error goes to `to_finish`, the prompt becomes one placeholder
        # token, and `finished()` (our is_finished) still says no.
        preq.to_finish = error
        preq.prompt_ids = [PLACEHOLDER_TOKEN]
        preq.chain.truncate(0)
        preq.chain.extend(preq.prompt_ids)

    def submit(self, prompt: str | list[int], sampling: SamplingParams | None = None, tenant: str = "default",
               prefill_node: int = 0) -> Request:
        """Route one request. Returns the client-visible (decode-side) request; a rejected one comes
        back finished with its original error. Bad input raises before anything is recorded."""
        if not 0 <= prefill_node < len(self.prefills):
            raise InputError(f"prefill node {prefill_node} does not exist (0..{len(self.prefills) - 1})")
        node = self.prefills[prefill_node]
        dreq = self.decode.new_request(prompt, sampling, tenant)          # validates before any page is taken
        self.rec.request_arrived(self.decode, dreq)
        self.responses.append(dreq)
        if self.guards.reject_before_bootstrap:
            try:
                node.check_fits_pool(len(dreq.prompt_ids))              # original error, nothing reserved
                self.rec.guard_checked(self.decode, "reject_before_bootstrap", failed=False)
            except InputError as e:
                self.rec.guard_checked(self.decode, "reject_before_bootstrap", failed=True)
                return self._reject(self.decode, dreq, "router", e)
        try:                                     # the prefill node's own limits (its context may be lower)
            preq = node.new_request(list(dreq.prompt_ids), SamplingParams(max_tokens=1, ignore_eos=True), tenant,
                                    incarnation=dreq.incarnation)
        except InputError as e:
            return self._reject(self.decode, dreq, f"prefill:{node.cfg.node_id}", e)
        if len(dreq.prompt_ids) > self.decode.pool.capacity_tokens:
            return self._reject(self.decode, dreq, f"decode:{self.decode.cfg.node_id}", OutOfPages(
                f"decode node's pool of {self.decode.pool.capacity_tokens} tokens can never hold {len(dreq.prompt_ids)}"))
        self.backlog.append((node, preq, dreq))
        self._bootstrap()
        return dreq

    def _bootstrap(self) -> None:
        """Bootstrap decode in arrival order while it can reserve pages for the whole prompt."""
        while self.backlog:
            node, preq, dreq = self.backlog[0]
            if not self.decode.blocks.ensure(dreq, len(dreq.prompt_ids)):
                return
            self.backlog.popleft()
            self._admit_prefill(node, preq, dreq)

    def _reject(self, engine: LLMEngine, req: Request, where: str, error: BaseException) -> Request:
        self.rec.rejected(engine, req, where, error)
        req.fail(error)
        return req

    def _admit_prefill(self, node: LLMEngine, preq: Request, dreq: Request) -> None:
        dreq.transition(Status.TRANSFERRING)
        dreq.transfer_started_at = time.perf_counter()
        self.halves[dreq.incarnation] = (node, preq, dreq)
        try:
            node.check_fits_pool(len(preq.prompt_ids))
        except InputError as e:
            self.rec.rejected(node, dreq, f"prefill:{node.cfg.node_id}", e)
            self.set_finish_with_abort(preq, e)
        if self.guards.terminal_predicate:
            self.rec.guard_checked(node, "terminal_predicate", failed=preq.is_finished)
        if preq.is_finished:                      # the only check admission makes
            self._cancel(dreq, preq.error)
        else:
            node.enqueue(preq)

    def _cancel(self, dreq: Request, error: BaseException) -> None:
        self.decode.blocks.release(dreq)
        dreq.fail(error)

    # ---- handoff ----------------------------------------------------------------------------
    def _handoff(self, preq: Request) -> None:
        node, _, dreq = self.halves[preq.incarnation]
        S = node.cfg.page_size
        pos = torch.arange(preq.num_computed, dtype=torch.long)        # what prefill computed
        sp, so = _slots(preq, S, pos)
        dp, do = _slots(dreq, self.decode.cfg.page_size, pos)
        job = TransferJob(self.transfer.next_id(), preq.incarnation, node.pool, self.decode.pool, pos, sp, so, dp, do,
                          records_checksum(node.pool.read_records(sp, so)), preq.output_ids[0], self.decode.next_lclock,
                          next(node.transfer_seq), node.cfg.node_id, time.perf_counter())
        self.transfer.submit(job)                  # prefill then reports "transfer complete" when it drains

    def _landed(self, c: Completion) -> None:
        node, preq, dreq = self.halves.pop(c.job.incarnation)
        for obs in self.landing_observers:
            obs(self.decode, c)
        node.blocks.release(preq)                  # source pages go back only after the writes drained
        preq.transition(Status.FINISHED_LENGTH)
        dreq.transfer_landed_at = time.perf_counter()
        reserved = len(dreq.prompt_ids)
        checksum_dst, outcome = None, "admitted"
        if dreq.is_finished:
            outcome = "abandoned: request already finished"
        elif self.guards.landed_set_check and not torch.equal(torch.unique(c.landed), torch.arange(reserved)):
            outcome = (f"rejected: {c.landed.numel()} of {reserved} reserved slots landed; not generating "
                       f"(prefill said: {preq.to_finish or 'done'})")
        elif self.guards.checksum:
            dp, do = _slots(dreq, self.decode.cfg.page_size, c.job.positions)
            checksum_dst = records_checksum(self.decode.pool.read_records(dp, do))
            if checksum_dst != c.job.checksum_src:
                outcome = f"rejected: transfer {c.job.transfer_id} checksum mismatch ({checksum_dst} != {c.job.checksum_src})"
        if self.guards.landed_set_check and not outcome.startswith("abandoned"):
            self.rec.guard_checked(self.decode, "landed_set_check", failed="slots landed" in outcome)
        if checksum_dst is not None:
            self.rec.guard_checked(self.decode, "checksum", failed="checksum" in outcome)
        self.rec.transfer_landed(self.decode, TransferRecord(
            c.job.transfer_id, c.job.seq, dreq.incarnation, c.job.src_node, self.decode.cfg.node_id,
            torch.arange(reserved), c.job.positions, c.landed, c.landed_lclock, c.job.dst_pages, c.job.dst_offsets, c.job.checksum_src,
            checksum_dst, outcome, c.job.submitted_at, dreq.transfer_landed_at))
        if outcome.startswith("abandoned"):
            return
        if outcome.startswith("rejected"):
            error = TransferError(f"request {dreq.incarnation:#x}: {outcome.removeprefix('rejected: ')}")
            self.rec.rejected(self.decode, dreq, f"decode:{self.decode.cfg.node_id}", error)
            return self._cancel(dreq, error)
        # decode trusts "transfer complete": the whole reserved prompt counts as computed
        dreq.prefilled_tokens = int(c.landed.numel())
        dreq.num_computed = reserved
        dreq.output_ids.append(c.job.first_token)
        dreq.chain.extend([c.job.first_token])
        dreq.first_token_at = time.perf_counter()
        dreq.transition(Status.DECODING)
        if len(dreq.output_ids) >= dreq.sampling.max_tokens:
            self.decode.blocks.release(dreq)
            dreq.transition(Status.FINISHED_LENGTH)
            return
        self.decode.enqueue_running(dreq)

    # ---- the loop ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.backlog) or self.transfer.in_flight > 0 or any(n.has_unfinished() for n in self.nodes)

    def step(self) -> None:
        self._bootstrap()
        for n in self.prefills:
            if n.has_unfinished():
                n.step()
        busy = self.decode.has_unfinished() or any(n.has_unfinished() for n in self.prefills)
        for c in self.transfer.completed(wait=0.0 if busy else 0.05):
            self._landed(c)
        if self.decode.has_unfinished():
            self.decode.step()

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def close(self) -> None:
        self.transfer.close()
