"""Content tags: what a KV slot *holds*, not who holds its page.

    tag[i] = H_k(tag[i-1] || token[i]),   tag[-1] = H_k(kv_format_version)
    k      = H_secret(cache scope || kv_format_version)

H is keyed BLAKE2b (8-byte digest, stored as int64); a prompt's chain is hashed in C where the native
kernels are built (engine/kernels/tags.c: the same digests, 153 ns a token with the list's conversion against hashlib's ~780), a
decode step's one token here. A slot at logical position i may be read by a
request only if its tag equals the request's own tag[i]: the chain covers the request's whole
prefix [0..i], so sanctioned prefix sharing (same scope key, same tokens) is plain tag equality,
while stale bytes, another scope's bytes, a placeholder's bytes or a late write never match.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from engine import kernels

_PACK = struct.Struct("<qi")


def scope_key(secret: bytes, scope: str, kv_format_version: str) -> bytes:
    """The per-scope chain key, derived server-side from the scope (never a client-supplied key)."""
    return hashlib.blake2b(f"{scope}\x00{kv_format_version}".encode(), key=secret[:64], digest_size=32).digest()


def _h(key: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, key=key, digest_size=8).digest(), "little", signed=True)


class TagChain:
    """The growing tag chain of one request's own tokens, as an int64 tensor (grown in place)."""

    __slots__ = ("key", "_tags", "_np", "_len", "_seed", "_last", "_state")

    NATIVE_FROM = 8         # tokens from which an extend hashes in C (a ctypes call costs a few hashes)

    def __init__(self, key: bytes, kv_format_version: str = "kvledger-kv-v1"):
        self.key = key
        self._seed = _h(key, kv_format_version.encode())
        self._state = False                 # the key's BLAKE2b state for tags.c: not made yet (None: no kernels)
        self._tags = torch.empty(64, dtype=torch.int64)
        self._np = self._tags.numpy()       # the same memory: one element written at numpy's cost, not torch's
        self._len = 0
        self._last = self._seed             # tag[len - 1] as a Python int (no tensor read per token)

    def __len__(self) -> int:
        return self._len

    def _grow(self, need: int) -> None:
        grown = torch.empty(max(need, 2 * self._tags.numel()), dtype=torch.int64)
        grown[: self._len] = self._tags[: self._len]
        self._tags, self._np = grown, grown.numpy()

    def append(self, token: int) -> None:
        """A decode step's token: one hash, one element written (0.95 us; extend([token]) took 3.1)."""
        if self._len == len(self._np):
            self._grow(self._len + 1)
        self._np[self._len] = self._last = _h(self.key, _PACK.pack(self._last, int(token)))
        self._len += 1

    def extend(self, tokens) -> None:
        tokens = list(tokens)
        if len(tokens) == 1:
            self.append(tokens[0])
            return
        need = self._len + len(tokens)
        if need > self._tags.numel():
            self._grow(need)
        prev = self._last
        if len(tokens) >= self.NATIVE_FROM and self._native(tokens, prev, need):
            prev = int(self._np[need - 1])
        else:
            out = []
            for t in tokens:
                prev = _h(self.key, _PACK.pack(prev, int(t)))
                out.append(prev)
            if out:
                self._tags[self._len: need] = torch.tensor(out, dtype=torch.int64)
        self._last = prev
        self._len = need

    def _native(self, tokens: list, prev: int, need: int) -> bool:
        """Hash tokens into the chain in C (tags.c); False where it cannot (no kernels, a token that is
        not an int32 - the Python path then packs it, or raises as it always did)."""
        if self._state is False:
            self._state = kernels.tag_key_state(self.key)
        if self._state is None:
            return False
        try:
            toks = np.asarray(tokens, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            return False
        if toks.ndim != 1 or toks.min() < -2 ** 31 or toks.max() >= 2 ** 31:
            return False
        kernels.tag_chain(self._state, prev, toks.astype(np.int32), self._tags[self._len: need])
        return True

    def truncate(self, n: int) -> None:
        self._len = min(self._len, n)
        self._last = int(self._tags[self._len - 1]) if self._len else self._seed

    @property
    def tags(self) -> torch.Tensor:
        return self._tags[: self._len]

    def array(self):
        """The chain as a numpy int64 array (the same memory: valid until the chain next grows)."""
        return self._np[: self._len]


def chain(key: bytes, tokens, kv_format_version: str = "kvledger-kv-v1") -> torch.Tensor:
    c = TagChain(key, kv_format_version)
    c.extend(tokens)
    return c.tags.clone()
