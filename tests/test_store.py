"""The store: chained immutable segments, readable by another process while the engine writes,
tamper-evident (verify names the first broken link), and durable to kill -9 within its window."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.commands.main import main
from telemetry.store import SegmentWriter, StoreError, open_store, verify

FLUSH = 0.2


def _releases(n: int, node: str = "n0") -> dict:
    return {"node": [node] * n, "incarnation": np.arange(n, dtype=np.int64), "pages": [[1, 2]] * n,
            "kind": ["immediate"] * n, "ended_by": ["immediate"] * n, "hold_ns": np.zeros(n, dtype=np.int64),
            "lclock": np.arange(n, dtype=np.int64), "ts": pa.array(np.full(n, time.time_ns()), pa.timestamp("ns"))}


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "store"
    w = SegmentWriter(root)
    for i in range(4):
        w.submit("releases", _releases(3, f"n{i}"))
        w.flush()
    w.close()
    return root


def test_a_clean_store_verifies_and_reads_back(store, capsys):
    v = verify(store)
    assert v.ok and v.segments == 4 and v.rows == 12 and v.broken is None
    con = open_store(store)
    assert con.sql("SELECT count(*) FROM releases").fetchall() == [(12,)]
    assert con.sql("SELECT count(*) FROM page_reads").fetchall() == [(0,)]      # empty tables still exist
    assert main(["verify", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "chain intact and signed" in out and "4 segments" in out and "anchored at seq 3" in out
    assert "sealed by a clean close" in out


def _seg(store: Path, k: int) -> Path:
    return store / json.loads(sorted((store / "chain").glob("*.json"))[k].read_text())["links"][0]["file"]


@pytest.mark.parametrize("tamper, expect", [
    (lambda s: _seg(s, 2).write_bytes(_seg(s, 2).read_bytes()[:-9] + b"X" + _seg(s, 2).read_bytes()[-8:]),
     "segment 2 .*content does not match"),
    (lambda s: _seg(s, 1).unlink(), "segment 1 .*missing"),
    (lambda s: (s / "chain" / "000000001.json").unlink(), "segment 2 .*sequence gap"),
    (lambda s: (s / "chain" / "000000002.json").write_text(
        (s / "chain" / "000000002.json").read_text().replace('"rows": 3', '"rows": 30')), "segment 2 .*edited"),
])
@pytest.mark.parametrize("ahead", [False, True], ids=["one-by-one", "hashed-ahead"])
def test_tampering_is_named_at_the_first_broken_link(store, tamper, expect, ahead, capsys, monkeypatch):
    """Also with every segment hashed ahead on threads (a big store's first verify: chain._hash_ahead)."""
    import re
    if ahead:
        monkeypatch.setattr("telemetry.store.chain.HASH_AHEAD_BYTES", 0)
        monkeypatch.setattr("telemetry.store.chain.HASH_THREADS", 4)
    tamper(store)
    v = verify(store)
    assert not v.ok and re.search(expect, v.broken), v.broken
    assert main(["verify", "--store", str(store)]) == 1
    assert re.search(expect, capsys.readouterr().err)


def test_a_big_stores_segments_are_hashed_ahead_on_threads_with_the_same_verdict(store, monkeypatch):
    """Past HASH_AHEAD_BYTES not hashed yet, verify hashes the segments on HASH_THREADS threads
    first (each once), then walks the chain as before: the same verdict, each file's hash the one
    its link signed; a reader's cache keeps them."""
    import threading
    import telemetry.store.chain as chain
    calls: list[tuple[str, str]] = []
    real = chain.sha256_file

    def spy(path):
        calls.append((threading.current_thread().name, str(path)))
        return real(path)
    monkeypatch.setattr(chain, "sha256_file", spy)
    before = verify(store)
    assert before.ok and len(calls) == 4 and all(t == threading.current_thread().name for t, _ in calls)
    calls.clear()
    monkeypatch.setattr(chain, "HASH_AHEAD_BYTES", 0)
    monkeypatch.setattr(chain, "HASH_THREADS", 4)
    cache: dict = {}
    after = verify(store, cache=cache)
    assert after == before
    assert len(calls) == 4 and len({p for _, p in calls}) == 4                          # each segment once
    assert all(t != threading.current_thread().name for t, _ in calls)                  # on the pool's threads
    calls.clear()
    assert verify(store, cache=cache) == before and calls == []                         # kept by the reader


def test_a_chain_file_parsed_once_in_a_process_is_parsed_again_when_a_byte_changes(store):
    """read_chain_files keeps each chain file's parse under the digest of its bytes: an unchanged
    file is not parsed again, and one whose bytes change - the same size, right after a verify in the
    same process - is, so the change is named."""
    from telemetry.store.chain import read_chain_files
    assert verify(store).ok
    first, again = read_chain_files(store), read_chain_files(store)
    assert [a is b for a, b in zip(first, again)] == [True] * len(first) == [True] * 4
    f = store / "chain" / "000000002.json"
    body = json.loads(f.read_text())
    sig = body["signature"]
    # same size, one hex digit other than it (an "A" for an "a" would be the same bytes: fromhex ignores case)
    body["signature"] = ("0" if sig[0] != "0" else "1") + sig[1:]
    f.write_text(json.dumps(body))
    v = verify(store)
    assert not v.ok and "chain/000000002.json: not signed by this store's key" in v.broken
    assert read_chain_files(store)[2] is not again[2] and read_chain_files(store)[1] is again[1]


def test_a_flush_links_its_segments_in_one_chain_file(tmp_path):
    """The segments of one flush are linked by one chain file (a list of links): it verifies and
    reads back like single links, and an edit to any link inside it is named."""
    root = tmp_path / "s"
    w = SegmentWriter(root)
    w.submit("releases", _releases(3))
    w.submit("ngrams", {"incarnation": np.arange(4, dtype=np.int64), "role": ["prompt"] * 4,
                        "n": np.full(4, 12, dtype=np.int16), "hash": np.arange(4, dtype=np.int64)})
    w.flush()
    w.submit("releases", _releases(2))
    w.close()
    files = sorted((root / "chain").glob("*.json"))
    assert len(files) == 2 and len(json.loads(files[0].read_text())["links"]) == 2
    v = verify(root)
    assert v.ok and v.segments == 3 and v.rows == 9
    con = open_store(root)
    assert con.sql("SELECT count(*) FROM releases").fetchall() == [(5,)] and con.sql("SELECT count(*) FROM ngrams").fetchall() == [(4,)]
    body = json.loads(files[0].read_text())
    body["links"][1]["rows"] += 1
    files[0].write_text(json.dumps(body))
    v = verify(root)
    assert not v.ok and "segment 1 " in v.broken and "edited" in v.broken, v.broken


def test_a_failed_segment_write_leaves_the_store_verifiable(tmp_path, monkeypatch):
    """The disk fails while a flush writes its second segment (fsync raises ENOSPC): the producer
    gets a StoreError naming it, no temp file is left behind, the segment written before it in the
    same flush is still linked, so the store verifies with every row that reached a segment; the
    failed rows stay buffered and are written by the close (which still reports the error and lets
    go of the store), and the next writer goes on from there."""
    import errno
    root = tmp_path / "s"
    w = SegmentWriter(root)
    w.submit("releases", _releases(3))
    w.flush()
    real, calls = os.fsync, []

    def fsync(fd):                # the flush's second segment fails (fsyncs: intent, ngrams, releases, ...)
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    w.submit("releases", _releases(2))
    w.submit("ngrams", {"incarnation": np.arange(4, dtype=np.int64), "role": ["prompt"] * 4,
                        "n": np.full(4, 12, dtype=np.int16), "hash": np.arange(4, dtype=np.int64)})
    with pytest.raises(StoreError, match="No space left"):
        w.flush()
    assert not list(root.rglob(".tmp-*")) and not w.accepting
    v = verify(root)
    assert v.ok and v.segments == 2 and v.rows == 7 and not v.warnings, v
    with pytest.raises(StoreError):
        w.close()
    v = verify(root)
    assert v.ok and v.segments == 3 and v.rows == 9
    w2 = SegmentWriter(root)
    w2.submit("releases", _releases(4))
    w2.close()
    v = verify(root)
    assert v.ok and v.segments == 4 and v.rows == 13 and w2.adopted == []


def _page_writes(n: int, trace_ids: list, span_ids: list, codes: np.ndarray, writer: int) -> dict:
    """page_writes columns as the page ledger hands them over (``Coded`` strings, a ``Ragged`` list)."""
    from telemetry.store import Coded, Ragged
    return {"node": Coded(np.zeros(n, np.int32), ["n0"]), "lclock": np.arange(n, dtype=np.int64),
            "ts": np.full(n, time.time_ns(), dtype=np.int64), "page": np.arange(n, dtype=np.int32),
            "generation": np.ones(n, dtype=np.int64), "slot_first": np.zeros(n, dtype=np.int16),
            "n_slots": np.full(n, 2, dtype=np.int16), "position_first": np.arange(n, dtype=np.int32) * 2,
            "writer": np.full(n, writer, dtype=np.int64), "scope_h": Coded(np.zeros(n, np.int32), ["scope-a"]),
            "tag_h": Ragged(np.arange(n + 1, dtype=np.int64) * 2, np.arange(2 * n, dtype=np.int64)),
            "path": Coded(np.arange(n, dtype=np.int32) % 2, ["prefill", "decode"]),
            "trace_id": Coded(codes, trace_ids), "span_id": Coded(codes, span_ids)}


def test_a_segment_is_encoded_from_the_string_dictionaries_and_reads_back_as_the_schema(tmp_path):
    """The writer encodes the producers' coded strings as Arrow dictionaries (``writing_schema``: no
    value hashed again), a NULL among a dictionary's values included, and stores no Arrow schema in
    the file: every segment reads back - pyarrow and DuckDB - with the schema's types and the values
    handed over, a flush of several parts too."""
    import pyarrow.parquet as pq

    from telemetry.store.schema import arrow_schemas, writing_schema
    assert pa.types.is_dictionary(writing_schema("page_writes").field("trace_id").type)
    assert pa.types.is_dictionary(writing_schema("ngrams").field("role").type)
    assert writing_schema("page_writes").field("tag_h").type == arrow_schemas()["page_writes"].field("tag_h").type
    root = tmp_path / "s"
    w = SegmentWriter(root)
    w.submit("page_writes", _page_writes(4, ["t1", None, "t3"], ["s1", None, "s3"], np.array([0, 1, 2, 0], np.int32), 7))
    w.submit("page_writes", _page_writes(3, [None, "t9"], [None, "s9"], np.array([1, 1, 0], np.int32), 8))
    w.submit("releases", _releases(2))          # a table of plain lists beside it
    w.close()
    segs = sorted((root / "segments").rglob("*.parquet"))
    assert len(segs) == 2
    for f in segs:
        table = f.parent.name
        meta = pq.read_schema(f).metadata or {}
        assert b"ARROW:schema" not in meta
        assert [(x.name, x.type) for x in pq.read_schema(f)] == [(x.name, x.type) for x in arrow_schemas()[table]]
    got = open_store(root).sql("SELECT trace_id, span_id, path, scope_h, boot IS NOT NULL AS b FROM page_writes "
                               "ORDER BY writer, lclock").fetchall()
    assert [r[:2] for r in got] == [("t1", "s1"), (None, None), ("t3", "s3"), ("t1", "s1"),
                                    ("t9", "s9"), ("t9", "s9"), (None, None)]
    assert {r[2] for r in got} == {"prefill", "decode"} and {r[3] for r in got} == {"scope-a"} and all(r[4] for r in got)
    assert verify(root).ok


def test_a_second_writer_is_refused_with_a_clear_error(tmp_path):
    """One writer, really: the lock is the kernel's, on the store directory's descriptor. Deleting
    any file (an old writer.lock, or one planted) lets no second writer in, in this process or in
    another; the lock goes with the writer."""
    w = SegmentWriter(tmp_path / "s")
    try:
        with pytest.raises(StoreError, match="already has a writer"):
            SegmentWriter(tmp_path / "s")
        for f in (tmp_path / "s").glob("*.lock"):
            f.unlink()
        (tmp_path / "s" / "writer.lock").write_text("")          # a planted, unlocked lock file changes nothing
        with pytest.raises(StoreError, match="already has a writer"):
            SegmentWriter(tmp_path / "s")
        other = subprocess.run([sys.executable, "-c", "import sys; from telemetry.store import SegmentWriter\n"
                                f"SegmentWriter({str(tmp_path / 's')!r})"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[1])
        assert other.returncode != 0 and "already has a writer" in other.stderr, other.stderr[-500:]
    finally:
        w.close()
    SegmentWriter(tmp_path / "s").close()                        # released on close


def test_bad_input_names_the_problem(tmp_path, capsys):
    with pytest.raises(StoreError, match="unknown table 'nope'"):
        w = SegmentWriter(tmp_path / "s")
        try:
            w.submit("nope", _releases(1))
        finally:
            w.close()
    assert main(["forensics", "exposures", "--store", str(tmp_path / "missing")]) == 2
    assert "no kvledger store at" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        SegmentWriter(tmp_path / "file")


WRITER = textwrap.dedent("""
    import sys, time
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.models import load_model
    from engine.request import SamplingParams
    from telemetry import Telemetry
    model, tok = load_model("recall")
    tel = Telemetry(sys.argv[1], flush_interval=float(sys.argv[2]), model_name="recall")
    eng = LLMEngine(model, tok, EngineConfig(kv_memory_budget=8 << 20, context_length=512), recorder=tel)
    for i in range(int(sys.argv[3])):
        eng.add_request("the quick brown fox jumps over the lazy dog " * 3, SamplingParams(max_tokens=16), f"t{i % 3}")
        eng.run_until_done()
        print(eng.steps, time.time(), flush=True)
    tel.close()
    print("closed", flush=True)
""")


def _spawn(store: Path, n: int, priority: str = "normal") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(FLUSH), str(n)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "KVLEDGER_WRITER_PRIORITY": priority})


