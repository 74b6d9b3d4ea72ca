"""Per-request page bookkeeping on top of the allocator and the host tier."""
from __future__ import annotations

from typing import Callable

import torch

from engine.allocator import PageAllocator
from engine.host import HostTier
from engine.request import Request


class BlockManager:
    def __init__(self, allocator: PageAllocator, host: HostTier, page_size: int):
        self.allocator, self.host, self.page_size = allocator, host, page_size
        # telemetry hooks (the engine wires them to its recorder)
        self.on_release: Callable[[Request, list[int]], None] = lambda req, pages: None
        self.on_move: Callable[[Request, str, list[int], torch.Tensor], None] = lambda req, path, pages, pos: None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

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

    def can_swap_out(self, req: Request) -> bool:
        return self.host.num_free >= self.pages_for(req.num_computed)

    def swap_out(self, req: Request) -> None:
        """Offload the computed pages' records (K/V + tags) to the host tier; free the device pages."""
        keep = self.pages_for(req.num_computed)
        req.host_pages = self.host.offload(req.block_table[:keep])
        self.on_move(req, "offload", req.host_pages, torch.arange(req.num_computed))
        self.allocator.free(req.block_table)
        self.on_release(req, req.block_table)
        req.block_table, req.page_gens = [], []

    def can_swap_in(self, req: Request) -> bool:
        return self.allocator.can_allocate(len(req.host_pages) + 1)

    def swap_in(self, req: Request) -> None:
        """Reload records into fresh pages (new generations); tags come back inside the records."""
        pages, gens = self.allocator.allocate(len(req.host_pages))
        self.host.reload(req.host_pages, pages)
        self.host.release(req.host_pages)
        req.block_table, req.page_gens, req.host_pages = pages, gens, []
        self.on_move(req, "reload", pages, torch.arange(req.num_computed))
