"""Key custody: who holds which key, and where (README "Telemetry and the store": threat model).

A store directory holds no secret. It carries ``store.json``: the store's id and the Ed25519
*public* key its writer signs with (and that key's fingerprint). The writer's keys live outside it,
in ``KEY_DIR/<store id>/`` (``$KVLEDGER_KEY_DIR``, else ``$KVLEDGER_STATE_DIR/keys``, else
``$XDG_STATE_HOME/kvledger/keys`` or ``~/.local/state/kvledger/keys``), each file 0600:

    signing.key     Ed25519 private key: signs every chain file, intent and anchor entry
    pseudonym.key   keys the tenant / scope pseudonyms and re-keys content tags (HMAC-SHA256 / mix)
    ngram.key       keys the n-gram hashes that tell "surfaced" from "read"

Three separate secrets: a copy of the store handed to an auditor (with or without the public key)
re-identifies no tenant, recovers no prompt text from n-gram hashes and can sign nothing.
``$KVLEDGER_STORE_SECRET`` (hex) overrides the two pseudonymisation keys (each derived from it
under its own label), as before; the signing key is always a file of its own.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from engine.errors import KvledgerError

ENV_SECRET = "KVLEDGER_STORE_SECRET"
ENV_STATE = "KVLEDGER_STATE_DIR"
ENV_KEYS = "KVLEDGER_KEY_DIR"
STORE_FILE = "store.json"
STORE_FORMAT = "kvledger-store/2"


class KeyError_(KvledgerError):
    """Raised as telemetry.store.StoreError by callers (this module stays free of the engine)."""


def state_dir() -> Path:
    """Per-user state outside every store: keys and anchors."""
    if os.environ.get(ENV_STATE):
        return Path(os.environ[ENV_STATE])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvledger"


def record_file(root: Path) -> Path:
    """Where the key holder keeps which store lives at ``root`` (outside every store: a store's
    identity must not come from the store itself)."""
    real = str(Path(root).resolve())
    return state_dir() / "stores" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"


def recorded_identity(root: Path) -> dict | None:
    """The store id and fingerprint a writer recorded for this path, or None (never written here)."""
    try:
        body = json.loads(record_file(root).read_text())
        return {"store_id": str(body["store_id"]), "fingerprint": str(body["fingerprint"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_identity(root: Path, ident: "Identity") -> None:
    path = record_file(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(json.dumps({"path": str(Path(root).resolve()), "store_id": ident.store_id,
                               "fingerprint": ident.fingerprint}))
    os.replace(tmp, path)


def substituted(root: Path, ident: "Identity") -> str | None:
    """Why the store at ``root`` is not the one the key holder recorded there (None: it is, or no
    record exists - a store read where it was never written)."""
    rec = recorded_identity(root)
    if rec is None or (rec["store_id"], rec["fingerprint"]) == (ident.store_id, ident.fingerprint):
        return None
    return (f"substituted: the key holder's record for {Path(root).resolve()} names store {rec['store_id']} "
            f"(fingerprint {rec['fingerprint']}), but the store here declares {ident.store_id} (fingerprint "
            f"{ident.fingerprint}): it was rewritten under another key or replaced by another store "
            f"(record: {record_file(root)})")


def key_dir(store_id: str) -> Path:
    root = Path(os.environ[ENV_KEYS]) if os.environ.get(ENV_KEYS) else state_dir() / "keys"
    return root / store_id


def fingerprint(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:32]


class Identity(NamedTuple):
    """What a store says about itself (ROOT/store.json): public, needed by ``verify``."""
    store_id: str
    public_key: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def check(self, message: bytes, signature: str) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(bytes.fromhex(signature), message)
            return True
        except (InvalidSignature, ValueError, TypeError):
            return False


def read_identity(root: Path) -> Identity:
    path = root / STORE_FILE
    try:
        body = json.loads(path.read_text())
        ident = Identity(str(body["store_id"]), bytes.fromhex(body["public_key"]))
    except FileNotFoundError:
        if (root / "secret.key").exists():
            raise KeyError_(f"{root} was written by an older kvledger (an HMAC chain, its secret.key inside the store): "
                            "it has no signed chain to verify; read it with --allow-unverified, or start a new "
                            "store") from None
        raise KeyError_(f"{path} is missing: the store's public key is gone, so no signature can be checked") from None
    except (ValueError, KeyError, TypeError) as e:
        raise KeyError_(f"{path} is unreadable ({e}): the store's public key cannot be read") from None
    if body.get("fingerprint") not in (None, ident.fingerprint):
        raise KeyError_(f"{path}: the public key does not match its recorded fingerprint")
    return ident


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_private(path: Path, store_id: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise KeyError_(f"the writer key {path.name} of store {store_id} is not at {path.parent}: only the process "
                        f"holding that store's keys can append to it (set ${ENV_KEYS} or ${ENV_STATE} to where they "
                        "are); reading and verifying need no key") from None
    except PermissionError:
        raise KeyError_(f"cannot read {path}: permission denied") from None


def check_secret_env() -> None:
    """Raise (KeyError_) when $KVLEDGER_STORE_SECRET is set but unusable."""
    WriterKeys._env_secrets()


class WriterKeys:
    """The writer's side: the signing key and the two pseudonymisation secrets of one store."""

    def __init__(self, identity: Identity, signing: Ed25519PrivateKey, pseudonym: bytes, ngram: bytes):
        self.identity, self._signing = identity, signing
        self.keys = Keys(pseudonym, ngram)

    @classmethod
    def open_or_create(cls, root: Path) -> "WriterKeys":
        """Load the keys of the store at ``root``; a new store gets fresh keys (outside it) and its
        store.json. A store whose store.json is gone while its chain is not is refused."""
        if (root / STORE_FILE).exists():
            ident = read_identity(root)
            kd = key_dir(ident.store_id)
            signing = Ed25519PrivateKey.from_private_bytes(_read_private(kd / "signing.key", ident.store_id))
            if signing.public_key().public_bytes_raw() != ident.public_key:
                raise KeyError_(f"the signing key at {kd} is not the one {root / STORE_FILE} names")
            pseud, ngram = cls._secrets(kd, ident.store_id)
            return cls(ident, signing, pseud, ngram)
        if any((root / "chain").glob("*")):
            read_identity(root)                # names an older kvledger's store, or the deleted key
            raise KeyError_(f"{root / STORE_FILE} is missing but the store has a chain")
        store_id = os.urandom(8).hex()
        kd = key_dir(store_id)
        kd.mkdir(parents=True, exist_ok=True, mode=0o700)
        signing = Ed25519PrivateKey.generate()
        _write_private(kd / "signing.key", signing.private_bytes_raw())
        if not os.environ.get(ENV_SECRET):
            _write_private(kd / "pseudonym.key", os.urandom(32))
            _write_private(kd / "ngram.key", os.urandom(32))
        ident = Identity(store_id, signing.public_key().public_bytes_raw())
        body = json.dumps({"format": STORE_FORMAT, "store_id": store_id, "public_key": ident.public_key.hex(),
                           "fingerprint": ident.fingerprint, "key_dir": str(kd)}, indent=1)
        tmp = root / f".tmp-{STORE_FILE}"
        tmp.write_text(body)
        os.replace(tmp, root / STORE_FILE)
        pseud, ngram = cls._secrets(kd, store_id)
        return cls(ident, signing, pseud, ngram)

    @staticmethod
    def _secrets(kd: Path, store_id: str) -> tuple[bytes, bytes]:
        env = WriterKeys._env_secrets()
        if env is not None:
            return env
        return _read_private(kd / "pseudonym.key", store_id), _read_private(kd / "ngram.key", store_id)

    @staticmethod
    def _env_secrets() -> tuple[bytes, bytes] | None:
        env = os.environ.get(ENV_SECRET)
        if env:
            try:
                secret = bytes.fromhex(env)
            except ValueError:
                raise KeyError_(f"${ENV_SECRET} must be hex (e.g. the output of `openssl rand -hex 32`), "
                                f"got {len(env)} characters that are not") from None
            if len(secret) < 16:
                raise KeyError_(f"${ENV_SECRET} must hold at least 16 bytes (32 hex characters), got {len(secret)}")
            return (hmac.new(secret, b"kvledger/pseudonym-key", hashlib.sha256).digest(),
                    hmac.new(secret, b"kvledger/ngram-key", hashlib.sha256).digest())
        return None

    def sign(self, message: bytes) -> str:
        return self._signing.sign(message).hex()