def _max_step(store: Path) -> int:
    rows = open_store(store).sql("SELECT coalesce(max(step_last), 0) FROM page_reads").fetchall()
    return rows[0][0]


def test_another_process_reads_while_the_engine_writes(tmp_path):
    store = tmp_path / "live"
    proc = _spawn(store, 40)
    seen, last = [], 0
    try:
        for line in proc.stdout:
            if line.startswith("closed"):
                break
            last = int(line.split()[0])
            if (store / "chain").is_dir():
                seen.append(_max_step(store))          # a reader process's view: never an error, never a lock
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0
    assert seen == sorted(seen) and len(set(seen)) >= 3, seen   # live: it grew while the writer ran
    assert verify(store).ok and _max_step(store) == last       # clean shutdown flushed everything


@pytest.mark.parametrize("priority", ["normal", "idle"])
def test_kill_9_loses_at_most_the_flush_window(tmp_path, priority):
    """Also with the writer under SCHED_IDLE on cores that the engine and busy processes never leave
    idle: the engine raises it for an overdue flush (without that, nothing at all was flushed here)."""
    store = tmp_path / "killed"
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"])
            for _ in range(max(1, (os.cpu_count() or 1) - 1))] if priority == "idle" else []   # + the engine: every core
    try:
        proc = _spawn(store, 10_000, priority)
        progress = []
        for line in proc.stdout:
            progress.append((int(line.split()[0]), float(line.split()[1])))
            if len(progress) >= 6 and progress[-1][1] - progress[0][1] > 1.5:
                break
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.time()
        proc.wait()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    v = verify(store)
    assert v.ok, v.broken                                       # every linked segment intact
    # everything the engine had done one flush window (+ slack for one segment write) before the kill is there
    window = FLUSH + 1.0
    durable = max(step for step, t in progress if t <= killed_at - window)
    assert _max_step(store) >= durable
    # the next writer links any segment the killed one renamed into place but did not link
    w = SegmentWriter(store)
    w.close()
    v2 = verify(store)
    assert v2.ok and not v2.warnings and v2.segments >= v.segments


