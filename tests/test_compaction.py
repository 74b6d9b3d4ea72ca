"""Compaction (issue 36): the writer merges a table's small segments into bigger ones, as
ClickHouse merges a MergeTree's parts, with a link that names what it replaced - every row reads
back once, the store verifies, tampering with a merge is named, a merge never signs over a segment
changed since it was written, a writer stopped between a merge's file and its link leaves a store
the next writer completes, and an export that had copied some of the merged segments copies the
rest once."""
from __future__ import annotations

import fcntl
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from engine.commands.main import main
from telemetry.store import SegmentWriter, open_store, read_chain, verify
from telemetry.store.chain import Link, chain_body, live_links, originals
from telemetry.store.keys import WriterKeys
from telemetry.store.schema import arrow_schemas

FAN = 3


def _releases(i: int, n: int = 3) -> pa.Table:
    return pa.table({"node": [f"n{i}"] * n, "incarnation": pa.array(np.arange(n) + 100 * i, pa.int64()),
                     "pages": [[1, 2]] * n, "kind": ["immediate"] * n, "ended_by": ["immediate"] * n,
                     "hold_ns": pa.array(np.zeros(n), pa.int64()), "lclock": pa.array(np.arange(n), pa.int64()),
                     "ts": pa.array(np.full(n, time.time_ns()), pa.timestamp("ns"))})


def _write(root: Path, flushes: range, fan: int = FAN, grace: float = 0.0, close: bool = True,
           **options) -> SegmentWriter:
    """A writer merging ``fan`` segments at a time (``options``: the writer's others) given a flush
    of 3 releases rows for each of ``flushes``."""
    w = SegmentWriter(root, compact_fan=fan, compact_grace=grace, **options)
    for i in flushes:
        w.submit("releases", _releases(i))
        w.flush()
    if close:
        w.close()
    return w


def _incarnations(root: Path) -> list[int]:
    return [r[0] for r in open_store(root).sql("SELECT incarnation FROM releases ORDER BY incarnation").fetchall()]


def _want(flushes: range) -> list[int]:
    return sorted(int(x) for i in flushes for x in np.arange(3) + 100 * i)


@pytest.fixture
def compacted(tmp_path) -> Path:
    root = tmp_path / "store"
    _write(root, range(20))
    return root


def test_a_writer_merges_a_table_s_small_segments_and_every_row_reads_back_once(compacted, capsys):
    chain = read_chain(compacted)
    merges = [ln for ln in chain if ln.replaces]
    live = live_links(chain)
    assert merges and len(live) < 20 // 2, [ln.seq for ln in live]
    # the merged segments' files are gone (grace 0); the live ones are exactly what is on disk
    assert sorted(p.name for p in (compacted / "segments" / "releases").iterdir()) == \
        sorted(Path(ln.file).name for ln in live)
    # a merge of merges is flattened back to the flushes, in the file's row order
    for ln in merges:
        parts = originals(chain)[ln.seq]
        assert all(not p.replaces for p in parts) and sum(p.rows for p in parts) == ln.rows
        assert [p.seq for p in parts] == sorted(p.seq for p in parts)
        assert len(parts) in (FAN, FAN * FAN)
    v = verify(compacted)
    assert v.ok and v.rows == 60 and not v.warnings[1:], (v.broken, v.warnings)
    assert _incarnations(compacted) == _want(range(20))
    assert main(["verify", "--store", str(compacted)]) == 0
    assert "chain intact and signed" in capsys.readouterr().out
    # a second writer goes on where the first stopped: it knows the levels from the chain
    _write(compacted, range(20, 40))
    assert verify(compacted).ok and _incarnations(compacted) == _want(range(40))
    assert max(len(originals(read_chain(compacted)).get(ln.seq, [])) for ln in read_chain(compacted)) == FAN * FAN


def test_without_compaction_every_flush_stays_a_segment(tmp_path):
    root = tmp_path / "store"
    _write(root, range(8), fan=0)
    assert not any(ln.replaces for ln in read_chain(root)) and len(read_chain(root)) == 8


def test_the_merged_segments_files_stay_for_the_grace_period(tmp_path):
    root = tmp_path / "store"
    w = _write(root, range(FAN + 1), grace=3600, close=False)
    chain = read_chain(root)
    merged = [ln for ln in chain if any(ln.seq in m.parts() for m in chain if m.replaces)]
    assert len(merged) == FAN and all((root / ln.file).is_file() for ln in merged)
    assert _incarnations(root) == _want(range(FAN + 1))         # read once: through the merge, not twice
    assert verify(root).ok
    w.close()
    # the next writer deletes them (a grace period after it opened: here none)
    w = SegmentWriter(root, compact_fan=FAN, compact_grace=0)
    w.submit("releases", _releases(99))
    w.close()
    assert not any((root / ln.file).exists() for ln in merged) and verify(root).ok


