"""Page allocator: free list, reference counts and per-page allocation generations.

Generation semantics: ``pool.generation[p]`` is bumped every time page p leaves the free list.
A request remembers the generation it was given for each page in its block table; the read check
compares it with the page header at read time, so a page that was freed and handed to someone
else can never be read under the old grant.
"""
from __future__ import annotations

from collections import deque

import torch

from engine.errors import AllocatorError, DoubleFree, OutOfPages
from engine.kv.pool import KVPool


class PageAllocator:
    def __init__(self, pool: KVPool, detect_double_free: bool = True):
        self.pool = pool
        self.total = pool.num_pages
        self.detect_double_free = detect_double_free
        self.refcount = [0] * self.total
        self.on_allocate = lambda pages: None   # the prefix cache forgets pages handed to a new owner
        self.checked_frees = 0          # frees the double-free check ran on (guard liveness; the owner resets it)
        self._free: deque[int] = deque(range(self.total))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Take n pages. Returns (pages, generations). Nothing is taken when fewer than n are free."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} page(s), {len(self._free)} free of {self.total}")
        pages = [self._free.popleft() for _ in range(n)]
        self.on_allocate(pages)
        idx = torch.tensor(pages, dtype=torch.long)
        self.pool.generation[idx] += 1
        for p in pages:
            self.refcount[p] += 1
        return pages, self.pool.generation[idx].tolist()

    def reclaim(self, page: int) -> int:
        """Take one specific free page back (a prefix-cache hit on a page whose last holder left);
        like any page leaving the free list it gets a new generation, which is returned."""
        if self.refcount[page] > 0:
            raise AllocatorError(f"cannot reclaim page {page}: it is held")
        self._free.remove(page)
        self.pool.generation[page] += 1
        self.refcount[page] = 1
        return int(self.pool.generation[page])

    def share(self, page: int) -> int:
        """Add a holder to an allocated page (sanctioned prefix sharing); returns its generation."""
        if self.refcount[page] <= 0:
            raise AllocatorError(f"cannot share page {page}: it is free")
        self.refcount[page] += 1
        return int(self.pool.generation[page])

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; pages whose last holder left go back to the free list.
        With the double-free check, a free of a page that has no holder left is refused before
        anything changes (DoubleFree), so an error path that releases twice cannot hand one page
        to two requests."""
        if self.detect_double_free:
            self.checked_frees += 1
            holders: dict[int, int] = {}
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
            bad = [p for p, n in holders.items() if self.refcount[p] < n]
            if bad:
                raise DoubleFree(f"page(s) {bad[:8]} freed with no holder left (generation "
                                 f"{int(self.pool.generation[bad[0]])}); nothing was freed")
        released = []
        for p in pages:
            if self.refcount[p] <= 0:
                # Unchecked free, as an engine without the guard does: the page enters the
                # free list a second time and can be handed to two requests.
                self._free.append(p)
                continue
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                released.append(p)
        if released and self.pool.zero_on_free:
            self.pool.zero_pages(torch.tensor(released, dtype=torch.long))
        self._free.extend(released)

    def check_integrity(self) -> None:
        """Raise unless free + used == total, no page is free twice, and free pages have no holder."""
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            dup = sorted(p for p in free_set if free.count(p) > 1)
            raise AllocatorError(f"page(s) {dup[:8]} are on the free list more than once (double free)")
        used = [p for p in range(self.total) if self.refcount[p] > 0]
        held_and_free = free_set.intersection(used)
        if held_and_free:
            raise AllocatorError(f"page(s) {sorted(held_and_free)[:8]} are both free and held")
        if len(free) + len(used) != self.total:
            raise AllocatorError(f"free {len(free)} + used {len(used)} != total {self.total}: pages were lost")