def test_store_copy_without_the_lock_file_is_readable(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("writer.lock", "secret.key"))
    assert open_store(copy).sql("SELECT count(*) FROM releases").fetchall() == [(12,)]


def test_readme_schema_is_schema_sql():
    """schema.sql is the one source of truth; the README's copy must not drift from it."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    block = readme.split("<!-- schema -->")[1].split("<!-- /schema -->")[0]
    assert (root / "telemetry" / "store" / "schema.sql").read_text().strip() in block


# ---- custody, signatures and the anchor (issue 17) ---------------------------------------------------
def _links(store: Path) -> list[Path]:
    return sorted((store / "chain").glob("*.json"))


def _rewrite_with_recomputed_links(store: Path, new_key: bool) -> None:
    """Someone holding every file of the store (not the writer's key) edits a segment and recomputes
    every hash after it; with ``new_key`` they also put a key of their own in store.json and sign."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from telemetry.store.chain import GENESIS, Link, _msg
    seg = _seg(store, 1)
    t = pa.Table.from_pylist([r for r in __import__("pyarrow.parquet").parquet.read_table(seg).to_pylist()][:1],
                             schema=__import__("pyarrow.parquet").parquet.read_table(seg).schema)
    import pyarrow.parquet as pq
    pq.write_table(t, seg)
    ident = json.loads((store / "store.json").read_text())
    key = Ed25519PrivateKey.generate()
    if new_key:
        ident["public_key"] = key.public_key().public_bytes_raw().hex()
        ident.pop("fingerprint")
        (store / "store.json").write_text(json.dumps(ident))
    prev = GENESIS
    for f in _links(store):
        body = json.loads(f.read_text())
        links = []
        for e in body["links"]:
            ln = Link(**{**e, "prev": prev})
            if (store / ln.file) == seg:
                ln = ln._replace(rows=t.num_rows, sha256=__import__("hashlib").sha256(seg.read_bytes()).hexdigest())
            ln = ln._replace(link=ln.computed())
            links.append(ln._asdict())
            prev = ln.link
        body["links"] = links
        if new_key:
            body["signature"] = key.sign(_msg("chain", ident["store_id"], links[-1]["seq"], links[-1]["link"])).hex()
        f.write_text(json.dumps(body))


def _drop_in_valid_segment(store: Path) -> None:
    import pyarrow.parquet as pq
    pq.write_table(pa.table(_releases(2)), store / "segments" / "releases" / "000000099.parquet")


TAMPERINGS = {
    "delete the newest links and their segments": (
        lambda s: [(_seg(s, k).unlink(), _links(s)[k].unlink()) for k in (3, 2)], "truncated: store ends at seq 1, anchor says 3"),
    "delete the last link": (lambda s: _links(s)[-1].unlink(), "truncated: store ends at seq 2, anchor says 3"),
    "rewrite a segment, links recomputed": (lambda s: _rewrite_with_recomputed_links(s, False), "not signed by this store's key"),
    "rewrite it and re-sign with a new key": (lambda s: _rewrite_with_recomputed_links(s, True), "not signed by this store's public key"),
    "drop in a valid segment": (_drop_in_valid_segment, "000000099.parquet: not written by this store's writer"),
    "drop in garbage": (lambda s: (s / "segments" / "releases" / "zz.bin").write_bytes(b"\x00garbage"), "zz.bin: not written"),
    "drop garbage into the chain": (lambda s: (s / "chain" / "000000007.json").write_text("{nope"), "chain/000000007.json is unreadable"),
    "flip a byte": (lambda s: _seg(s, 2).write_bytes(_seg(s, 2).read_bytes()[:40] + bytes([_seg(s, 2).read_bytes()[40] ^ 1])
                                                    + _seg(s, 2).read_bytes()[41:]), "segment 2 .*content does not match"),
    "truncate a segment": (lambda s: _seg(s, 1).write_bytes(_seg(s, 1).read_bytes()[:100]), "segment 1 .*content does not match"),
    "reorder two links": (lambda s: [p.write_text(t) for p, t in zip(_links(s)[1:3], [p.read_text() for p in _links(s)[2:0:-1]])],
                          "segment 2 .*sequence gap"),
    "delete the public key": (lambda s: (s / "store.json").unlink(), "store.json is missing"),
}


def named_by_verify(store: Path, expect: str, capsys) -> None:
    """``verify`` and ``kvledger verify`` name the damage (``expect``: a regex) and fail."""
    import re
    v = verify(store)
    assert not v.ok and re.search(expect, v.broken), v.broken
    assert main(["verify", "--store", str(store)]) == 1
    assert re.search(expect, capsys.readouterr().err)


@pytest.mark.parametrize("how", list(TAMPERINGS))
def test_every_tampering_is_named_and_no_reader_answers(store, how, capsys, tmp_path):
    tamper, expect = TAMPERINGS[how]
    tamper(store)
    named_by_verify(store, expect, capsys)
    assert main(["forensics", "transfers", "--store", str(store)]) == 2
    assert "does not verify" in capsys.readouterr().err
    assert main(["report", "--store", str(store), "--out", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()
    with pytest.raises(StoreError, match="does not verify|missing|is not the one"):
        SegmentWriter(store)                   # no writer signs over damage, and none crashes on it


def test_allow_unverified_answers_and_every_output_says_so(store, capsys, tmp_path):
    _drop_in_valid_segment(store)
    assert main(["forensics", "releases", "--store", str(store), "--allow-unverified", "--format", "json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) and "UNVERIFIED STORE" in out.err
    assert main(["report", "--store", str(store), "--out", str(tmp_path / "r"), "--allow-unverified"]) == 1
    assert "UNVERIFIED STORE" in (tmp_path / "r" / "report.md").read_text()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["provenance"]["chain_ok"] is False


def test_no_secret_in_the_store_and_verify_needs_none_and_writes_nothing(store, tmp_path, monkeypatch):
    names = {p.name for p in store.rglob("*")}
    assert not names & {"secret.key", "signing.key", "pseudonym.key", "ngram.key"}
    ident = json.loads((store / "store.json").read_text())
    assert set(ident) >= {"store_id", "public_key", "fingerprint"}
    copy = tmp_path / "auditor"
    shutil.copytree(store, copy)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    monkeypatch.setenv("KVLEDGER_KEY_DIR", str(tmp_path / "no-keys-here"))     # the auditor holds no key
    v = verify(copy)
    assert v.ok and v.sealed and v.anchor_seq == 3
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before and not (tmp_path / "no-keys-here").exists()
    with pytest.raises(StoreError, match="only the process holding that store's keys can append"):
        SegmentWriter(copy)


def test_verify_against_a_given_anchor_and_without_one(store, tmp_path, capsys):
    v = verify(store)
    anchor = Path(v.anchor)
    moved = tmp_path / "second-disk" / "anchor.jsonl"
    moved.parent.mkdir()
    anchor.rename(moved)
    v = verify(store)
    assert v.ok and v.anchor is None and any("no anchor" in w for w in v.warnings)
    (_links(store)[-1]).unlink()                      # without the anchor a truncation cannot be seen...
    assert verify(store).ok
    assert main(["verify", "--store", str(store), "--anchor", str(moved)]) == 1   # ...with it, it is named
    assert "store ends at seq 2, anchor says 3" in capsys.readouterr().err


def test_a_store_of_the_older_unsigned_format_is_named_and_readable_when_allowed(tmp_path, capsys):
    """Stores written before signatures (an HMAC chain, secret.key inside the store) have nothing a
    reader could verify: every reader says so by name, and answers only with --allow-unverified."""
    import hashlib

    import pyarrow.parquet as pq
    old = tmp_path / "old"
    (old / "segments" / "releases").mkdir(parents=True)
    (old / "chain").mkdir()
    seg = old / "segments" / "releases" / "000000000.parquet"
    pq.write_table(pa.table(_releases(2)), seg)
    (old / "secret.key").write_bytes(b"s" * 32)
    (old / "chain" / "000000000.json").write_text(json.dumps({
        "seq": 0, "table": "releases", "file": "segments/releases/000000000.parquet", "rows": 2,
        "sha256": hashlib.sha256(seg.read_bytes()).hexdigest(), "prev": "0" * 64, "link": "hmac..."}))
    assert main(["verify", "--store", str(old)]) == 1
    assert "written by an older kvledger" in capsys.readouterr().err
    assert main(["forensics", "releases", "--store", str(old), "--allow-unverified", "--format", "json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["releases"] == 2 and "UNVERIFIED STORE" in out.err
    with pytest.raises(StoreError, match="older kvledger"):
        SegmentWriter(old)


def test_a_store_closed_empty_reopens_and_verifies(tmp_path):
    """A writer opened and closed with no rows (a collector that saw no traffic) anchors the genesis
    head at seq -1: the store verifies and takes a writer again."""
    from telemetry.store.chain import verify
    for _ in range(2):
        SegmentWriter(tmp_path / "store").close()
        v = verify(tmp_path / "store")
        assert v.ok and v.sealed and v.anchor_seq == -1, v


def test_an_anchor_that_cannot_be_written_fails_the_close_and_a_newer_one_clears_it(tmp_path, monkeypatch):
    """The anchor's disk is full: no row is lost (the store verifies, its tail reported unanchored),
    but the writer's close fails with one StoreError naming the anchor - a run never exits 0 with
    its head unanchored. An anchor written later covers the earlier heads, and the close is clean."""
    import errno

    import telemetry.store.writer as writer_mod
    real = writer_mod.append_anchor

    def full(path, entry):
        raise OSError(errno.ENOSPC, "No space left on device")
    w = SegmentWriter(tmp_path / "a")
    w.submit("releases", _releases(3))
    monkeypatch.setattr(writer_mod, "append_anchor", full)
    with pytest.raises(StoreError, match="could not be written .*No space left"):
        w.close()
    v = verify(tmp_path / "a")
    assert v.rows == 3 and (v.anchor_seq is None or v.anchor_seq < v.seq), v
    monkeypatch.setattr(writer_mod, "append_anchor", real)
    w = SegmentWriter(tmp_path / "b")
    monkeypatch.setattr(writer_mod, "append_anchor", full)
    w.submit("releases", _releases(2))
    w.flush()                                    # this head's anchor fails
    monkeypatch.setattr(writer_mod, "append_anchor", real)
    w.submit("releases", _releases(1))
    w.close()                                    # the seal's anchor is written: it covers the earlier head
    v = verify(tmp_path / "b")
    assert v.ok and v.sealed and v.anchor_seq == v.seq, v


def test_a_substituted_store_is_named_by_verify_and_refused_by_the_writer(tmp_path):
    """A store's identity does not come from the store: the key holder records which store id and key
    live at each path. Another genuine store moved into the path (its own anchor and all), or a store
    rebuilt under a new key and a new id, both verify on their own - and are named `substituted` at
    the path they took, exit 1, and refused by a writer. A store created anew where one was removed
    is legitimate and takes the path over; a store read where it was never written has no record."""
    import shutil
    home, other = tmp_path / "home", tmp_path / "other"
    for root, n in ((home, 3), (other, 2)):
        w = SegmentWriter(root)
        w.submit("releases", _releases(n))
        w.close()
    assert verify(home).ok and verify(other).ok
    shutil.rmtree(home)
    shutil.copytree(other, home)                               # another genuine store, moved in
    v = verify(home)
    assert not v.ok and v.broken.startswith("substituted: the key holder's record for"), v.broken
    assert main(["verify", "--store", str(home)]) == 1
    with pytest.raises(StoreError, match="substituted"):
        SegmentWriter(home)
    shutil.rmtree(home)                                        # removed, then created anew: legitimate
    w = SegmentWriter(home)
    w.submit("releases", _releases(1))
    w.close()
    assert verify(home).ok
    elsewhere = tmp_path / "copy-for-the-investigator"
    shutil.copytree(home, elsewhere)                          # a copy read elsewhere: no record, no claim
    assert verify(elsewhere).ok


def _other_store_anchor(tmp_path) -> Path:
    w = SegmentWriter(tmp_path / "other")
    w.submit("releases", _releases(3, "x"))
    w.close()
    return Path(verify(tmp_path / "other").anchor)


@pytest.mark.parametrize("case,argv,code,said", [
    ("anchored", [], 0, "anchored at seq 3"),
    ("no anchor found", ["MOVE"], 3, "not anchored: nothing shows that no newer history was deleted"),
    ("no anchor, and said so", ["MOVE", "--no-anchor"], 0, "NOT anchored"),
    ("an empty anchor", ["--anchor", "EMPTY"], 3, "not anchored"),
    ("another store's anchor", ["--anchor", "OTHER"], 3, "not anchored"),
    ("a directory as anchor", ["--anchor", "DIR"], 1, "is not a file"),
    ("a missing anchor named", ["--anchor", "MISSING"], 1, "does not exist"),
])
def test_verify_exits_non_zero_unless_the_store_is_intact_and_anchored(store, tmp_path, capsys, case, argv, code, said):
    """Issue 32: "NOT anchored" and an anchor that holds nothing were exit 0: a substituted or
    truncated store passed a script that only checks the exit code."""
    if "MOVE" in argv:
        a = Path(verify(store).anchor)
        a.rename(tmp_path / "elsewhere.jsonl")
        argv = [x for x in argv if x != "MOVE"]
    subs = {"EMPTY": tmp_path / "empty.jsonl", "DIR": tmp_path / "adir", "MISSING": tmp_path / "nope.jsonl"}
    subs["EMPTY"].write_text("")
    subs["DIR"].mkdir()
    if "OTHER" in argv:
        subs["OTHER"] = _other_store_anchor(tmp_path)
    argv = [str(subs.get(x, x)) for x in argv]
    capsys.readouterr()
    assert main(["verify", "--store", str(store), *argv]) == code, case
    out = capsys.readouterr()
    assert said in out.out + out.err, (case, out)
    assert main(["verify", "--store", str(store), *argv, "--format", "json"]) == code
    body = json.loads(capsys.readouterr().out)
    assert body["exit"] == code and body["anchored"] == (code == 0 and "--no-anchor" not in argv)


def test_a_reader_does_not_rehash_what_it_verified_before_and_still_sees_any_change(store, monkeypatch):
    """Issue 36 (the verification cache): a command's segment hashes are kept outside the store, keyed
    by path, size, mtime, ctime and inode, so the next command re-reads nothing it verified - and an
    edit in place with its size and mtime restored is still caught (its ctime moved)."""
    import telemetry.store.chain as chain
    from forensics.queries.duckdb import Forensics
    hashed: list = []
    real = chain.sha256_file
    monkeypatch.setattr(chain, "sha256_file", lambda p: hashed.append(p) or real(p))
    Forensics(store)
    assert len(hashed) >= 4                                  # cold: every segment read once
    assert chain.HashCache(store).path.is_file()             # kept in the state directory, not in the store
    assert not any("verified" in str(p) for p in store.rglob("*"))
    hashed.clear()
    Forensics(store)
    assert hashed == []                                      # warm: nothing re-read
    seg = _seg(store, 1)
    st = seg.stat()
    body = bytearray(seg.read_bytes())
    body[len(body) // 2] ^= 0x01
    seg.write_bytes(bytes(body))
    os.utime(seg, ns=(st.st_atime_ns, st.st_mtime_ns))       # size and mtime as they were
    with pytest.raises(StoreError, match="does not match its hash"):
        Forensics(store)
    assert verify(store).broken and "does not match its hash" in verify(store).broken   # verify keeps no cache


def test_a_reader_does_not_recheck_a_chain_file_s_signature_it_checked_before_unless_it_changed(store, monkeypatch):
    """The signatures a command checked are kept with its segment hashes (outside the store): the
    next command checks none of them again, and a chain file whose signature or last link differs
    from the one checked is checked again - and named."""
    import telemetry.store.chain as chain
    from forensics.queries.duckdb import Forensics
    from telemetry.store.keys import Identity
    checked: list = []
    real = Identity.check
    monkeypatch.setattr(Identity, "check", lambda self, msg, sig: checked.append(msg) or real(self, msg, sig))
    Forensics(store)
    assert sum(b"kvledger-chain" in m for m in checked) == 4            # cold: every chain file's signature
    assert chain.HashCache(store)._sigs_path.is_file()
    checked.clear()
    Forensics(store)
    assert not any(b"kvledger-chain" in m for m in checked)            # warm: none again
    f = sorted((store / "chain").glob("*.json"))[2]
    body = json.loads(f.read_text())
    body["signature"] = body["signature"][:-2] + ("00" if body["signature"][-2:] != "00" else "11")
    f.write_text(json.dumps(body))
    with pytest.raises(StoreError, match="not signed by this store's key"):
        Forensics(store)
    assert sum(b"kvledger-chain" in m for m in checked) == 1


def test_the_store_schemas_kept_in_the_state_directory_are_duckdb_s_mapping_and_a_damaged_copy_is_mapped_again(
        tmp_path, monkeypatch):
    """The Arrow schemas of the store's tables and their NOT NULL columns, mapped by DuckDB from
    schema.sql, are kept in the state directory (read back instead of mapped at every process's start):
    read back they equal a fresh mapping, field for field and column for column; a kept file that is
    cut, garbage, empty or written before it held the NOT NULL columns is mapped again and rewritten; a
    state directory that cannot be written still gives the mapping; a writer's segments take their
    NOT NULL columns from the kept file (no mapping of their own)."""
    import pyarrow as pa

    from telemetry.store import schema
    monkeypatch.setenv("KVLEDGER_STATE_DIR", str(tmp_path / "state"))
    ddl = schema.SCHEMA_SQL.read_text()
    fresh, fresh_required = schema._mapped(ddl)
    assert fresh_required["page_reads"] and set(fresh_required) == set(fresh)
    mapped: list = []
    real, me = schema._mapped, threading.get_ident()
    # (counted on this thread only: a thread an earlier test left running - an SDK's exporter, a
    # writer closing - may read the schemas while their cache is cleared here, and map them too)
    monkeypatch.setattr(schema, "_mapped", lambda d: (threading.get_ident() == me and mapped.append(d)) or real(d))

    def schemas() -> dict:
        schema._store_schema.cache_clear()
        got = schema.arrow_schemas()
        assert schema.not_null() == fresh_required
        return got
    try:
        got = schemas()
        path = schema._kept_path(ddl)
        assert len(mapped) == 1 and path.is_file()
        kept = schemas()
        assert len(mapped) == 1                                         # read back, not mapped
        assert list(kept) == list(fresh) and "page_reads" in kept
        assert all(kept[t].equals(fresh[t], check_metadata=True) and got[t].equals(fresh[t]) for t in fresh)
        whole = path.read_bytes()
        with pa.ipc.open_file(pa.py_buffer(whole)) as f:
            before = f.read_all().drop_columns(["not_null"])            # as the fifty-first session kept it
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, before.schema) as w:
            w.write_table(before)
        for damage in (whole[:len(whole) // 2], b"not arrow at all", b"", sink.getvalue().to_pybytes()):
            path.write_bytes(damage)
            assert all(schemas()[t].equals(fresh[t], check_metadata=True) for t in fresh)
            assert path.read_bytes() == whole                           # mapped again and rewritten
        assert len(mapped) == 5
        required = schema.not_null()["page_reads"]
        with pytest.raises(ValueError, match="missing columns"):        # a writer's check, from the kept columns
            schema.conform("page_reads", pa.table({"boot": ["b"]}))
        assert len(mapped) == 5 and required <= set(fresh["page_reads"].names)
        blocked = tmp_path / "file"
        blocked.write_text("")
        monkeypatch.setenv("KVLEDGER_STATE_DIR", str(blocked / "state"))   # under a file: no directory can be made
        assert all(schemas()[t].equals(fresh[t], check_metadata=True) for t in fresh)
    finally:
        monkeypatch.undo()
        schema._store_schema.cache_clear()
