"""Chain packing (issue 36): the writer packs CHAIN_FAN consecutive chain files of one level into
one of the next, signed like any chain file - a long-running store holds tens of chain files, not
one a flush - and the chain reads the same: every link once, in order, the store verifies, a pack's
tampering is named, a pack never signs over a chain file changed since it was written, a file a
pack covers that its writer did not delete yet is left out (and deleted by the next writer), and
a reader whose listing is overtaken by a pack lists again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.commands.main import main
from telemetry.store import SegmentWriter, StoreError, read_chain, verify
from telemetry.store import chain as C
from tests.test_compaction import _incarnations, _releases, _want
from tests.test_compaction import _write as write_flushes, named_and_refused

FAN = 3


def _write(root: Path, flushes: range, fan: int = FAN, close: bool = True) -> SegmentWriter:
    """A writer packing ``fan`` chain files at a time and merging no segments (no flush but the test's)."""
    return write_flushes(root, flushes, fan=0, close=close, flush_interval=3600, chain_fan=fan)


def _files(root: Path) -> list[Path]:
    return sorted((root / "chain").glob("*.json"))


def _levels(root: Path) -> list[int]:
    return [cf.level for cf in C.read_chain_files(root)]


@pytest.fixture
def packed(tmp_path) -> Path:
    root = tmp_path / "store"
    _write(root, range(30))
    return root


def test_a_writer_packs_its_chain_files_and_the_chain_reads_the_same(packed, tmp_path, capsys):
    plain = tmp_path / "plain"
    _write(plain, range(30), fan=0)
    assert len(_files(plain)) == 30
    # 30 flushes at a fan of 3: levels 3 (27 flushes) - 0 - 0 - 0 (one pack a flush, the oldest run first)
    assert len(_files(packed)) < 30 // FAN and _levels(packed)[0] == 3, _levels(packed)
    assert [cf.level for cf in C.read_chain_files(packed)] == sorted(_levels(packed), reverse=True)
    chain = read_chain(packed)
    assert [ln.seq for ln in chain] == list(range(30))
    assert [(ln.table, ln.rows) for ln in chain] == [(ln.table, ln.rows) for ln in read_chain(plain)]
    v = verify(packed)
    assert v.ok and v.segments == 30 and v.rows == 90 and v.seq == 29, v.broken
    assert _incarnations(packed) == _want(range(30))
    assert main(["verify", "--store", str(packed)]) == 0
    assert "chain intact and signed" in capsys.readouterr().out
    # a second writer goes on where the first stopped: it knows the files' levels from the chain
    _write(packed, range(30, 60))
    assert [ln.seq for ln in read_chain(packed)] == list(range(60)) and verify(packed).ok
    assert _levels(packed)[:2] == [3, 3] and len(_files(packed)) <= 2 + 3 * (FAN - 1) + 1
    assert _incarnations(packed) == _want(range(60))


def test_a_pack_of_a_store_written_without_packing_takes_the_oldest_run_first(tmp_path):
    root = tmp_path / "store"
    _write(root, range(12), fan=0)
    w = _write(root, range(12, 13), close=False)        # one pack a flush, then the next
    assert _levels(root)[0] == 1 and w.chain_packs == 1
    w.submit("releases", _releases(13))
    w.close()
    assert _levels(root)[:2] == [1, 1] and verify(root).ok and _incarnations(root) == _want(range(14))


def test_a_file_a_pack_covers_is_read_once_and_deleted_by_the_next_writer(tmp_path):
    """A writer stopped between the pack's rename and the deletes - or a listing taken then - leaves
    files whose links the pack repeats: they are left out, and the next writer deletes them."""
    root = tmp_path / "store"
    w = _write(root, range(FAN - 1), close=False)
    kept = {p.name: p.read_bytes() for p in _files(root)}
    w.submit("releases", _releases(FAN - 1))
    w.close()                                           # the first FAN files packed into one
    assert len(_files(root)) == 1
    for name, data in kept.items():
        if not (root / "chain" / name).exists():
            (root / "chain" / name).write_bytes(data)
    assert len(_files(root)) == FAN - 1                 # the pack, and the second flush's file back
    assert [ln.seq for ln in read_chain(root)] == list(range(FAN)) and verify(root).ok
    assert C.covered_chain_files(root) == sorted(kept)[1:]
    assert _incarnations(root) == _want(range(FAN))
    SegmentWriter(root).close()
    assert len(_files(root)) == 1 and verify(root).ok


def test_a_reader_whose_listing_a_pack_overtook_lists_again(packed, monkeypatch):
    real, calls = C.os.listdir, []

    def listing(path):
        calls.append(path)
        return real(path) + (["000000001.json"] if len(calls) == 1 else [])   # packed away since
    monkeypatch.setattr(C.os, "listdir", listing)
    assert [ln.seq for ln in read_chain(packed)] == list(range(30)) and len(calls) == 2


def test_a_chain_that_changes_under_every_reading_is_named(packed, monkeypatch):
    real = C.os.listdir
    monkeypatch.setattr(C.os, "listdir", lambda path: real(path) + ["000000001.json"])
    v = verify(packed)
    assert not v.ok and "changed under every one of" in v.broken


def test_a_pack_never_signs_over_a_chain_file_changed_after_it_was_written(tmp_path, caplog):
    root = tmp_path / "store"
    w = _write(root, range(FAN - 1), close=False)
    f = _files(root)[0]
    f.write_text(f.read_text().replace('"rows": 3', '"rows": 30'))
    w.submit("releases", _releases(FAN - 1))
    w.flush()                                           # FAN files at level 0: a pack is due, and refused
    assert w.chain_packs == 0 and len(_files(root)) == FAN
    assert "no longer holds the links this writer wrote" in caplog.text
    w.close()
    v = verify(root)
    assert not v.ok and "segment 0" in v.broken and "edited" in v.broken


def _edit_pack(root: Path, change) -> None:
    body = json.loads(_files(root)[0].read_text())
    change(body)
    _files(root)[0].write_text(json.dumps(body))


def _stale_copy_with_other_links(root: Path) -> None:
    body = json.loads(_files(root)[0].read_text())
    body["links"] = body["links"][1:2]
    body["links"][0]["rows"] = 30
    (root / "chain" / "000000001.json").write_text(json.dumps(body))


TAMPERINGS = {
    "edit a link in the pack": (lambda s: _edit_pack(s, lambda b: b["links"][4].update(rows=30)),
                                "segment 4 .*link hash does not match its entry"),
    "drop a link from the pack": (lambda s: _edit_pack(s, lambda b: b["links"].pop(4)), "segment 5 .*sequence gap"),
    "strip the pack's signature": (lambda s: _edit_pack(s, lambda b: b.pop("signature")),
                                   "chain/000000000.json: not signed by this store's key"),
    "cut the pack's last links": (lambda s: _edit_pack(s, lambda b: b.update(links=b["links"][:-2])),
                                  "segment 25 .*sequence gap|not signed by this store's key"),
    "delete the pack": (lambda s: _files(s)[0].unlink(), "segment 27 .*sequence gap"),
    "a stale copy of packed links with other content": (_stale_copy_with_other_links,
                                                        "chain/000000001.json repeats seqs 1..1 of an earlier"),
    "a level that is not a number": (lambda s: _edit_pack(s, lambda b: b.update(level="x")), None),
}


@pytest.mark.parametrize("how", list(TAMPERINGS))
def test_tampering_with_a_pack_is_named_and_no_writer_signs_over_it(packed, how, capsys):
    tamper, expect = TAMPERINGS[how]
    tamper(packed)
    if expect is None:              # the level is the writer's hint, outside the signature: read as 0
        assert verify(packed).ok and _levels(packed)[0] == 0
        return
    named_and_refused(packed, expect, capsys)


def test_a_reader_s_verification_cache_checks_a_pack_s_signature_once(packed):
    from telemetry.store.chain import HashCache
    cache = HashCache(packed)
    assert verify(packed, cache=cache).ok
    sigs = [k for k in cache if k[0] == "sig"]
    assert len(sigs) == len(_files(packed))
    shutil.copy(_files(packed)[0], _files(packed)[0].with_name("000000001.json"))   # a covered copy: no new check
    assert verify(packed, cache=cache).ok and [k for k in cache if k[0] == "sig"] == sigs


@pytest.mark.parametrize("fan", [1, -1, -16])
def test_a_pack_of_fewer_than_two_chain_files_is_refused_before_the_store_is_made(tmp_path, fan):
    with pytest.raises(StoreError, match=f"chain_fan {fan}: 0 \\(no packing\\) or at least 2"):
        SegmentWriter(tmp_path / "store", chain_fan=fan)
    assert not (tmp_path / "store").exists()