def _merge(root: Path) -> Link:
    """The first merge whose file is live (not merged again since)."""
    return next(ln for ln in live_links(read_chain(root)) if ln.replaces)


def _chain_file_of(root: Path, seq: int) -> Path:
    return next(p for p in sorted((root / "chain").glob("*.json"))
                if any(e["seq"] == seq for e in json.loads(p.read_text())["links"]))


def _edit_merge(root: Path, **change) -> None:
    """Edit the first merge's entry in its chain file (no key: the links are not recomputed)."""
    p = _chain_file_of(root, _merge(root).seq)
    body = json.loads(p.read_text())
    for e in body["links"]:
        if e["seq"] == _merge(root).seq:
            e.update(change)
    p.write_text(json.dumps(body))


def _flip(path: Path) -> None:
    b = path.read_bytes()
    path.write_bytes(b[:40] + bytes([b[40] ^ 1]) + b[41:])


def _signed_merge(root: Path, table: str, parts: list[int], rows: int | None = None) -> None:
    """With the writer's own key: a new chain file whose one link is a merge of ``parts`` (a file in
    place under its hash) - what only a writer bug could sign."""
    chain = read_chain(root)
    by = {ln.seq: ln for ln in chain}
    seq = chain[-1].seq + 1
    rel = f"segments/{table}/{seq:09d}.parquet"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes((root / live_links(chain)[-1].file).read_bytes())
    sha = __import__("hashlib").sha256((root / rel).read_bytes()).hexdigest()
    rows = sum(by[s].rows for s in parts) if rows is None else rows
    ln = Link(seq, table, rel, rows, sha, chain[-1].link, "", ",".join(map(str, parts)))
    ln = ln._replace(link=ln.computed())
    (root / "chain" / f"{seq:09d}.json").write_bytes(chain_body(WriterKeys.open_or_create(root), [ln]))


def _edit_signed_replaces(root: Path, value: str) -> None:
    """The last chain file's one link (a merge) given ``replaces=value``, relinked and signed with the writer's key."""
    f = sorted((root / "chain").glob("*.json"))[-1]
    ln = Link(**json.loads(f.read_text())["links"][0])._replace(replaces=value)
    ln = ln._replace(link=ln.computed())
    f.write_bytes(chain_body(WriterKeys.open_or_create(root), [ln]))


TAMPERINGS = {
    "delete the merge's file": (lambda s: (s / _merge(s).file).unlink(), r"segment \d+ .*segment file is missing"),
    "flip a byte of the merge's file": (lambda s: _flip(s / _merge(s).file), r"segment \d+ .*content does not match"),
    # what it replaced no longer excuses their files' absence: the first of them is named
    "edit what the merge replaces": (lambda s: _edit_merge(s, replaces="0,1"),
                                     "segment file is missing|link hash does not match its entry"),
    "edit the merge's rows": (lambda s: _edit_merge(s, rows=1), "link hash does not match its entry"),
    "garbage for what it replaces": (lambda s: _edit_merge(s, replaces="x,"),
                                     "segment file is missing|link hash does not match its entry"),
    "a number for what it replaces": (lambda s: _edit_merge(s, replaces=7),
                                      "segment file is missing|link hash does not match its entry"),
    "signed: a merge of what cannot be read": (
        lambda s: _signed_merge(s, "releases", [], rows=3) or _edit_signed_replaces(s, "x"), "cannot be read"),
    "signed: a merge of segments merged already": (
        lambda s: _signed_merge(s, "releases", _merge(s).parts()), "already replaced"),
    "signed: a merge claiming other rows": (
        lambda s: _signed_merge(s, "releases", [live_links(read_chain(s))[-1].seq], rows=2), "holds 2 rows, the segments it replaces 3"),
    "signed: a merge of a later segment": (
        lambda s: _signed_merge(s, "releases", [10_000], rows=0), "replaces segment 10000, which is not an earlier link"),
    "signed: a merge into another table": (
        lambda s: _signed_merge(s, "page_reads", [live_links(read_chain(s))[-1].seq], rows=3), "of page_reads replaces segment"),
}


@pytest.mark.parametrize("how", list(TAMPERINGS))
def test_tampering_with_a_merge_is_named_and_no_writer_signs_over_it(compacted, how, capsys):
    tamper, expect = TAMPERINGS[how]
    tamper(compacted)
    named_and_refused(compacted, expect, capsys)


