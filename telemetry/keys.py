"""The store secret and the keyed pseudonyms derived from it.

Tenant ids and cache scopes are stored as HMAC-SHA256 pseudonyms; content tags (already keyed
BLAKE2b outputs of the engine's scope secret) are re-keyed with the store secret by a keyed
64-bit mix, vectorised over whole columns. The segment chain uses its own derived key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import numpy as np

ENV_SECRET = "KVLEDGER_STORE_SECRET"


def load_secret(root: Path) -> bytes:
    """$KVLEDGER_STORE_SECRET (hex) or ROOT/secret.key, created 0600 on first use."""
    env = os.environ.get(ENV_SECRET)
    if env:
        try:
            return bytes.fromhex(env)
        except ValueError:
            raise ValueError(f"{ENV_SECRET} must be hex (e.g. the output of `openssl rand -hex 32`)") from None
    path = root / "secret.key"
    if path.exists():
        return path.read_bytes()
    root.mkdir(parents=True, exist_ok=True)
    secret = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


class Keys:
    def __init__(self, secret: bytes):
        self.chain = hmac.new(secret, b"kvledger/segment-chain", hashlib.sha256).digest()
        self._pseud = hmac.new(secret, b"kvledger/pseudonym", hashlib.sha256).digest()
        words = np.frombuffer(hmac.new(secret, b"kvledger/tag-mix", hashlib.sha256).digest(), dtype=np.uint64)
        self._mix = words.copy()

    def pseudonym(self, value: str) -> str:
        return hmac.new(self._pseud, value.encode(), hashlib.sha256).hexdigest()[:16]

    def link(self, prev: str, payload: str) -> str:
        return hmac.new(self.chain, f"{prev}|{payload}".encode(), hashlib.sha256).hexdigest()

    def tag_pseudonyms(self, tags: np.ndarray) -> np.ndarray:
        """Keyed murmur3-finaliser mix of int64 tags (a keyed permutation of 64-bit values)."""
        x = tags.astype(np.int64, copy=False).view(np.uint64) ^ self._mix[0]
        with np.errstate(over="ignore"):
            x = x * np.uint64(0xFF51AFD7ED558CCD)
            x ^= x >> np.uint64(33)
            x ^= self._mix[1]
            x = x * np.uint64(0xC4CEB9FE1A85EC53)
            x ^= x >> np.uint64(33)
        return (x ^ self._mix[2]).view(np.int64)