def reader_keys(root: Path) -> Keys:
    """The pseudonymisation keys of the store at ``root``, for the key holder (``kvledger tenants
    resolve``): read, never created. Without them, refused."""
    ident = read_identity(Path(root))
    kd = key_dir(ident.store_id)
    env = WriterKeys._env_secrets()
    if env is not None:
        return Keys(*env)
    if not (kd / "pseudonym.key").is_file():
        raise KeyError_(f"refused: no pseudonym key of store {ident.store_id} at {kd}: only the key holder can map "
                        f"its pseudonyms back to names (set ${ENV_KEYS} or ${ENV_STATE} to where the keys are)")
    return Keys(*WriterKeys._secrets(kd, ident.store_id))


class Keys:
    """Keyed pseudonyms, under two separate secrets: tenant ids and scopes (HMAC-SHA256), content
    tags and n-grams (AES-256 as a keyed pseudorandom function, vectorised over whole columns: one
    block per tag; CBC-MAC over an n-gram's tokens, one fixed length per key, so CBC-MAC is a PRF)."""

    def __init__(self, pseudonym_secret: bytes, ngram_secret: bytes):
        self._pseud = hmac.new(pseudonym_secret, b"kvledger/pseudonym", hashlib.sha256).digest()
        self._tag_key = hmac.new(pseudonym_secret, b"kvledger/tag-prf", hashlib.sha256).digest()
        self._ngram_key = hmac.new(ngram_secret, b"kvledger/ngram-prf", hashlib.sha256).digest()
        self._named: dict[str, str] = {}    # pseudonyms made, by name: a tenant's requests ask again and again

    PSEUDONYMS_KEPT = 4096      # names whose pseudonyms are kept (past it the memo starts over)

    def pseudonym(self, value: str) -> str:
        """The name's keyed pseudonym (16 hex digits of HMAC-SHA256). Kept per name: the engine
        thread asks for a request's tenant and scope at every arrival (an HMAC is a few us)."""
        got = self._named.get(value)
        if got is None:
            if len(self._named) >= self.PSEUDONYMS_KEPT:
                self._named = {}
            got = self._named[value] = hmac.new(self._pseud, value.encode(), hashlib.sha256).hexdigest()[:16]
        return got

    def tag_pseudonyms(self, tags: np.ndarray) -> np.ndarray:
        """int64 tags -> int64 pseudonyms (the first 8 bytes of AES_k(tag || 0))."""
        blocks = np.zeros((len(tags), 16), dtype=np.uint8)
        blocks[:, :8] = np.ascontiguousarray(tags, dtype="<i8").view(np.uint8).reshape(-1, 8)
        return _cbc_mac(self._tag_key, blocks)

    def ngram_pseudonyms(self, windows: np.ndarray) -> np.ndarray:
        """[N, n] token ids (each < 2**32) -> int64 pseudonyms, one per window: CBC-MAC under the
        n-gram key of the window's tokens as little-endian uint32, zero-padded to whole blocks."""
        w = np.asarray(windows)
        if not len(w):
            return np.zeros(0, dtype=np.int64)
        if w.size and int(w.max()) >= 1 << 32:
            raise ValueError("token ids must be < 2**32")
        raw = np.ascontiguousarray(w, dtype="<u4").view(np.uint8).reshape(len(w), -1)
        pad = -raw.shape[1] % 16
        return _cbc_mac(self._ngram_key, np.pad(raw, ((0, 0), (0, pad))) if pad else raw)

    def ngram_pseudonym(self, tokens) -> int:
        """One window, through the cipher's own CBC mode (the reference the columns must equal)."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        msg = np.asarray(list(tokens), dtype="<u4").tobytes()
        msg += bytes(-len(msg) % 16)
        last = Cipher(algorithms.AES(self._ngram_key), modes.CBC(bytes(16))).encryptor().update(msg)[-16:]
        return int.from_bytes(last[:8], "little", signed=True)


def _cbc_mac(key: bytes, blocks: np.ndarray) -> np.ndarray:
    """CBC-MAC with AES-256 of every row of ``blocks`` ([N, 16*k] uint8) at once: k passes of ECB over
    the whole column (the chaining is per row), the first 8 bytes of the last block as int64."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()     # ECB: each block alone, so one encryptor serves
    state = np.zeros((len(blocks), 16), dtype=np.uint8)
    for b in range(0, blocks.shape[1], 16):
        state = np.frombuffer(enc.update((state ^ blocks[:, b:b + 16]).tobytes()), dtype=np.uint8).reshape(-1, 16)
    return state[:, :8].copy().view("<i8").ravel().astype(np.int64, copy=False)