def named_and_refused(store: Path, expect: str, capsys) -> None:
    """``verify`` names the damage (``expect``: a regex), no reader answers and no writer signs over it."""
    from tests.test_store import named_by_verify
    named_by_verify(store, expect, capsys)
    assert main(["forensics", "exposures", "--store", str(store)]) == 2
    assert "does not verify" in capsys.readouterr().err
    with pytest.raises(Exception, match="does not verify"):
        SegmentWriter(store)


def test_a_merged_segment_s_file_put_back_is_not_read_twice(tmp_path):
    root = tmp_path / "store"
    w = _write(root, range(FAN), close=False)
    kept = {p.name: p.read_bytes() for p in (root / "segments" / "releases").iterdir()}
    w.submit("releases", _releases(FAN))
    w.close()                                   # the merge, and its parts deleted
    for name, data in kept.items():
        (root / "segments" / "releases" / name).write_bytes(data)
    assert verify(root).ok and _incarnations(root) == _want(range(FAN + 1))


def test_a_merge_never_signs_over_a_segment_changed_after_it_was_written(tmp_path, caplog):
    root = tmp_path / "store"
    w = _write(root, range(FAN), close=False)
    first = root / read_chain(root)[0].file
    _flip(first)
    w.submit("releases", _releases(FAN))
    w.flush()                                   # FAN + 1 at level 0: a merge is due, and refused
    assert not any(ln.replaces for ln in read_chain(root))
    assert "no longer matches the hash its link signed" in caplog.text
    w.close()
    v = verify(root)
    assert not v.ok and re.search(r"segment 0 .*content does not match", v.broken)


def _die(w: SegmentWriter) -> None:
    """The writer dies here: its thread stopped, its lock dropped, nothing more written."""
    w._closed = True
    w._q.put(None)
    w._thread.join()
    fcntl.flock(w._lock_fd, fcntl.LOCK_UN)
    os.close(w._lock_fd)


def test_a_writer_killed_while_segments_wait_for_a_failed_chain_write_leaves_them_all_adoptable(tmp_path, monkeypatch):
    """A chain write fails (a full disk): the flush's segments wait for their link. The writer thread
    goes on writing what its drains hand it - the next flush's signed intent names the waiting
    segments too, so a writer killed then leaves every one of them for the next writer to link,
    none a stranger (it had named only the newest flush's)."""
    import telemetry.store.writer as W
    from telemetry.store import StoreError
    root = tmp_path / "store"
    w = SegmentWriter(root, flush_interval=3600, compact_fan=0)
    n = iter(range(100))
    w.add_drain(lambda: [("releases", _releases(next(n)))])
    real = W._atomic_write

    def no_chain_file(path, data):
        if path.parent.name == "chain":
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(W, "_atomic_write", no_chain_file)
    for _ in range(2):                          # two flushes' segments in place, neither linked
        with pytest.raises(StoreError, match="No space left"):
            w.flush()
    _die(w)
    monkeypatch.setattr(W, "_atomic_write", real)
    v = verify(root)
    assert v.ok and len(v.unlinked) == 2, (v.broken, v.unlinked)
    SegmentWriter(root).close()                 # links both
    v = verify(root)
    assert v.ok and not v.unlinked and v.rows == 6 and _incarnations(root) == _want(range(2))


def test_a_writer_stopped_between_a_merge_s_file_and_its_link_leaves_what_the_next_one_links(tmp_path, monkeypatch):
    """The merge's file is in place (its signed intent names it), its link is not: a reader ignores
    it and reads the flushes' files; the next writer links it as the merge it is."""
    import telemetry.store.writer as W
    root = tmp_path / "store"
    w = _write(root, range(FAN), close=False)
    real = W._atomic_write

    def no_chain_file(path, data):
        if path.parent.name == "chain" and b'"replaces"' in bytes(data):      # the merge's link only
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(W, "_atomic_write", no_chain_file)
    w.submit("releases", _releases(FAN))
    w.flush()                                   # the flush is linked; the merge's link is not (logged)
    _die(w)
    monkeypatch.setattr(W, "_atomic_write", real)
    v = verify(root)
    assert v.ok, v.broken
    assert any(u[5] for u in v.unlinked), v.unlinked            # the merge's file, not yet linked
    assert _incarnations(root) == _want(range(FAN + 1))         # through the flushes' files
    w2 = SegmentWriter(root, compact_fan=FAN, compact_grace=0)
    assert any(ln.replaces for ln in read_chain(root))
    w2.submit("releases", _releases(FAN + 1))
    w2.close()
    v = verify(root)
    assert v.ok and not [x for x in v.warnings if "not anchored" not in x and "no anchor" not in x], v.warnings
    assert _incarnations(root) == _want(range(FAN + 2))


