"""Disaggregated prefill/decode: a router, prefill nodes, a decode node and an asynchronous KV
link - and the SGLang (< v0.5.20) reject path that leaked other tenants' KV (GLM-5.3), with the
rest of its bug family.

Handoff, as in SGLang: the router bootstraps decode with the prompt length, decode reserves pages
for the whole prompt; the prefill node computes KV and a worker thread writes the records (K/V +
content tag + writer, one copy per call, like one-sided RDMA writes) into decode's reserved slots,
call by call, then signals completion; decode admits the request and generates.

The link (``Link``) is paced by the cluster: each cluster step is one link tick; a call of n
records takes ceil(n / slots_per_tick) ticks, reads the source when it starts and writes the
destination when it completes. Replays are therefore reproducible.

Guards (each a switch; ``hardened`` turns on all, ``vulnerable`` none). With a guard off, the
code takes the named deviation that the guard exists to prevent:
    terminal_predicate      a rejection sets the status (is_finished)           fault 1 (glm53)
    reject_before_bootstrap the router asks the prefill node's limits first      fault 1
    landed_set_check        decode admits only if the landed slot set == the reserved set
    checksum                decode verifies the sender's checksum (logical token order)
    read_check              the read-time provenance check fails the reader (recording is always on)
    deferred_release        pages an in-flight copy may touch (decode destination, prefill source,
                            host offload) are held until it drains; a timeout ends the hold  faults 2, 3, 5
    transfer_batch_bound    one transfer call carries <= batch_slots records (shorter than the timeout)  fault 7
    cancel_both_halves      when either half ends early, the router stops the other (the link stops at
                            the next call boundary)                                         faults 3, 7
    incarnation_ids         transfer ids and their acks carry the incarnation, not the client's room  fault 6
    single_release          one owner releases a failed request's pages                     fault 4
    double_free_check       the allocator refuses to free a page with no holder left        fault 4
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from enum import StrEnum
from typing import Callable, NamedTuple

import torch

from engine.kv.block_manager import Held
from engine.config import EngineConfig
from engine.errors import DoubleFree, InputError, OutOfPages
from engine.llm import LLMEngine
from engine.recorder import NULL_RECORDER, LandedRecords, Recorder, TransferRecord
from engine.request import Request, SamplingParams, Status
from engine.disagg.node import PrefillNode
from engine.disagg.guards import Guards  # noqa: F401 (engine.disagg.cluster.Guards: scripts import it here)
from engine.disagg.link import (Completion, Link, LinkConfig, LinkStatus, TransferError,  # noqa: F401
                               TransferJob, records_checksum)

PLACEHOLDER_TOKEN = 0   # what set_finish_with_abort puts in place of the rejected prompt


class Verdict(StrEnum):
    """Decode's verdict on a landed transfer."""
    ADMITTED = "admitted"        # decode generates from it
    REJECTED = "rejected"        # not generating: the request fails with the reason
    ABANDONED = "abandoned"      # the request had finished already


class Outcome(NamedTuple):
    """A transfer's outcome: the verdict, why, and which guard's check decided it (if one did).
    ``str()`` is what the store records (``transfers.outcome``): "admitted", "rejected: <reason>"."""
    verdict: Verdict
    reason: str = ""
    check: str | None = None     # "landed_set_check" | "checksum" when that guard rejected it

    def __str__(self) -> str:
        return self.verdict.value + (f": {self.reason}" if self.reason else "")


class Half:
    __slots__ = ("node", "preq", "dreq", "room", "job", "reservation")

    def __init__(self, node: LLMEngine, preq: Request, dreq: Request, room: str):
        self.node, self.preq, self.dreq, self.room = node, preq, dreq, room
        self.job: TransferJob | None = None
        self.reservation: list[int] = []        # decode pages reserved at bootstrap


class Hold(NamedTuple):
    engine: LLMEngine
    held: Held
    incarnation: int
    deadline: int                 # link tick


