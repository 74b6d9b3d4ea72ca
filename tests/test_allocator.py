"""The allocator's invariants, driven by hypothesis stateful testing."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.allocator import PageAllocator
from engine.errors import AllocatorError, DoubleFree, OutOfPages
from engine.kv.pool import KVPool


def make_pool(pages=12, zero_on_free=False):
    return KVPool(1, 8, 4, pages * KVPool.page_bytes_for(1, 8, 4), zero_on_free=zero_on_free)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(make_pool())
        self.held: list[list[int]] = []   # one entry per holder
        self.last_gen: dict[int, int] = {}

    @rule(n=st.integers(1, 5))
    def allocate(self, n):
        free_before = self.alloc.num_free
        if n > free_before:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n)
            assert self.alloc.num_free == free_before   # nothing taken on failure
            return
        pages, gens = self.alloc.allocate(n)
        for p, g in zip(pages, gens):
            assert g > self.last_gen.get(p, 0), "a reallocated page must get a new generation"
            self.last_gen[p] = g
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.alloc.free(self.held.pop(i % len(self.held)))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def share(self, i):
        pages = self.held[i % len(self.held)]
        gens = [self.alloc.share(p) for p in pages]
        assert gens == [self.last_gen[p] for p in pages]   # sharing keeps the generation
        self.held.append(list(pages))

    @rule()
    def double_free_is_detected(self):
        free_pages = [p for p in range(self.alloc.total) if self.alloc.refcount[p] == 0]
        if free_pages:
            with pytest.raises(DoubleFree):
                self.alloc.free([free_pages[0]])

    @invariant()
    def integrity(self):
        self.alloc.check_integrity()
        used = {p for pages in self.held for p in pages}
        assert self.alloc.num_free + len(used) == self.alloc.total


TestAllocatorStateful = AllocatorMachine.TestCase
TestAllocatorStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_unchecked_double_free_puts_page_on_free_list_twice_and_integrity_catches_it():
    alloc = PageAllocator(make_pool(), detect_double_free=False)
    pages, _ = alloc.allocate(2)
    alloc.free(pages)
    alloc.free(pages[:1])           # the error-path double free of the bug family
    with pytest.raises(AllocatorError, match="more than once"):
        alloc.check_integrity()
    a, _ = alloc.allocate(alloc.total)
    b, _ = alloc.allocate(1)
    assert set(a) & set(b) == {pages[0]}, "the same page was handed to two holders"


def test_freed_pages_keep_bytes_unless_zero_on_free():
    for zero in (False, True):
        pool = make_pool(zero_on_free=zero)
        alloc = PageAllocator(pool)
        (p,), _ = alloc.allocate(1)
        pool.store(0, torch.tensor([p]), torch.tensor([0]), torch.ones(1, 8), torch.ones(1, 8),
                   torch.tensor([42]), torch.tensor([7]))
        alloc.free([p])
        assert (int(pool.tags[p, 0]) == 0) == zero
        assert bool(pool.k(0)[p, 0].eq(0).all()) == zero
        assert int(pool.generation[p]) == 1, "the generation header is the allocator's, never zeroed"