def test_export_after_a_merge_of_segments_some_exported_copies_the_rest_once(tmp_path):
    from telemetry.clickhouse import connect, export
    root = tmp_path / "store"
    target = connect(f"chdb:{os.environ['KVLEDGER_CHDB_PATH']}?db=exp_compacted")
    w = _write(root, range(2), close=False)
    assert export(root, target)["segments"] == 2                 # two of the three flushes a merge will take
    for i in range(2, 2 * FAN + 2):
        w.submit("releases", _releases(i))
        w.flush()
    w.close()
    assert any(ln.replaces for ln in read_chain(root))
    res = export(root, target)
    got = target.query_arrow("SELECT incarnation FROM `exp_compacted`.`releases` ORDER BY incarnation")
    assert got.column(0).to_pylist() == _want(range(2 * FAN + 2))
    assert res["rows"] == 3 * (2 * FAN)
    assert export(root, target)["segments"] == 0


@pytest.mark.xdist_group("glm53")
def test_a_reader_s_kept_tables_carry_over_the_writer_s_merges(glm53_vulnerable, tmp_path):
    """A store written in flushes that the writer merges two by two while it is read again and again
    (a dashboard's refreshes): each snapshot's grown tables equal their SQL over the snapshot, and a
    merge of segments an earlier snapshot had read is carried over - the kept tables stand, only
    the new segments are read - never rebuilt; the n-gram evidence too."""
    from forensics.queries import evidence, grown
    from forensics.queries.duckdb import Forensics, sql
    from tests.test_forensics import _grown_equal_their_sql
    _, src = glm53_vulnerable
    con = open_store(src)
    tables = {t: con.table(t).to_arrow_table() for t in arrow_schemas()}
    k = 6
    root = tmp_path / "store"
    w = SegmentWriter(root, compact_fan=2, compact_grace=0, flush_interval=3600)
    seen = []
    for i in range(k):
        for t, data in tables.items():
            lo, hi = data.num_rows * i // k, data.num_rows * (i + 1) // k
            if hi > lo:
                w.submit(t, data.slice(lo, hi - lo))
        w.flush()
        g, e = dict(grown.stats), dict(evidence.stats)
        fx = Forensics(root, answer_cache=False)
        fx.materialise()
        _grown_equal_their_sql(fx.con)
        ng = fx.con.sql("SELECT * FROM exposure_ngrams ORDER BY ALL").fetchall()
        assert ng == fx.con.sql(f"SELECT * FROM ({sql('exposure_ngrams')}) ORDER BY ALL").fetchall()
        seen.append(({x: grown.stats[x] - g[x] for x in g}, {x: evidence.stats[x] - e[x] for x in e},
                     sum(1 for ln in read_chain(root) if ln.replaces)))
        fx.close()
    w.close()
    assert seen[-1][2] >= k - 2, "the writer merged as it went"
    assert all(d["built"] == 0 for d, _, _ in seen[1:]), seen
    assert all(e["rebuilt"] == 0 for _, e, _ in seen[1:]), seen
    assert sum(d["carried"] for d, _, _ in seen) >= 3 and sum(e["carried"] for _, e, _ in seen) >= 2, seen
    ours, theirs = Forensics(root, answer_cache=False).exposures(), Forensics(src, answer_cache=False).exposures()
    assert ours.height > 0 and ours.sort(ours.columns).equals(theirs.sort(theirs.columns))


def test_a_reader_s_verification_cache_forgets_the_merged_files(tmp_path):
    """The hashes a command keeps (chain.HashCache) are of files that exist: a merged segment's
    file, deleted by the writer, leaves the cache at the next command - it does not grow with history."""
    from forensics.queries.duckdb import Forensics
    from telemetry.store.chain import HashCache
    root = tmp_path / "store"
    w = _write(root, range(FAN), close=False)
    Forensics(root).close()
    before = {k[0] for k in HashCache(root) if len(k) == 5}
    assert len(before) >= FAN
    w.submit("releases", _releases(FAN))
    w.close()                                   # the merge; its parts deleted (grace 0)
    Forensics(root).close()
    after = {k[0] for k in HashCache(root) if len(k) == 5}
    assert after and all(Path(p).exists() for p in after) and not before <= after
    assert {str(root / ln.file) for ln in live_links(read_chain(root)) if ln.table == "releases"} <= after


@pytest.mark.parametrize("fan", [1, -1, -16])
def test_a_merge_of_fewer_than_two_segments_is_refused_before_the_store_is_made(tmp_path, fan):
    from telemetry.store import StoreError
    with pytest.raises(StoreError, match=f"compact_fan {fan}: 0 \\(no compaction\\) or at least 2"):
        SegmentWriter(tmp_path / "store", compact_fan=fan)
    assert not (tmp_path / "store").exists()
