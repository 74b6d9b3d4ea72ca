"""Per-request page bookkeeping on top of the allocator and the host tier.

Deferred release: pages that an in-flight copy may still read or write (a host offload, a KV
transfer) are *held* - taken out of the request, still allocated - and go back to the free list
only when that copy has drained, or when a timeout ends the hold (recorded as such).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from engine.kv.allocator import PageAllocator
from engine.kv.host import HostTier
from engine.request import Request

ReleaseHook = Callable[..., None]     # (req, pages, kind="immediate", ended_by="immediate", hold_ns=0)


class Held(NamedTuple):
    req: Request
    pages: list[int]
    since_ns: int
    why: str


class BlockManager:
    def __init__(self, allocator: PageAllocator, host: HostTier, page_size: int, deferred_release: bool = True):
        self.allocator, self.host, self.page_size = allocator, host, page_size
        self.deferred_release = deferred_release
        self.held: list[Held] = []
        self.prefix_cache = None           # engine/prefix_cache.py, when the engine has one
        # telemetry hooks (the engine wires them to its recorder)
        self.on_release: ReleaseHook = lambda req, pages, *a: None
        self.on_hold: Callable[[Request, list[int], str], None] = lambda req, pages, why: None
        self.on_move: Callable[[Request, str, list[int], torch.Tensor], None] = lambda req, path, pages, pos: None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def held_pages(self) -> int:
        return sum(len(h.pages) for h in self.held)

    def match_prefix(self, req: Request) -> None:
        """A request admitted with nothing computed starts from its longest cached prefix."""
        if self.prefix_cache is not None and req.num_computed == 0 and not req.block_table:
            req.cached_tokens = req.num_computed = self.prefix_cache.match(req)

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Give req enough pages for num_tokens tokens. False (nothing taken) if not enough are free."""
        need = self.pages_for(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        pages, gens = self.allocator.allocate(need)
        req.block_table += pages
        req.page_gens += gens
        return True

    def release(self, req: Request) -> None:
        if req.block_table:
            self.allocator.free(req.block_table)
            self.on_release(req, req.block_table)
        if req.host_pages:
            self.host.release(req.host_pages)
        req.block_table, req.page_gens, req.host_pages = [], [], []

    # ---- deferred release ------------------------------------------------------------------------
    def hold(self, req: Request, why: str) -> Held:
        """Take req's device pages out of the request without freeing them (an in-flight copy may
        still touch them); ``free_held`` gives them back."""
        h = Held(req, list(req.block_table), time.perf_counter_ns(), why)
        req.block_table, req.page_gens = [], []
        if h.pages:
            self.held.append(h)
            self.on_hold(req, h.pages, why)
        return h

    def free_held(self, h: Held, ended_by: str) -> None:
        """End a hold: 'drained' (the copy finished) or 'timeout' (it did not, in time)."""
        if h in self.held:
            self.held.remove(h)
            self.allocator.free(h.pages)
            self.on_release(h.req, h.pages, "deferred", ended_by, time.perf_counter_ns() - h.since_ns)

    # ---- the host tier ---------------------------------------------------------------------------
    def can_swap_out(self, req: Request) -> bool:
        return self.host.num_free >= self.pages_for(req.num_computed)

    def swap_out(self, req: Request) -> None:
        """Offload the computed pages' records (K/V + tags) to the host tier; free the device pages
        once the offload copy has read them."""
        keep = self.pages_for(req.num_computed)
        positions = torch.arange(req.num_computed)
        host_pages: list[int] = []
        if self.deferred_release:
            held: list[Held] = []
            host_pages = self.host.offload(req.block_table[:keep], lambda: (
                self.on_move(req, "offload", host_pages, positions), self.free_held(held[0], "drained")))
            held.append(self.hold(req, "offload"))
        else:
            # Deviation (fault 2, no deferred release): the device pages go back to the free list
            # while the offload copy has not read them yet; whoever gets them next writes into
            # them, and the host copy - reloaded later - holds that writer's KV.
            host_pages = self.host.offload(req.block_table[:keep],
                                           lambda: self.on_move(req, "offload", host_pages, positions))
            self.allocator.free(req.block_table)
            self.on_release(req, req.block_table)
            req.block_table, req.page_gens = [], []
        req.host_pages = host_pages

    def can_swap_in(self, req: Request) -> bool:
        return self.allocator.can_allocate(len(req.host_pages) + 1)

    def swap_in(self, req: Request) -> None:
        """Reload records into fresh pages (new generations); tags come back inside the records."""
        pages, gens = self.allocator.allocate(len(req.host_pages))
        self.host.reload(req.host_pages, pages)
        self.host.release(req.host_pages)
        req.block_table, req.page_gens, req.host_pages = pages, gens, []
        self.on_move(req, "reload", pages, torch.arange(req.num_computed))
