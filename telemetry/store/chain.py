"""The store's signed chain, its intents and its anchor; ``verify``, which needs no secret.

    ROOT/store.json               store id + the writer's Ed25519 public key (telemetry/store/keys.py)
    ROOT/chain/<seq>.json         one flush: {"store_id", "links": [...], "signature"}
    ROOT/intent.json              the segments the writer is about to put in place (signed)
    ROOT/seal.json                written by a clean close: the head it closed on (signed)
    ANCHOR (outside the store)    one signed JSON line per flush: {store_id, seq, head, seal}

link = SHA-256(prev link | seq | table | file | rows | sha256(file) [| replaces=seq,seq,...]). The hash chain makes any edit,
removal, reordering or insertion visible; the signature on each chain file's last link (Ed25519,
by a key that never enters the store) makes recomputing the chain useless to anyone but the
writer. What a copy of the store alone cannot show is its own truncation - deleting the newest
chain files leaves a shorter chain that still verifies - so every flush's signed head also goes
to an anchor outside the store (a per-user state directory by default: put it on another disk or
a mounted remote; it is logged to ``kvledger.anchor`` and, with an OTLP endpoint set, sent there
as a ``kvledger.anchor`` span by ``Telemetry``, so a collector or SIEM keeps a copy). ``verify``
with the anchor names a truncation: "store ends at seq N, anchor says M".

Merges: the writer merges a table's small segments into one (telemetry/store/writer.py, compaction);
the merge's link names the links it replaces (``replaces``), holds exactly their rows, their rows one
after another in that order, and is chained and signed like any link. The replaced segments' files
may then be deleted: ``verify`` does not ask for them, readers read the merge (``live_links``).

Strangers: the writer signs an intent (name, sha256 of every segment of a flush) before it renames
a segment into place; after a crash it adopts exactly those. Any other file in the store is
reported by ``verify`` and never read or linked.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from telemetry.store.keys import ENV_STATE, Identity, KeyError_, WriterKeys, read_identity, state_dir, substituted

GENESIS = "0" * 64
ENV_ANCHOR = "KVLEDGER_ANCHOR"
anchor_log = logging.getLogger("kvledger.anchor")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Link(NamedTuple):
    seq: int
    table: str
    file: str
    rows: int
    sha256: str
    prev: str
    link: str
    # a compaction (the writer merged small segments of one table into this file): the seqs of the
    # links it replaces, comma-separated, in the order their rows follow one another in the file
    replaces: str = ""

    def payload(self) -> str:
        base = f"{self.seq}|{self.table}|{self.file}|{self.rows}|{self.sha256}"
        return f"{base}|replaces={self.replaces}" if self.replaces else base

    def computed(self) -> str:
        return hashlib.sha256(f"{self.prev}|{self.payload()}".encode()).hexdigest()

    def parts(self) -> list[int]:
        """The seqs this link replaces (none: a flush's segment, or an entry no writer wrote - its
        link hash, or else the rows it claims, names it)."""
        try:
            return [int(s) for s in str(self.replaces).split(",")] if self.replaces else []
        except ValueError:
            return []

    def entry(self) -> dict:
        """As written in a chain file (a flush's link without the ``replaces`` key, as before compaction)."""
        d = self._asdict()
        if not self.replaces:
            del d["replaces"]
        return d


def replaced(links: "list[Link]") -> dict[int, int]:
    """seq -> the seq of the compaction that replaced it."""
    return {r: ln.seq for ln in links for r in ln.parts()}


def live_links(links: "list[Link]") -> "list[Link]":
    """The links whose files hold the store's rows now: every link no compaction replaced."""
    gone = replaced(links)
    return [ln for ln in links if ln.seq not in gone]


def originals(links: "list[Link]") -> dict[int, list[Link]]:
    """A compaction's seq -> the flushes' links whose rows its file holds, in the file's row order
    (a compaction of compactions flattened): what a reader that had read those segments has read."""
    by_seq = {ln.seq: ln for ln in links}
    out: dict[int, list[Link]] = {}
    for ln in links:                # seq order: a compaction's parts come before it
        if ln.replaces:
            out[ln.seq] = [o for r in ln.parts() for o in (out.get(r) or [by_seq[r]] if r in by_seq else [])]
    return out


def data_rows(links: "list[Link]") -> int:
    """The rows these links add to the store (a compaction's rows are its parts', counted there)."""
    return sum(ln.rows for ln in links if not ln.replaces)


def _msg(kind: str, store_id: str, *parts) -> bytes:
    return "|".join(["kvledger-" + kind + "/1", store_id, *map(str, parts)]).encode()


class ChainFile(NamedTuple):
    name: str
    links: list[Link]
    signature: str | None
    level: int = 0          # a pack of CHAIN_FAN ** level flushes' files (the writer's packing; a hint, unsigned)


_PARSED: dict[tuple[str, bytes], ChainFile] = {}     # (name, BLAKE2b of its bytes) -> the chain file parsed
PARSED_KEEP = 200_000
READ_TRIES = 8              # listings of chain/ a reader tries while a writer packs files it had listed


def read_chain_files(root: Path) -> list[ChainFile]:
    """Every chain file in name (= first seq) order; raises ValueError naming an unreadable one.
    Each file's bytes are read every time; its parse is kept in this process under their digest
    (a reader opens the chain three times a command, a dashboard on every refresh: at 2000 flushes
    the JSON alone took 0.45 s each time) - bytes that differ in any way are parsed again.

    A writer packs older chain files into one (writer.py ``CHAIN_FAN``): the pack is put in place
    of the first of them (rename), then the others are deleted. A file whose links all repeat,
    link for link, links of an earlier file is one a pack covers (a writer stopped before deleting
    it, or a listing taken in between): it is left out; one that repeats seqs with other links is
    named. A file listed and gone when opened (deleted by a pack): the listing is taken again."""
    return _chain_files(root)[0]


def covered_chain_files(root: Path) -> list[str]:
    """The chain files a pack covers (see ``read_chain_files``): what a writer deletes on opening."""
    return _chain_files(root)[1]


def _chain_files(root: Path) -> tuple[list[ChainFile], list[str]]:
    chain = root / "chain"
    for _ in range(READ_TRIES):
        try:
            return _dedup([_read_chain_file(chain, name)
                           for name in (sorted(os.listdir(chain)) if chain.is_dir() else [])
                           if not name.startswith(".tmp-")])
        except FileNotFoundError:
            continue
    raise ValueError(f"chain/ changed under every one of {READ_TRIES} readings (files listed were gone when opened)")


def _read_chain_file(chain: Path, name: str) -> ChainFile:
    try:
        stem, dot, suffix = name.rpartition(".")
        if not (dot and suffix == "json" and stem.isdigit()):
            raise ValueError("not a chain file")
        with open(os.path.join(chain, name), "rb") as f:
            data = f.read()
        key = (name, hashlib.blake2b(data, digest_size=16).digest())
        cf = _PARSED.get(key)
        if cf is None:
            cf = parse_chain_file(name, data)
            if len(_PARSED) >= PARSED_KEEP:
                _PARSED.clear()
            _PARSED[key] = cf
        return cf
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"chain/{name} is unreadable ({str(e)[:80]}): not written by this store's writer") from None


