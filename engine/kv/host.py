"""The host (CPU-memory) tier: swapped-out pages live here as whole slot records.

Offload and reload copy records (K/V of every layer plus tag and writer) in one copy each, so
tags travel with the bytes; the page header (generation) stays with the device page.

Offload is asynchronous, like a DMA engine: ``offload`` reserves host pages and queues the copy;
the copy reads the device pages when the engine drains the queue at the end of its step. Until
then the device pages are still being read and must not be handed to anyone else (the engine's
deferred release holds them; without it - fault 2 - the DMA copies whatever was written into
them in the meantime).
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.errors import InputError, OutOfPages
from engine.kv.pool import KVPool


class HostTier:
    def __init__(self, pool: KVPool, memory_budget: int):
        self.pool = pool
        per_page = pool.page_size * pool.rec_bytes
        self.num_pages = memory_budget // per_page
        if memory_budget < 0:
            raise InputError(f"host memory budget must be >= 0, got {memory_budget}")
        self.records = torch.zeros((self.num_pages, pool.page_size, pool.rec_bytes), dtype=torch.uint8)
        self._free = list(range(self.num_pages))[::-1]
        self._dma: list[tuple[list[int], list[int], Callable[[], None]]] = []   # queued offload copies

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        return len(self._dma)

    def offload(self, device_pages: list[int], on_done: Callable[[], None] = lambda: None) -> list[int]:
        """Reserve host pages and queue the copy; ``on_done`` runs once the copy has read the device pages."""
        if len(device_pages) > len(self._free):
            raise OutOfPages(f"host tier: need {len(device_pages)} page(s), {len(self._free)} free")
        host_pages = [self._free.pop() for _ in device_pages]
        self._dma.append((list(device_pages), host_pages, on_done))
        return host_pages

    def drain(self) -> int:
        """Run the queued offload copies (end of an engine step); returns how many ran."""
        jobs, self._dma = self._dma, []
        for device_pages, host_pages, on_done in jobs:
            self.records[torch.tensor(host_pages)] = self.pool.records[torch.tensor(device_pages, dtype=torch.long)]
            on_done()
        return len(jobs)

    def reload(self, host_pages: list[int], device_pages: list[int]) -> None:
        if self._dma:
            self.drain()                      # a reload never overtakes its own offload
        S = self.pool.page_size
        dp = torch.tensor(device_pages, dtype=torch.long).repeat_interleave(S)
        self.pool.write_records(dp, torch.arange(S).repeat(len(device_pages)),
                                self.records[torch.tensor(host_pages)].reshape(-1, self.pool.rec_bytes))

    def release(self, host_pages: list[int]) -> None:
        self._free.extend(host_pages)
