"""Tenant-scoped prefix cache: full prompt pages reused across requests, by content tag.

The key of a full page is the content tag of its last slot. Tags are a keyed hash chain,
``tag[i] = H_k(tag[i-1] || token[i])`` with ``k`` derived server-side from the cache scope, so one
int64 names the scope, the model/KV format and every token of the prefix up to the page's end
(as vLLM's hash-chained block keys, but keyed: BLAKE2b with the scope key, never Python's
``hash``). Sharing is therefore tag equality - exactly what the read check verifies on every read
- and two scopes never share a page, whatever their tokens.

Pages stay cached after their last holder leaves, as in vLLM, until the allocator hands them to
someone else (``evict``). Only full pages a request computed itself are registered, and only
after the step that wrote them, with the tag plane confirming the key.
"""
from __future__ import annotations

import torch

from engine.kv.allocator import PageAllocator
from engine.request import Request


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self._page: dict[int, int] = {}    # key (tag of the page's last slot) -> page
        self._key: dict[int, int] = {}     # page -> key
        self.hits = self.lookups = 0

    def __len__(self) -> int:
        return len(self._page)

    def evict(self, pages: list[int]) -> None:
        """``pages`` were handed to a new owner: they no longer hold what their key names."""
        for p in pages:
            key = self._key.pop(p, None)
            if key is not None:
                del self._page[key]

    def match(self, req: Request) -> int:
        """Give a request that holds no page yet the cached pages of its longest cached prefix of
        full pages (at least one prompt token is left to compute, for its logits). Returns the
        number of tokens served from the cache."""
        S = self.page_size
        tags = req.chain.tags
        n_full = (len(req.prompt_ids) - 1) // S
        pages, gens = [], []
        for j in range(n_full):
            self.lookups += 1
            page = self._page.get(int(tags[(j + 1) * S - 1]))
            if page is None:
                break
            gens.append(self.allocator.share(page) if self.allocator.refcount[page] > 0 else self.allocator.reclaim(page))
            pages.append(page)
            self.hits += 1
        req.block_table, req.page_gens = pages, gens
        return len(pages) * S

    def register(self, req: Request, pool_tags: torch.Tensor) -> None:
        """After a step: register the full prompt pages ``req`` has computed, if the tag plane holds
        what the key says (its own write, or a page it shares)."""
        S = self.page_size
        done = min(req.num_computed, len(req.prompt_ids)) // S
        for j in range(done):
            page = req.block_table[j]
            key = int(req.chain.tags[(j + 1) * S - 1])
            if page in self._key or key in self._page or int(pool_tags[page, S - 1]) != key:
                continue
            self._page[key], self._key[page] = page, key