def _dedup(files: list[ChainFile]) -> tuple[list[ChainFile], list[str]]:
    """(the files, without those a pack covers; the names of those)."""
    out, covered = [], []
    seen: dict[int, Link] = {}
    for cf in files:
        if cf.links and all(ln.seq in seen for ln in cf.links):
            if all(seen[ln.seq] == ln for ln in cf.links):         # entry for entry
                covered.append(cf.name)
                continue
            raise ValueError(f"chain/{cf.name} repeats seqs {cf.links[0].seq}..{cf.links[-1].seq} of an earlier chain "
                             "file with other links: not written by this store's writer")
        out.append(cf)         # (seqs out of order otherwise: the walk names the gap)
        for ln in cf.links:
            seen.setdefault(ln.seq, ln)
    return out, covered


def parse_chain_file(name: str, data: bytes) -> ChainFile:
    body = json.loads(data.decode())
    if isinstance(body, dict) and "links" in body:
        level = body.get("level", 0)
        return ChainFile(name, [Link(**e) for e in body["links"]], body.get("signature"),
                         level if isinstance(level, int) and 0 <= level < 64 else 0)
    return ChainFile(name, [Link(**e) for e in (body if isinstance(body, list) else [body])], None)    # format 1


def read_chain(root: Path) -> list[Link]:
    return [ln for f in read_chain_files(root) for ln in f.links]