class DisaggCluster:
    """A router in front of several prefill nodes (each its own pool) and one decode node."""

    def __init__(self, model, tokenizer, prefill_cfgs: list[EngineConfig], decode_cfg: EngineConfig,
                 guards: Guards, link: LinkConfig | None = None, recorder: Recorder | None = None):
        self.guards = guards
        self.link_cfg = lc = link or LinkConfig()
        if min(lc.slots_per_tick, lc.batch_slots, lc.release_timeout_ticks) < 1:
            raise InputError(f"link settings must be >= 1: {lc}")
        if guards.transfer_batch_bound and lc.call_ticks(lc.batch_slots) >= lc.release_timeout_ticks:
            raise InputError(f"transfer batch bound of {lc.batch_slots} slots takes {lc.call_ticks(lc.batch_slots)} "
                             f"link ticks, not shorter than the release timeout of {lc.release_timeout_ticks}")
        self.rec = recorder or NULL_RECORDER
        # each node gets its own copy of its config, with the guards' switches and its role (the
        # caller's configs are left as they were given)
        switches = {"fail_on_violation": guards.read_check, "deferred_release": guards.deferred_release,
                    "detect_double_free": guards.double_free_check}
        self.decode = self._make_decode(model, tokenizer, replace(decode_cfg, **switches, role="decode",
                                                                   check_reads=True))   # recording != protection
        self.prefills: list[PrefillNode] = []
        for cfg in prefill_cfgs:
            node = self._make_prefill(model, tokenizer, replace(cfg, **switches, role="prefill"))
            node.on_prefill_done = self._handoff
            self.prefills.append(node)
        self.landing_observers: list = []        # (decode engine, job, slice) after each landed call
        self.link = self._make_link()
        self.halves: dict[int, Half] = {}        # incarnation -> both halves, until its transfer completes
        self.backlog: deque[Half] = deque()      # waiting for decode pages
        self.holds: list[Hold] = []              # deferred releases waiting for a drain or the timeout
        self.responses: list[Request] = []
        self._fail_plan: dict[int, int] = {}     # incarnation -> the link fails its transfer after n calls
        self.steps = 0
        self._rr = 0                             # admit(): the next prefill node, round robin

    # ---- what process mode (engine/disagg/procs.py) replaces: the nodes' homes and the link ------------
    def _make_decode(self, model, tokenizer, cfg: EngineConfig) -> LLMEngine:
        return LLMEngine(model, tokenizer, cfg, self.rec)

    def _make_prefill(self, model, tokenizer, cfg: EngineConfig) -> LLMEngine:
        return LLMEngine(model, tokenizer, cfg, self.rec)

    def _make_link(self):
        return Link(self.link_cfg, [self._call_landed])

    def _call_landed(self, job, sl: slice) -> None:
        """The link's thread, after each landed call (the cluster waits in its tick): the recorder
        hears of the records as they land - a step of decode may read them before the transfer
        completes - then the observers (the oracle)."""
        self.rec.records_landed(self.decode, LandedRecords(job.incarnation, *job.landed[-1]))
        for obs in self.landing_observers:
            obs(self.decode, job, sl)

    def _may_still_write(self, half: Half) -> bool:
        """Could the prefill half write into decode's pages although no transfer was submitted yet?"""
        return False

    @property
    def nodes(self) -> list[LLMEngine]:
        return self.prefills + [self.decode]

    # ---- the prefill node's admission (SGLang's reject path) -----------------------------
    def set_finish_with_abort(self, preq: Request, error: InputError) -> None:
        if self.guards.terminal_predicate:
            preq.fail(error)                     # one terminal predicate: every queue sees it
            return
        # Deviation (fault 1, SGLang < v0.5.20): the error goes to `to_finish`, the prompt
        # becomes one placeholder token, and `finished()` (our is_finished) still says no.
        preq.to_finish = error
        preq.prompt_ids = [PLACEHOLDER_TOKEN]
        preq.chain.truncate(0)
        preq.chain.extend(preq.prompt_ids)

    def submit(self, prompt: str | list[int], sampling: SamplingParams | None = None, tenant: str = "default",
               prefill_node: int = 0, rid: str = "", user: str = "", cache_salt: str = "") -> Request:
        """Route one request. Returns the client-visible (decode-side) request; a rejected one comes
        back finished with its original error. Bad input raises before anything is recorded.
        ``rid`` is the client's request id (SGLang's bootstrap room); clients may reuse it."""
        if not 0 <= prefill_node < len(self.prefills):
            raise InputError(f"prefill node {prefill_node} does not exist (0..{len(self.prefills) - 1})")
        node = self.prefills[prefill_node]
        dreq = self.decode.new_request(prompt, sampling, tenant, rid=rid, user=user,   # validates before any
                                       cache_salt=cache_salt)                     # page is taken
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
                                    incarnation=dreq.incarnation, user=user, cache_salt=cache_salt)
        except InputError as e:
            return self._reject(self.decode, dreq, f"prefill:{node.cfg.node_id}", e)
        if len(dreq.prompt_ids) > self.decode.pool.capacity_tokens:
            return self._reject(self.decode, dreq, f"decode:{self.decode.cfg.node_id}", OutOfPages(
                f"decode node's pool of {self.decode.pool.capacity_tokens} tokens can never hold {len(dreq.prompt_ids)}"))
        self.backlog.append(Half(node, preq, dreq, rid or str(dreq.incarnation)))
        self._bootstrap()
        return dreq

    def _bootstrap(self) -> None:
        """Bootstrap decode in arrival order while it can reserve pages for the whole prompt."""
        while self.backlog:
            half = self.backlog[0]
            if not self.decode.blocks.ensure(half.dreq, len(half.dreq.prompt_ids)):
                return
            self.backlog.popleft()
            half.reservation = list(half.dreq.block_table)
            self._admit_prefill(half)

    def _reject(self, engine: LLMEngine, req: Request, where: str, error: BaseException) -> Request:
        self.rec.rejected(engine, req, where, error)
        for guard in ("cancel_both_halves", "single_release"):     # nothing reserved, no other half to stop
            if getattr(self.guards, guard):
                self.rec.guard_checked(engine, guard, failed=False)
        req.fail(error)
        return req

    def _admit_prefill(self, half: Half) -> None:
        node, preq, dreq = half.node, half.preq, half.dreq
        dreq.transition(Status.TRANSFERRING)
        dreq.transfer_started_at = time.perf_counter()
        self.halves[dreq.incarnation] = half
        try:
            node.check_fits_pool(len(preq.prompt_ids))
        except InputError as e:
            self.rec.rejected(node, dreq, f"prefill:{node.cfg.node_id}", e)
            self.set_finish_with_abort(preq, e)
        if self.guards.terminal_predicate:
            self.rec.guard_checked(node, "terminal_predicate", failed=preq.is_finished)
        if preq.is_finished:                      # the only check admission makes
            del self.halves[dreq.incarnation]
            self._release_decode(half, preq.error, in_flight=False)
        else:
            node.enqueue(preq)

    # ---- handoff ----------------------------------------------------------------------------
    def _handoff(self, preq: Request) -> None:
        half = self.halves[preq.incarnation]
        node = half.node
        pos = torch.arange(preq.num_computed, dtype=torch.long)        # what prefill computed
        sp, so = slot_addresses(preq.block_table, node.cfg.page_size, pos)
        # the destination is what decode reserved at bootstrap (SGLang sends the page indices to
        # prefill then): prefill writes there whatever became of decode's request since
        dp, do = slot_addresses(half.reservation, self.decode.cfg.page_size, pos)
        key = (half.room, preq.incarnation) if self.guards.incarnation_ids else half.room
        if self.guards.incarnation_ids:
            self.rec.guard_checked(node, "incarnation_ids", failed=key in node.sending)
        # Registering a transfer id that is already known counts as a retransmission of that
        # transfer (idempotent). Ids carrying the incarnation never collide; the client's room
        # does when a client reuses its request id (fault 6): the second transfer is never
        # registered, so nothing ever releases its source pages.
        node.sending.setdefault(key, preq)
        bound = self.link_cfg.batch_slots if self.guards.transfer_batch_bound else None
        if bound is not None:
            self.rec.guard_checked(node, "transfer_batch_bound", failed=False)
        lease = self.link_cfg.prefill_lease_ticks
        job = TransferJob(self.link.next_id(), preq.incarnation, key, node.pool, self.decode.pool, pos, sp, so, dp, do,
                          records_checksum(node.pool.read_records(sp, so)), preq.output_ids[0], self.decode.next_lclock,
                          next(node.transfer_seq), node.cfg.node_id, time.perf_counter(), batch_slots=bound,
                          lease_until=None if lease is None else self.link.now + lease,
                          fail_after_calls=self._fail_plan.pop(preq.incarnation, None))
        half.job = job
        self.link.submit(job)                  # prefill reports "transfer complete" when it drains

    def _landed(self, c: Completion) -> None:
        job = c.job
        half = self.halves.pop(job.incarnation)
        node, preq, dreq = half.node, half.preq, half.dreq
        self._source_done(node, job, c.status)
        if not preq.is_finished:
            preq.transition(Status.FINISHED_LENGTH)
        if c.status != LinkStatus.FAILED:      # a failed transfer never reports its writes as drained
            self._end_holds(job.incarnation, "drained")
        dreq.transfer_landed_at = time.perf_counter()
        reserved = len(dreq.prompt_ids)
        outcome, checksum_dst = self._judge(c, half, reserved)
        if self.guards.landed_set_check and c.status == LinkStatus.DRAINED and outcome.verdict != Verdict.ABANDONED:
            self.rec.guard_checked(self.decode, "landed_set_check", failed=outcome.check == "landed_set_check")
        if checksum_dst is not None:
            self.rec.guard_checked(self.decode, "checksum", failed=outcome.check == "checksum")
        self.rec.transfer_landed(self.decode, TransferRecord(
            job.transfer_id, job.seq, dreq.incarnation, job.src_node, self.decode.cfg.node_id,
            torch.arange(reserved), job.positions[:job.sent], c.landed, c.landed_lclock, c.landed_pages,
            c.landed_offsets, c.landed_gen, c.landed_tags, c.landed_writers, job.checksum_src,
            checksum_dst, str(outcome), job.submitted_at, dreq.transfer_landed_at))
        if outcome.verdict == Verdict.ABANDONED:
            return
        if outcome.verdict == Verdict.REJECTED:
            error = TransferError(f"request {dreq.incarnation}: {outcome.reason}")
            self.rec.rejected(self.decode, dreq, f"decode:{self.decode.cfg.node_id}", error)
            failed = c.status == LinkStatus.FAILED
            return self._release_decode(half, error, in_flight=failed, link_failed=failed)
        # decode trusts "transfer complete": the whole reserved prompt counts as computed
        dreq.prefilled_tokens = int(c.landed.numel())
        dreq.num_computed = reserved
        dreq.output_ids.append(job.first_token)
        dreq.chain.append(job.first_token)
        dreq.first_token_at = time.perf_counter()
        dreq.transition(Status.DECODING)
        if len(dreq.output_ids) >= dreq.sampling.max_tokens:
            self.decode.blocks.release(dreq)
            dreq.transition(Status.FINISHED_LENGTH)
            return
        self.decode.enqueue_running(dreq)

    def _judge(self, c: Completion, half: Half, reserved: int) -> tuple[Outcome, str | None]:
        """Decode's verdict on a landed transfer (and the checksum it computed, when it did)."""
        job, preq, dreq = c.job, half.preq, half.dreq
        if dreq.is_finished:
            return Outcome(Verdict.ABANDONED, "request already finished"), None
        if c.status != LinkStatus.DRAINED:
            why = job.cancel_reason if c.status == LinkStatus.CANCELLED else "the link failed"
            return Outcome(Verdict.REJECTED, f"transfer {job.transfer_id} {c.status} ({why}) after "
                                             f"{c.landed.numel()} of {reserved} slots"), None
        if self.guards.landed_set_check and not torch.equal(torch.unique(c.landed), torch.arange(reserved)):
            return Outcome(Verdict.REJECTED, f"{c.landed.numel()} of {reserved} reserved slots landed; not generating "
                                             f"(prefill said: {preq.to_finish or 'done'})", "landed_set_check"), None
        if not self.guards.checksum:
            return Outcome(Verdict.ADMITTED), None
        dp, do = slot_addresses(half.reservation, self.decode.cfg.page_size, job.positions)
        checksum_dst = records_checksum(self.decode.pool.read_records(dp, do))
        if checksum_dst != job.checksum_src:
            return Outcome(Verdict.REJECTED, f"transfer {job.transfer_id} checksum mismatch ({checksum_dst} != "
                                             f"{job.checksum_src})", "checksum"), checksum_dst
        return Outcome(Verdict.ADMITTED), checksum_dst

    def _source_done(self, node: LLMEngine, job: TransferJob, status: LinkStatus) -> None:
        """The sender's side of a completed transfer: give back the pages registered under its id."""
        preq = node.sending.pop(job.key, None)
        if preq is None:                       # freed when its lease ended, or never registered (reused id)
            return
        if status == LinkStatus.FAILED and self.guards.deferred_release:
            self._hold(node, preq, "transfer failed")   # writes may still land: only the timeout ends this
        else:
            node.blocks.release(preq)
            if self.guards.deferred_release:
                self.rec.guard_checked(node, "deferred_release", failed=False)

    # ---- early endings: client abort, link failure, lease expiry ------------------------------
    def abort(self, dreq: Request, reason: str = "client disconnected") -> None:
        """The client went away mid-flight."""
        if not any(r is dreq for r in self.responses):
            raise InputError(f"request {dreq.incarnation} was not submitted to this cluster")
        if dreq.is_finished:
            return
        error = InputError(f"request {dreq.incarnation} aborted: {reason}")
        for half in self.backlog:
            if half.dreq is dreq:              # nothing reserved yet
                self.backlog.remove(half)
                self._finish_aborted(dreq, error)
                return
        half = self.halves.get(dreq.incarnation)
        if half is None:                       # decoding: no copy in flight
            self.decode.abort(dreq, reason)
            return
        # will a transfer still write into decode's reserved pages?
        in_flight = half.job is not None or not self.guards.cancel_both_halves or self._may_still_write(half)
        self._release_decode(half, error, in_flight=in_flight, aborted=True)
        self._stop_prefill_half(half)

    def fail_transfer(self, dreq: Request, after_calls: int = 1) -> None:
        """The link fails this request's transfer after ``after_calls`` calls (a NIC or network error)."""
        half = self.halves.get(dreq.incarnation)
        if half is not None and half.job is not None:
            half.job.fail_after_calls = after_calls
        else:
            self._fail_plan[dreq.incarnation] = after_calls

    def _stop_prefill_half(self, half: Half) -> None:
        if not self.guards.cancel_both_halves:
            return                             # the prefill half carries on and sends anyway
        self.rec.guard_checked(self.decode, "cancel_both_halves", failed=False)
        if half.job is None:
            self.halves.pop(half.dreq.incarnation, None)
            if not half.preq.is_finished:
                half.node.abort(half.preq, "the decode half ended")
            return
        half.job.cancel_reason = "the decode half ended"
        c = self.link.cancel(half.job)
        if c is not None:                      # nothing on the wire: completes now
            self._landed(c)

    def _release_decode(self, half: Half, error: BaseException, in_flight: bool, aborted: bool = False,
                        link_failed: bool = False) -> None:
        """End the decode half early: its reserved pages, then its status."""
        dreq = half.dreq
        if link_failed and not self.guards.single_release:
            # Deviation (fault 4): the link-failure path hands back the reservation it made at
            # bootstrap, and then the request's own release frees its block table - the same
            # pages - again; unchecked, they enter the free list twice.
            self._free(self.decode, lambda: self.decode.allocator.free(half.reservation))
        if self.guards.single_release:
            self.rec.guard_checked(self.decode, "single_release", failed=False)
        if self.guards.cancel_both_halves and not aborted:     # the prefill half already ended (an abort counts below)
            self.rec.guard_checked(self.decode, "cancel_both_halves", failed=False)
        if in_flight and self.guards.deferred_release:
            self._hold(self.decode, dreq, "transfer in flight")
        else:
            # Without deferred release (faults 3, 7) the pages go back while writes may still land.
            self._free(self.decode, lambda: self.decode.blocks.release(dreq))
        if aborted:
            self._finish_aborted(dreq, error)
        else:
            dreq.fail(error)

    @staticmethod
    def _finish_aborted(dreq: Request, error: BaseException) -> None:
        dreq.error = error
        dreq.transition(Status.FINISHED_ABORTED)

    def _hold(self, engine: LLMEngine, req: Request, why: str) -> None:
        h = engine.blocks.hold(req, why)
        if h.pages:
            self.holds.append(Hold(engine, h, req.incarnation, self.link.now + self.link_cfg.release_timeout_ticks))

    def _end_holds(self, incarnation: int, ended_by: str) -> None:
        for h in [h for h in self.holds if h.incarnation == incarnation or (ended_by == "timeout" and h.deadline <= self.link.now)]:
            self.holds.remove(h)
            self._free(h.engine, lambda h=h: h.engine.blocks.free_held(h.held, ended_by))
            self.rec.guard_checked(h.engine, "deferred_release", failed=ended_by == "timeout")

    def _free(self, engine: LLMEngine, release: Callable[[], None]) -> None:
        """Run a release; a double free the allocator refused is recorded (and nothing changed)."""
        try:
            release()
        except DoubleFree:
            self.rec.guard_checked(engine, "double_free_check", failed=True)

    def _expire(self) -> None:
        """Link time moved on: end deferred releases that timed out, and prefill leases."""
        if any(h.deadline <= self.link.now for h in self.holds):
            self._end_holds(-1, "timeout")
        for node in self.prefills:
            for key, preq in list(node.sending.items()):
                half = self.halves.get(preq.incarnation)
                job = half.job if half is not None else None
                if job is None or job.lease_until is None or self.link.now < job.lease_until:
                    continue
                if self.guards.deferred_release:
                    if job.started:
                        continue               # the pull is on the wire: the pages wait for it to drain
                    job.cancel_reason = "the prefill lease on its source pages expired before decode pulled them"
                    c = self.link.cancel(job)
                    if c is not None:
                        self._landed(c)
                else:
                    # Deviation (fault 5): the lease ends and prefill frees the source pages,
                    # although decode has not pulled them yet; the pull later reads whatever
                    # the next prefill wrote there.
                    del node.sending[key]
                    node.blocks.release(preq)

    # ---- the loop ----------------------------------------------------------------------------
    def admit(self, prompt_ids: list[int], sp: SamplingParams, tenant: str, user: str = "",
              cache_salt: str = "") -> Request:
        """A server's request, round robin over the prefill nodes (engine.server.loop.Backend)."""
        node = self._rr % len(self.prefills)
        self._rr += 1
        return self.submit(prompt_ids, sp, tenant, prefill_node=node, user=user, cache_salt=cache_salt)

    def has_work(self) -> bool:
        return (bool(self.backlog) or self.link.in_flight > 0 or bool(self.holds)
                or any(n.has_unfinished() for n in self.nodes))

    def step(self) -> None:
        self.steps += 1
        self._bootstrap()
        for n in self.prefills:
            if n.has_unfinished():
                n.step()
        for c in self.link.tick():
            self._landed(c)
        self._expire()
        if self.decode.has_unfinished():
            self.decode.step()
        if self.guards.double_free_check:
            for n in self.nodes:
                if n.allocator.checked_frees:
                    self.rec.guard_checked(n, "double_free_check", failed=False, count=n.allocator.checked_frees)
                    n.allocator.checked_frees = 0

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def forget_finished(self) -> None:
        """Drop finished requests from ``responses`` (a long-running server stays bounded; a finished
        request needs no abort)."""
        self.responses = [r for r in self.responses if not r.is_finished]

    def close(self) -> None:
        self.link.close()


def slot_addresses(block_table: list[int], page_size: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bt = torch.tensor(block_table, dtype=torch.long)
    return bt[positions // page_size], positions % page_size
