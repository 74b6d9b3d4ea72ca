"""Continuous batching: every step mixes one decode token per running request with prefill
chunks of waiting ones, inside a per-step token budget. Memory pressure preempts the most
recently admitted request: swap to the host tier when it has room, else recompute later."""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.kv.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, Status


class Scheduled(NamedTuple):
    req: Request
    num_tokens: int     # computes all_ids[num_computed : num_computed + num_tokens]


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.cfg, self.blocks = config, blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, req: Request) -> None:
        for q in (self.waiting, self.swapped):
            if req in q:
                q.remove(req)
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        victim.preemptions += 1
        if self.blocks.can_swap_out(victim):
            self.blocks.swap_out(victim)
            victim.transition(Status.SWAPPED)
            self.swapped.append(victim)
        else:   # recompute: drop the KV, prefill prompt + outputs again later
            self.blocks.release(victim)
            victim.num_computed = 0
            victim.transition(Status.WAITING)
            self.waiting.appendleft(victim)

    def schedule(self) -> list[Scheduled]:
        budget = self.cfg.max_step_tokens
        # 1. swapped requests come back first, while pages allow
        while self.swapped and len(self.running) < self.cfg.max_num_seqs and self.blocks.can_swap_in(self.swapped[0]):
            req = self.swapped.popleft()
            self.blocks.swap_in(req)
            req.transition(Status.DECODING if req.output_ids else Status.PREFILLING)
            self.running.append(req)
        batch: list[Scheduled] = []
        # 2. decode: one token each; preempt the newest request when a page cannot be had
        for req in [r for r in self.running if r.status is Status.DECODING]:
            if req not in self.running or budget <= 0:
                continue
            while not self.blocks.ensure(req, req.num_computed + 1):
                if self.blocks.held:      # pages come back when in-flight copies drain: wait a step
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                batch.append(Scheduled(req, 1))
                budget -= 1
        # 3. prefill chunks: running prefills first, then admissions (no preemption for these)
        candidates = [r for r in self.running if r.status is Status.PREFILLING] + list(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            admitting = req.status is Status.WAITING
            if admitting and len(self.running) >= self.cfg.max_num_seqs:
                break
            if admitting:
                self.blocks.match_prefix(req)
            n = min(req.seq_len - req.num_computed, budget)
            if not self.blocks.ensure(req, req.num_computed + n):
                break
            if admitting:
                self.waiting.remove(req)
                req.transition(Status.PREFILLING)
                self.running.append(req)
            batch.append(Scheduled(req, n))
            budget -= n
        return batch