def chain_body(keys: WriterKeys, links: list[Link], level: int = 0) -> bytes:
    """A chain file for one flush's links (or, ``level`` > 0, a pack of earlier files' links), signed
    over its last link (which commits to all before it)."""
    sid = keys.identity.store_id
    return json.dumps({"store_id": sid, "links": [ln.entry() for ln in links],
                       "signature": keys.sign(_msg("chain", sid, links[-1].seq, links[-1].link)),
                       **({"level": level} if level else {})}).encode()


def intent_body(keys: WriterKeys, segments: list[tuple[int, str, str, int, str, str]]) -> bytes:
    """(seq, table, file, rows, sha256, replaces) of each segment about to be put in place, signed."""
    sid = keys.identity.store_id
    listed = [{"seq": s, "table": t, "file": f, "rows": r, "sha256": h, **({"replaces": rp} if rp else {})}
              for s, t, f, r, h, rp in segments]
    return json.dumps({"store_id": sid, "segments": listed,
                       "signature": keys.sign(_msg("intent", sid, json.dumps(listed, sort_keys=True)))}).encode()


def read_intent(root: Path, ident: Identity) -> dict[str, dict]:
    """file -> its intent entry, if ROOT/intent.json is there and signed by the store's key."""
    try:
        body = json.loads((root / "intent.json").read_text())
        listed = body["segments"]
        if ident.check(_msg("intent", ident.store_id, json.dumps(listed, sort_keys=True)), body["signature"]):
            return {e["file"]: e for e in listed}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


# ---- the anchor ----------------------------------------------------------------------------------
def anchor_path(store_id: str, override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    if os.environ.get(ENV_ANCHOR):
        return Path(os.environ[ENV_ANCHOR])
    return state_dir() / "anchors" / f"{store_id}.jsonl"


def anchor_entry(keys: WriterKeys, seq: int, head: str, seal: bool) -> dict:
    sid = keys.identity.store_id
    return {"store_id": sid, "seq": seq, "head": head, "seal": seal, "fingerprint": keys.identity.fingerprint,
            "ts": time.time_ns(), "signature": keys.sign(_msg("anchor", sid, seq, head, seal))}


def append_anchor(path: Path, entry: dict) -> None:
    """One line, appended and fsynced (the anchor is evidence too); also logged for a collector."""
    line = json.dumps(entry, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    data = (line + "\n").encode()
    size = os.fstat(fd).st_size
    try:
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write (disk full?)")
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)            # never a torn line: the anchor stays as it was
            raise
    finally:
        os.close(fd)
    anchor_log.info(line)


def _anchor_entries(path: Path, ident: Identity, cache: dict | None = None) -> tuple[list[dict], str | None]:
    """This store's entries in the anchor, and the first problem with them (None if none)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if cache is not None and ("anchor", line) in cache:
            out.append(cache[("anchor", line)])
            continue
        try:
            e = json.loads(line)
        except ValueError:
            return out, f"anchor {path} line {n} is not JSON (the anchor was edited)"
        if e.get("store_id") != ident.store_id:
            continue
        if not ident.check(_msg("anchor", ident.store_id, e.get("seq"), e.get("head"), e.get("seal")),
                           str(e.get("signature"))):
            return out, (f"anchor {path} line {n} is not signed by this store's public key "
                         f"(fingerprint {ident.fingerprint}): the store's key was replaced, or the anchor was edited")
        out.append(e)
        if cache is not None:
            cache[("anchor", line)] = e
    return out, None


# ---- verify ---------------------------------------------------------------------------------------
class Verdict(NamedTuple):
    ok: bool
    segments: int
    rows: int
    head: str                  # the last good link: the store's digest
    broken: str | None         # the first problem, named
    warnings: list[str]
    seq: int = -1              # the last good link's seq
    anchor: str | None = None  # the anchor checked against (None: none found)
    anchor_seq: int | None = None
    sealed: bool = False       # the last writer closed cleanly on this head
    store_id: str = ""
    fingerprint: str = ""
    unlinked: tuple = ()       # (seq, table, file, rows, sha256, replaces) a killed writer put in place, signed intent


def verify(root: str | Path, anchor: str | Path | None = None, *, cache: dict | None = None) -> Verdict:
    """Check the store against its own signatures and (when one is found) its anchor. Reads only.
    ``cache``: a dict a long-lived reader keeps (the dashboard) so a growing store is verified
    incrementally: segment hashes, verified chain-file signatures and verified anchor lines, each
    keyed by its file's (path, size, mtime_ns, inode). A file edited in place with its size and
    times restored would pass such a reader until it restarts; ``kvledger verify`` keeps no cache."""
    root = Path(root)
    if not (root / "chain").is_dir():
        from telemetry.errors import StoreError
        raise StoreError(f"no kvledger store at {root} (expected {root}/chain)")
    try:
        ident = read_identity(root)
    except KeyError_ as e:
        return Verdict(False, 0, 0, GENESIS, str(e), [])
    base = {"store_id": ident.store_id, "fingerprint": ident.fingerprint}
    try:
        files = read_chain_files(root)
    except ValueError as e:
        return Verdict(False, 0, 0, GENESIS, str(e), [], **base)
    walked = _walk_chain(root, ident, files, cache, base)
    if isinstance(walked, Verdict):
        return walked
    prev, rows, n, seq, linked = walked
    warnings: list[str] = []
    unlinked, stranger = _unlinked(root, ident, seq, linked, cache, warnings)
    if stranger:
        return Verdict(False, n, rows, prev, stranger, warnings, seq, **base)
    sealed = _sealed(root, ident, seq, prev)
    # the key holder's record of which store lives at this path: a store rewritten under a new key
    # and id, or another genuine store moved here, declares an identity that is not the recorded one
    swapped = substituted(root, ident)
    # the anchor: names a truncation or a rewrite that the store alone cannot show
    apath = anchor_path(ident.store_id, anchor)
    if not apath.is_file():
        if anchor is not None:
            what = "is not a file" if apath.exists() else "does not exist"
            return Verdict(False, n, rows, prev, f"anchor {apath} {what}", warnings, seq, **base)
        if swapped:
            return Verdict(False, n, rows, prev, swapped, warnings, seq, None, None, sealed, **base)
        warnings.append(f"no anchor at {apath} (set ${ENV_STATE} or --anchor): without it, deleting the newest "
                        "history cannot be detected")
        return Verdict(True, n, rows, prev, None, warnings, seq, None, None, sealed, unlinked=tuple(unlinked), **base)
    entries, problem = _anchor_entries(apath, ident, cache)
    if problem:
        return Verdict(False, n, rows, prev, problem, warnings, seq, str(apath), None, sealed, **base)
    if swapped:
        return Verdict(False, n, rows, prev, swapped, warnings, seq, str(apath), None, sealed, **base)
    if not entries:
        warnings.append(f"anchor {apath} holds nothing for store {ident.store_id}")
        return Verdict(True, n, rows, prev, None, warnings, seq, str(apath), None, sealed, unlinked=tuple(unlinked), **base)
    top = max(entries, key=lambda e: e["seq"])
    heads = {-1: GENESIS, **{ln.seq: ln.link for cf in files for ln in cf.links}}   # -1: a store closed empty
    if seq < top["seq"]:
        return Verdict(False, n, rows, prev, f"truncated: store ends at seq {seq}, anchor says {top['seq']} "
                       f"(the newest {top['seq'] - seq} segment(s) and their links were removed)", warnings, seq,
                       str(apath), top["seq"], sealed, **base)
    for e in entries:
        if heads.get(e["seq"]) != e["head"]:
            return Verdict(False, n, rows, prev, f"history rewritten: link {e['seq']} is not the head the anchor "
                           "recorded for it", warnings, seq, str(apath), top["seq"], sealed, **base)
    if seq > top["seq"]:
        warnings.append(f"segments {top['seq'] + 1}..{seq} are not anchored yet (the writer is running, or stopped "
                        "before anchoring them)")
    return Verdict(True, n, rows, prev, None, warnings, seq, str(apath), top["seq"], sealed,
                   unlinked=tuple(unlinked), **base)


HASH_THREADS = min(4, os.cpu_count() or 1)     # threads hashing a cold store's segments (hashlib lets go of the GIL)
HASH_AHEAD_BYTES = 32 << 20                     # ... where the files not hashed yet hold at least this much


def _hash_ahead(paths: list[Path], cache: dict) -> None:
    """Hash into ``cache``, on HASH_THREADS threads, the files not in it yet (under ``_sha``'s key):
    a first verify of a big store is sha256 over every byte, one core's work spread over all of
    them. What cannot be read is left to the walk, which names it."""
    todo: dict[tuple, Path] = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if key not in cache:
            todo[key] = p
    if HASH_THREADS < 2 or len(todo) < 2 or sum(k[1] for k in todo) < HASH_AHEAD_BYTES:
        return

    def one(p: Path) -> str | None:
        try:
            return sha256_file(p)
        except OSError:
            return None
    keys = sorted(todo, key=lambda k: -k[1])        # the largest first: the threads end together
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for key, h in zip(keys, pool.map(one, [todo[k] for k in keys])):
            if h is not None:
                cache[key] = h


def _walk_chain(root: Path, ident, files, cache: dict | None, base: dict):
    """Every link in order: sequence, linkage, entry hash, file hash, and each chain file's signature.
    (prev, rows, segments, seq, linked files) when all hold, else the Verdict naming the first break.

    A compaction's link must replace earlier links of its own table that nothing replaced yet, and
    hold exactly their rows; the files it replaced may be gone (the writer deletes them after a
    grace period) and are not checked: nobody reads them (``live_links``) - the compaction's file,
    hashed and signed like any segment, is what holds their rows now. (A missing file that a later
    merge claims is excused until the walk reaches that merge: an edited or unsigned merge is named
    there, where it stands, and the store does not verify.)"""
    if cache is None:
        cache = {}          # this walk's own: every file still hashed once, nothing kept after it
    links = [link for cf in files for link in cf.links]
    gone = replaced(links)
    _hash_ahead([root / link.file for link in links if link.seq not in gone], cache)
    path = root
    prev, rows, n, seq = GENESIS, 0, 0, -1
    linked: set[str] = set()
    walked: dict[int, Link] = {}
    merged: set[int] = set()
    for cf in files:
        for link in cf.links:
            problem = None
            if link.seq not in gone:
                path = root / link.file
            if link.seq != seq + 1:
                problem = f"sequence gap: expected {seq + 1}, found {link.seq} (a segment was removed)"
            elif link.prev != prev:
                problem = "does not link to the previous segment (reordered or inserted)"
            elif link.computed() != link.link:
                problem = "link hash does not match its entry (the entry was edited)"
            elif link.replaces and (why := _bad_compaction(link, walked, merged)):
                problem = why
            elif link.seq not in gone and not path.is_file():
                problem = "segment file is missing"
            elif link.seq not in gone and _sha(path, cache) != link.sha256:
                problem = "segment content does not match its hash (the file was modified)"
            if problem:
                return Verdict(False, n, rows, prev, f"segment {link.seq} ({link.file}): {problem}", [], seq, **base)
            prev, rows, n, seq = link.link, rows + (0 if link.replaces else link.rows), n + 1, link.seq
            linked.add(link.file)
            walked[link.seq] = link
            merged.update(link.parts())
        last = cf.links[-1] if cf.links else None
        if cf.signature is None or last is None or not _checked(
                cache, ("sig", cf.name, last.link, cf.signature),
                lambda: ident.check(_msg("chain", ident.store_id, last.seq, last.link), cf.signature)):
            return Verdict(False, n - len(cf.links), rows - data_rows(cf.links), cf.links[0].prev
                           if cf.links else prev, f"chain/{cf.name}: not signed by this store's key "
                           f"(fingerprint {ident.fingerprint}): rewritten by someone without it", [],
                           cf.links[0].seq - 1 if cf.links else seq, **base)
    return prev, rows, n, seq, linked


def _bad_compaction(link: Link, walked: dict[int, Link], merged: set[int]) -> str | None:
    """What is wrong with a compaction's link, given the links before it (None: nothing)."""
    parts = link.parts()
    if not parts:
        return f"a compaction whose replaced segments cannot be read ({str(link.replaces)[:40]!r})"
    for r in parts:
        if r not in walked:
            return f"a compaction replaces segment {r}, which is not an earlier link"
        if walked[r].table != link.table:
            return f"a compaction of {link.table} replaces segment {r} of {walked[r].table}"
        if r in merged or parts.count(r) > 1:
            return f"a compaction replaces segment {r}, which was already replaced"
    if sum(walked[r].rows for r in parts) != link.rows:
        return (f"a compaction holds {link.rows} rows, the segments it replaces "
                f"{sum(walked[r].rows for r in parts)}")
    return None


def _unlinked(root: Path, ident, seq: int, linked: set[str], cache: dict | None, warnings: list[str]):
    """Files the chain does not name: a killed writer's signed tail (kept, for the next writer to
    link), a writer's temp file (ignored), or a stranger - ([unlinked], the stranger named or None)."""
    intent, unlinked = read_intent(root, ident), []
    for p in sorted((root / "segments").rglob("*")) if (root / "segments").is_dir() else []:
        rel = str(p.relative_to(root))
        if p.is_dir() or rel in linked:
            continue
        if p.name.startswith(".tmp-"):
            warnings.append(f"{rel}: a temp file a writer left when it stopped mid-write; readers ignore it")
            continue
        e = intent.get(rel)
        if e is not None and e["seq"] > seq and p.is_file() and _sha(p, cache) == e["sha256"]:
            unlinked.append((e["seq"], e["table"], rel, e["rows"], e["sha256"], str(e.get("replaces", ""))))
            warnings.append(f"{rel}: written but not linked (the writer stopped between segment and link); "
                            "readers ignore it until the next writer links it")
            continue
        return unlinked, (f"{rel}: not written by this store's writer (no link or signed intent names it): a file "
                          "was dropped into the store")
    return unlinked, None


def damaged_segments(root: str | Path, cache: dict | None = None) -> list[str]:
    """The chained segment files a reader must not open: missing, or whose bytes no longer match the
    hash their link signed (a flipped byte can make a Parquet reader fail or, worse, read garbage).
    What ``--allow-unverified`` leaves out - and says it left out."""
    root = Path(root)
    out = []
    try:
        links = read_chain(root)
    except ValueError:          # an unreadable chain: the reader refuses it with its own words
        return out
    for link in live_links(links):
        path = root / link.file
        if not path.is_file() or _sha(path, cache) != link.sha256:
            out.append(link.file)
    return out


def _checked(cache: dict | None, key: tuple, check) -> bool:
    """A signature check, remembered (only when it passed) under a key naming exactly what was signed."""
    if cache is not None and cache.get(key):
        return True
    ok = check()
    if ok and cache is not None:
        cache[key] = True
    return ok


def _sha(path: Path, cache: dict | None) -> str:
    if cache is None:
        return sha256_file(path)
    st = path.stat()
    # ctime too: an edit in place with its size and mtime restored (os.utime) still moves the ctime
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in cache:
        cache[key] = sha256_file(path)
    return cache[key]


def file_columns(path: str | Path, cache: dict | None) -> tuple | None:
    """A segment file's columns as Parquet gives them back - ((name, Arrow type), ...) - kept in
    ``cache`` under the file's path, size, mtime, ctime and inode (any change misses) once its hash is
    there (a file this reader verified), and in this process under the same key (without ``cache``:
    a later read of the snapshot's segments, grown.py's and evidence.py's); None where neither holds
    it (the reader then binds it as before, every file's schema read by DuckDB). A table's segments
    are almost always one schema: bound as one group, DuckDB reads no other file's footer to bind
    them (``reader.table_relation``) - at 2000 segments a table, the store's views bound in 0.3 s
    against 2.7 s (one-off)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if cache is None or key not in cache:       # not verified by this reader: what this process read, if any
        return _COLS.get(key)
    cols = cache.get(("cols", *key))
    if cols is None:
        import pyarrow.parquet as pq
        try:
            cols = cache[("cols", *key)] = tuple((f.name, str(f.type)) for f in pq.read_schema(path))
        except Exception:     # noqa: BLE001 - unreadable: DuckDB names it where it reads the file
            return None
    if len(_COLS) >= PARSED_KEEP:
        _COLS.clear()
    _COLS[key] = cols
    return cols


_COLS: dict[tuple, tuple] = {}      # file_columns' answers in this process (the later reads of a snapshot's segments)


class HashCache(dict):
    """The segment hashes a reader computed, kept between commands outside the store (the state
    directory, beside the keys: the same custody), so a segment verified once is not re-read on
    every command - verification that does not grow with history. An entry is keyed by the file's
    path, size, mtime, ctime and inode: any change to the file (its content, or a substitute in its
    place) misses and is hashed again; the signatures and the anchor are checked every time.
    ``kvledger verify`` keeps no cache; unwritable state is no error (the cache is only speed)."""

    def __init__(self, root: str | Path):
        super().__init__()
        real = str(Path(root).resolve())
        self.path = state_dir() / "verified" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"
        try:
            for e in json.loads(self.path.read_text()):
                self[tuple(e[:5])] = e[5]
        except (OSError, ValueError, TypeError, IndexError):
            pass
        self._loaded = len(self)
        try:                                    # the files' column signatures (file_columns), same keys
            for e in json.loads(self._cols_path.read_text()):
                if tuple(e[:5]) in self:
                    self[("cols", *e[:5])] = tuple(tuple(c) for c in e[5])
        except (OSError, ValueError, TypeError, IndexError):
            pass
        self._cols_loaded = len(self) - self._loaded
        # the chain files whose signature checked out: (name, the last link, the signature) - a chain
        # file with another last link or signature is checked again (at 2000 flushes the Ed25519
        # checks alone were 0.35 s of every command)
        try:
            for e in json.loads(self._sigs_path.read_text()):
                self[("sig", *map(str, e[:3]))] = True
        except (OSError, ValueError, TypeError, IndexError):
            pass
        self._sigs_loaded = len(self) - self._loaded - self._cols_loaded

    @property
    def _cols_path(self) -> Path:
        return self.path.with_suffix(".cols.json")

    @property
    def _sigs_path(self) -> Path:
        return self.path.with_suffix(".sigs.json")

    def save(self) -> None:
        # (the entries copied in one step: another thread of the process may verify with this cache
        # meanwhile - a dashboard's page loads, its server's warm-up - and a dict that grows while a
        # comprehension walks it raises)
        items = list(self.items())
        files = [[*k, v] for k, v in items if len(k) == 5 and isinstance(v, str) and isinstance(k[0], str)]
        cols = [[*k[1:], v] for k, v in items if len(k) == 6 and k[0] == "cols"]
        sigs = [list(k[1:]) for k, v in items if len(k) == 4 and k[0] == "sig" and v is True]
        if len(files) != self._loaded:      # the store changed: the files gone since (a writer's merged
            files = [e for e in files if os.path.exists(e[0])]      # segments) are forgotten, not kept forever
            cols = [e for e in cols if os.path.exists(e[0])]
        for path, entries, loaded in ((self.path, files, self._loaded), (self._cols_path, cols, self._cols_loaded),
                                      (self._sigs_path, sigs, self._sigs_loaded)):
            if len(entries) == loaded:
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp-{os.getpid()}-{threading.get_ident()}")
                tmp.write_text(json.dumps(entries))
                os.replace(tmp, path)
            except OSError:
                pass


def _sealed(root: Path, ident: Identity, seq: int, head: str) -> bool:
    try:
        e = json.loads((root / "seal.json").read_text())
    except (OSError, ValueError):
        return False
    return (e.get("seq") == seq and e.get("head") == head
            and ident.check(_msg("anchor", ident.store_id, seq, head, True), str(e.get("signature"))))
