"""The store: immutable Parquet segments in a signed hash chain, read through DuckDB.

DuckDB allows one writing process and no concurrent reader on one database file, yet the
dashboard reads while the engine writes. So the engine never holds a database file: its
``SegmentWriter`` writes each batch of rows as an immutable Parquet segment (temp file, fsync,
rename), then appends a signed chain file for the flush (temp file, fsync, rename) and the signed
head to the anchor outside the store. Readers open an in-memory DuckDB over exactly the chained
segments, so a reader never sees a half-written file.

    ROOT/segments/<table>/<seq>.parquet     one table's rows, seq global and increasing (a flush's
                                            segment, or a merge of a table's older ones: compaction)
    ROOT/chain/<seq>.json, intent.json, seal.json, store.json   see telemetry/store/chain.py
    (ROOT itself)                           one writer at a time: flock on the store directory's own
                                            descriptor (no lock file a careless hand could delete)
    (no secret: the writer's keys live outside the store, telemetry/store/keys.py)

Durability: rows reach disk when their table's buffer is flushed - every ``flush_interval``
seconds (default ``FLUSH_INTERVAL``, 2 s), when ``max_rows`` or ``max_bytes`` are buffered, and on close. After
``kill -9`` at most the last ``flush_interval`` seconds of rows (plus one segment being written)
are lost; a segment written but not yet linked is named by the writer's signed intent, reported by
``verify`` as an unlinked tail, ignored by readers, and linked by the next writer (``adopted``). A
write that fails mid-flush leaves what the flush wrote before it linked and its own rows buffered
(the next flush or the close retries them); the producer gets the StoreError.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from telemetry.errors import StoreError
from telemetry.store.chain import (GENESIS, Link, parse_chain_file, anchor_entry, anchor_path, append_anchor, chain_body,
                                   covered_chain_files, intent_body, read_chain, read_chain_files, replaced, verify)
from telemetry.store.columns import Columns, columns_to_arrow, num_rows, parquet_options, parts_apart, sized_for
from telemetry.store.keys import (STORE_FILE, KeyError_, WriterKeys, record_identity, recorded_identity,
                                  substituted)
from telemetry.store.schema import arrow_schemas, conform

# Seconds between flushes: the durability window after kill -9 and how far behind a live reader
# is. Each flush writes a segment and a chain link per table, a cost that does not shrink with
# fewer rows, so a shorter interval costs decode throughput (bench/telemetry.py --flush-intervals 1,2
# measures them side by side).
FLUSH_INTERVAL = 2.0
COMMIT_WINDOW = 0.25        # seconds of posts that share one group-commit write (at most 4 writes a second)
# Compaction, as ClickHouse merges a MergeTree's parts: once a table holds COMPACT_FAN + 1 live
# segments of one level (a flush's segment is level 0), the writer merges the oldest COMPACT_FAN
# into one of the next level - one merge a table per flush, up to its max_rows rows (and max_bytes
# of Parquet) - so a store written for a day holds tens of files a table rather than 43,200
# (readers pay per file). The
# merged segments' files are deleted COMPACT_GRACE seconds later (a reader that listed them before
# the merge still finds them); the merge's link names them and is signed like any other.
COMPACT_FAN = 16
COMPACT_GRACE = 300.0
FINAL = 1 << 30             # a level no merge takes (a merge would pass max_rows, or cannot be made)
# The chain is packed the same way: once CHAIN_FAN consecutive chain files are of one level (a
# flush's own file is level 0), the writer writes their links as one file of the next level, signed
# like any chain file, in place of the first (rename), and deletes the others - a store written for a
# day holds tens of chain files rather than 43,200 (every reader lists, reads and checks each). A
# pack of level CHAIN_TOP (CHAIN_FAN ** 3 = 4096 flushes, about 25,000 links, a few MB) is not
# packed again: a pack's links are read back and rewritten, and a file of every link ever would be.
CHAIN_FAN = 16
CHAIN_TOP = 3
log = logging.getLogger("kvledger.store")


def can_leave_idle() -> bool:
    """Whether a thread of this process may go from SCHED_IDLE back to normal (it needs CAP_SYS_NICE
    or RLIMIT_NICE >= 20): tried on a scratch thread, never on the writer itself."""
    ok = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except (AttributeError, OSError):
            pass
    t = threading.Thread(target=probe, name="kvledger-priority-probe")
    t.start()
    t.join()
    return bool(ok)


def enter_idle_priority() -> str:
    """Put the calling thread under SCHED_IDLE: it runs on a core no other thread wants (between
    the engine's steps, while torch's workers sleep) and yields it the moment one does.
    bench/telemetry.py's calibration compares a thread burning the writer's CPU at both priorities
    beside the tiny decode. While this was built, standalone runs of it cost the decode 1.4, 2.0 and
    3.4 points less under SCHED_IDLE than at normal priority, and the bench's own runs -0.2 and 0.3
    points less: within this machine's noise, so not shown to save anything yet (nice 19 instead:
    1.4 and 2.0 points in two standalone runs)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))     # pid 0: this thread only
        return "idle"
    except (AttributeError, OSError):       # not Linux, or refused: stays at normal priority
        return "normal"


def has_live_writer(root: str | Path) -> bool:
    """Whether a writer holds the store's lock now (a live replay, serve or collect): the kernel
    drops the lock when its holder closes it or dies, so False after a clean close and a crash."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: "bytes | pa.Buffer") -> None:
    """Write data as path: a temp file, fsync, rename (a reader never sees a partial file)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)            # e.g. disk full: no half-written temp file is left behind
        raise


class Commit:
    """A durability ticket (``SegmentWriter.commit``): set once the rows it follows are in linked
    segments, or the write failed (``error``)."""
    __slots__ = ("done", "error")

    def __init__(self):
        self.done, self.error = threading.Event(), None

    def wait(self, timeout: float | None = None) -> bool:
        """True once durable; False when the write failed or ``timeout`` passed first."""
        return self.done.wait(timeout) and self.error is None


class SegmentWriter:
    """Buffers columnar batches per table and writes chained Parquet segments from one thread.

    ``submit`` puts a batch on a bounded queue and blocks when it is full (back-pressure, never
    loss). Functions given to ``add_drain`` run on the writer thread before every flush and return
    rows to write with it (the page ledger closes its open read runs there).
    """

    def __init__(self, root: str | Path, flush_interval: float = FLUSH_INTERVAL, max_rows: int = 1_000_000,
                 max_bytes: int = 32 << 20, queue_size: int = 256, boot: str | None = None, anchor: str | Path | None = None,
                 idle_priority: bool = False, compact_fan: int | None = None, compact_grace: float | None = None,
                 chain_fan: int | None = None):
        """``idle_priority``: run the writer thread under SCHED_IDLE (Linux), so that it takes the CPU
        only when nothing else wants it - for an engine whose torch threads fill every core, where a
        writer at normal priority takes its CPU time out of the decode. Its producers must bound what
        they hand over (the page ledger waits for it past a backlog), and call ``nudge`` (the ledger
        does every step, ``submit`` every batch): under load that never leaves a core idle it would
        not run at all, and a flush overdue by a quarter interval (at most 0.5 s) is raised to normal
        priority until it is done - the flush interval stays the durability window after a kill -9
        (tests/test_store.py kills a writer beside busy processes; without the nudge nothing was
        flushed). Needs the right to leave SCHED_IDLE again (CAP_SYS_NICE or RLIMIT_NICE >= 20),
        checked first: without it the writer stays at normal priority.

        ``compact_fan``: segments of one level merged into one (None: ``COMPACT_FAN``; 0: never
        merge); ``compact_grace``: seconds before a merged segment's file is deleted (None:
        ``COMPACT_GRACE``); ``chain_fan``: chain files of one level packed into one (None:
        ``CHAIN_FAN``; 0: never pack)."""
        from engine.request import new_boot_id
        self.root = Path(root)
        self.idle_priority = idle_priority
        self.priority = "normal"           # what the thread got ("idle" once it is under SCHED_IDLE)
        self._boosted, self.boosts = False, 0          # raised to normal for an overdue flush (nudge)
        self._last_flush = time.monotonic()
        # the run this writer records: every row of a table with a ``boot`` column that its producer
        # did not label gets it (node names and logical clocks restart with every boot)
        self.boot = boot or new_boot_id()
        compact_fan = COMPACT_FAN if compact_fan is None else compact_fan
        compact_grace = COMPACT_GRACE if compact_grace is None else compact_grace
        chain_fan = CHAIN_FAN if chain_fan is None else chain_fan
        for name, fan, what in (("compact_fan", compact_fan, "compaction"), ("chain_fan", chain_fan, "packing")):
            if fan == 1 or fan < 0:
                raise StoreError(f"{name} {fan}: 0 (no {what}) or at least 2 files into one")
        self.chain_fan, self.chain_packs = chain_fan, 0
        self.compact_fan, self.compact_grace, self.compactions = compact_fan, compact_grace, 0
        self._doomed: list[tuple[float, list[Path]]] = []      # (when, the merged segments' files) to delete
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} exists and is not a directory")
        (self.root / "chain").mkdir(parents=True, exist_ok=True)
        # the lock is on the directory's own descriptor: deleting or replacing a lock file cannot let
        # a second writer in (the kernel drops it only when the holder closes it or dies)
        self._lock_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreError(f"store {self.root} already has a writer (another process holds its lock); one "
                             "writer at a time") from None
        try:
            self._open_chain(anchor)
        except BaseException:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            raise
        # a table is written once it holds max_rows rows or max_bytes of Arrow buffers, else every
        # flush_interval: memory stays bounded, and a fast producer's rows are written while it sends
        self.flush_interval, self.max_rows, self.max_bytes = flush_interval, max_rows, max_bytes
        self._bytes: dict[str, int] = {}
        self._drains: list[Callable[[], list[tuple[str, Columns]]]] = []
        self.schemas = arrow_schemas()
        self._parquet = {t: parquet_options(s, t) for t, s in self.schemas.items()}
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._buf: dict[str, list[pa.Table]] = {t: [] for t in self.schemas}
        self._rows: dict[str, int] = dict.fromkeys(self.schemas, 0)
        self.rows_written: dict[str, int] = dict.fromkeys(self.schemas, 0)
        self.segments_written = 0
        self.error: BaseException | None = None
        self._commits: list[Commit] = []         # writer thread only: tickets waiting for the next write
        self.commit_window = min(COMMIT_WINDOW, flush_interval)   # a ticket waits at most this (+ one write)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvledger-store-writer", daemon=True)
        self._thread.start()

    def add_drain(self, drain: Callable[[], list[tuple[str, "Columns"]]]) -> None:
        self._drains.append(drain)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def saturated(self) -> bool:
        """The batch queue is (nearly) full: a receiver answers 503 instead of blocking its sender."""
        return self._q.qsize() >= self._q.maxsize - 2      # room for one more batch and its commit ticket

    @property
    def accepting(self) -> bool:
        """Open and not failed: a background exporter checks this and reports a failure to its SDK
        instead of raising into the SDK's thread (the engine still gets the StoreError itself)."""
        return not self._closed and self.error is None

    # ---- producer side -------------------------------------------------------------------------
    def submit(self, table: str, data: "pa.Table | Columns") -> None:
        if table not in self.schemas:
            raise StoreError(f"unknown table {table!r}; schema.sql defines {sorted(self.schemas)}")
        if self.error is not None:
            raise StoreError(f"store writer failed: {self.error}") from self.error
        if self._closed:
            raise StoreError("store writer is closed")
        if num_rows(data):
            self.nudge()
            self._q.put((table, data))

    def commit(self, table: str, data: "pa.Table | Columns") -> Commit:
        """Submit, and get a ticket set when those rows are durable - group commit: the writer writes
        once its queue runs dry and COMMIT_WINDOW has passed since its last write (every ticket
        queued meanwhile shares that one write: at most 4 segments a second per table), so a
        receiver acknowledges only what is on disk. A write that fails (a full disk) fails every
        ticket waiting on it: nothing is acknowledged and then lost."""
        self.submit(table, data)
        c = Commit()
        self._q.put(("__commit__", c))
        return c

    def submit_lazy(self, build: Callable[[], list[tuple[str, "pa.Table | Columns"]]]) -> None:
        """Queue a function the writer thread calls to build (table, rows) pairs: the engine hands over
        its step's immutable tensors and goes on; the column work happens here, off its path."""
        if self.error is not None:
            raise StoreError(f"store writer failed: {self.error}") from self.error
        self._q.put(("__lazy__", build))

    def flush(self) -> None:
        """Write every buffered row now and wait until it is linked."""
        if self._closed:
            raise StoreError("store writer is closed")
        done = threading.Event()
        self._q.put(("__flush__", done))
        done.wait()
        if self.error is not None:
            raise StoreError(f"store writer failed: {self.error}") from self.error

    def close(self) -> None:
        """Flush and stop; the thread and the store's lock are released even when the flush fails
        (its StoreError still reaches the caller), so another writer can take the store over."""
        if self._closed:
            return
        try:
            self.flush()
            self._anchor(self._seq - 1, self._prev, seal=True)   # a clean close: the head it closed on, signed
            if self.anchor_error is not None:
                raise StoreError(f"the anchor {self.anchor} could not be written ({self.anchor_error}): every row "
                                 "is in the store and it verifies, but its last head is not anchored outside it "
                                 "(`kvledger verify` names the unanchored tail); free the anchor's disk")
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join()
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)

    # ---- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self.idle_priority and can_leave_idle():     # (else an overdue flush could not be sped up: normal)
            self.priority = enter_idle_priority()
        last = self._last_flush = time.monotonic()
        while True:
            timeout = max(0.0, self.flush_interval - (time.monotonic() - last))
            if self._commits:               # a ticket waits: write when its commit window has passed
                timeout = min(timeout, max(0.0, self.commit_window - (time.monotonic() - last)))
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = ("__tick__", None)
            if item is None:
                self._settle(self.error or StoreError("store writer is closed"))
                return
            table, data = item
            try:
                if table == "__flush__":
                    self._write_all()
                    last = self._flushed()          # everything is written: the next periodic flush is an interval away
                    self._compact()
                    data.set()
                    continue
                if table == "__commit__":
                    self._commits.append(data)
                items = (data() if table == "__lazy__" else [] if table in ("__tick__", "__commit__")
                         else [(table, data)])
                for t, d in items:
                    if num_rows(d):
                        self._buf[t].append(d)
                        self._rows[t] += num_rows(d)
                        self._bytes[t] = self._bytes.get(t, 0) + (d.nbytes if isinstance(d, pa.Table) else 0)
                        if self._rows[t] >= self.max_rows or self._bytes[t] >= self.max_bytes:
                            self._write([t])
                since = time.monotonic() - last
                # group commit: tickets wait for the queue to run dry and at most commit_window since
                # the last write, so posts arriving together share one write (one segment per table)
                if since >= self.flush_interval or (self._commits and self._q.empty() and since >= self.commit_window):
                    self._write_all()
                    last = self._flushed()
                    self._compact()     # after the flush's tickets are settled and an overdue flush's raise is over
            except BaseException as e:        # surfaced to the producer on its next call
                self.error = e
                if table == "__flush__":
                    data.set()
                self._settle(e)

    def _settle(self, error: BaseException | None = None) -> None:
        """Writer thread: every commit ticket waiting is durable now (or failed with ``error``)."""
        for c in self._commits:
            c.error = error
            c.done.set()
        self._commits.clear()

    def _flushed(self) -> float:
        """Writer thread, after each flush: the time of it; a boosted idle writer goes back to idle."""
        self._settle()
        if self._boosted:
            self._boosted = False
            enter_idle_priority()
        self._last_flush = time.monotonic()
        return self._last_flush

    def nudge(self) -> None:
        """Producer's thread (the engine's, every step): an idle-priority writer whose periodic flush
        is overdue - the cores were never idle - runs at normal priority until that flush is done, so
        the flush interval stays the durability window. A comparison when nothing is overdue."""
        if (self.priority == "idle" and not self._boosted
                and time.monotonic() - self._last_flush > self.flush_interval + min(0.5, self.flush_interval / 4)):
            self._boosted = True
            self.boosts += 1
            try:
                os.sched_setscheduler(self._thread.native_id, os.SCHED_OTHER, os.sched_param(0))
            except OSError as e:           # checked before the writer went idle: not expected
                log.warning("store writer: could not raise its idle priority for an overdue flush: %s", e)

    def _open_chain(self, anchor) -> None:
        """Load the writer's keys (outside the store), verify what is there before signing anything
        after it, and link the segments a killed writer renamed into place but did not link - only
        those its signed intent names (complete: rename follows fsync), never a file someone dropped
        in. A store that does not verify is refused: appending would sign over the damage."""
        new = not (self.root / STORE_FILE).exists()
        try:
            self.wkeys = WriterKeys.open_or_create(self.root)
        except KeyError_ as e:
            raise StoreError(str(e)) from None
        if not new and (why := substituted(self.root, self.wkeys.identity)) is not None:
            raise StoreError(f"{why}; refusing to append to it")
        if new or recorded_identity(self.root) is None:
            record_identity(self.root, self.wkeys.identity)      # which store lives here, kept outside it
        self.keys = self.wkeys.keys
        self.anchor = anchor_path(self.wkeys.identity.store_id, anchor)
        self.anchor_error: BaseException | None = None
        self.on_anchor: list[Callable[[dict], None]] = []
        v = verify(self.root, self.anchor if self.anchor.exists() else None)
        if not v.ok:
            raise StoreError(f"store {self.root} does not verify ({v.broken}); refusing to append to it "
                             "(`kvledger verify` names the damage; start a new store)")
        self._seq, self._prev = v.seq + 1, v.head
        for tmp in (self.root / "segments").glob("*/.tmp-*"):   # a killed writer's half-written files: this
            tmp.unlink(missing_ok=True)                            # writer holds the lock, nobody else writes them
        (self.root / "seal.json").unlink(missing_ok=True)      # open again: no longer closed on that head
        self._unlinked: list[tuple[int, str, str, int, str, str]] = sorted(v.unlinked)   # in place, not yet chained
        self.adopted = [u[2] for u in self._unlinked]
        # each table's live segments (seq -> (file, rows, sha256, level)), what compaction merges
        self._live: dict[str, dict[int, tuple[str, int, str, int]]] = {}
        # the chain files (name, level, last link) - what packing reads back - and those a pack
        # covers that its writer had not deleted yet
        self._chain_files: list[tuple[str, int, str]] = []
        for cf in read_chain_files(self.root):
            self._chain_files.append((cf.name, cf.level, cf.links[-1].link if cf.links else GENESIS))
            for ln in cf.links:
                self._note_link(ln)
        for name in covered_chain_files(self.root):
            (self.root / "chain" / name).unlink(missing_ok=True)
        if self._unlinked:
            self._seq = self._unlinked[-1][0] + 1
            self._link_unlinked()
        chain = read_chain(self.root)
        gone = [self.root / ln.file for ln in chain if ln.seq in replaced(chain)]
        if gone:                        # merged by an earlier writer and not deleted yet: after the grace
            self._doomed.append((time.monotonic() + self.compact_grace, gone))

    def _link_unlinked(self) -> None:
        """Chain the segments written and not yet linked (seq order), one link each, as one chain
        file named by the first seq (temp file, fsync, rename): a flush's segments cost one chain
        write, not one each. A segment's hash is the one taken as it was written, or read back from
        its file (None). The chain head moves only once the file is in place: if writing it fails,
        the segments stay waiting and the next flush links them."""
        if not self._unlinked:
            return
        links, prev = [], self._prev
        for seq, table, rel, rows, sha, parts in self._unlinked:
            link = Link(seq, table, rel, rows, sha, prev, "", parts)
            links.append(link := link._replace(link=link.computed()))
            prev = link.link
        name = f"{self._unlinked[0][0]:09d}.json"
        _atomic_write(self.root / "chain" / name, chain_body(self.wkeys, links))
        self._prev, self._unlinked = prev, []
        self._chain_files.append((name, 0, prev))
        for ln in links:
            self._note_link(ln)
        self._anchor(links[-1].seq, prev, seal=False)

    def _note_link(self, ln: Link) -> None:
        """A link is in the chain: its table's live segments gain it and lose what it merged."""
        live = self._live.setdefault(ln.table, {})
        level = 0
        for r in ln.parts():
            level = max(level, live.pop(r)[3] + 1) if r in live else FINAL
        live[ln.seq] = (ln.file, ln.rows, ln.sha256, level)

    def _compact(self) -> None:
        """Writer thread, after a flush: per table, merge the oldest ``compact_fan`` live segments of
        the lowest level holding more than that many (one merge a table), then delete the files of
        merges older than the grace period. A merge that fails (a full disk) leaves the store as it
        was - its rows stay in the segments it would have merged - and is logged. Runs after the
        flush is settled: an idle-priority writer raised for an overdue flush is back to idle."""
        if self.compact_fan and not self._unlinked:    # (a merge waiting for its link is not made twice)
            for table, live in list(self._live.items()):
                levels: dict[int, list[int]] = {}
                for seq, (_, _, _, level) in live.items():
                    if level < FINAL:
                        levels.setdefault(level, []).append(seq)
                for level in sorted(levels):
                    if len(levels[level]) > self.compact_fan:
                        try:
                            self._merge(table, sorted(levels[level])[:self.compact_fan])
                        except Exception as e:     # noqa: BLE001 - a merge is only speed: never a producer's error
                            log.warning("store writer: compaction of %s not done: %s", table, e)
                        break
        if self.chain_fan and not self._unlinked:
            try:
                self._pack_chain()
            except Exception as e:      # noqa: BLE001 - packing is only speed: never a producer's error
                log.warning("store writer: chain files not packed: %s", e)
        now = time.monotonic()
        due = [paths for when, paths in self._doomed if when <= now]
        self._doomed = [d for d in self._doomed if d[0] > now]
        for path in (p for paths in due for p in paths):
            try:
                path.unlink(missing_ok=True)
            except OSError as e:        # a file left behind costs disk, not a row: readers never read it
                log.warning("store writer: merged segment %s not deleted: %s", path, e)

    def _pack_chain(self) -> None:
        """Pack the oldest run of ``chain_fan`` consecutive chain files of the lowest level below
        CHAIN_TOP that has one (one pack a flush) into one file of the next level, named as the
        first: written beside, renamed over the first, then the others deleted (a reader in between
        leaves them out: their links repeat the pack's). The links are read back and must chain from
        the file before the run to the last link this writer knows for the run - a pack never signs
        over a chain file changed since it was written."""
        files, fan = self._chain_files, self.chain_fan
        runs: dict[int, int] = {}          # level -> index of the oldest run of fan files of that level
        i = 0
        while i < len(files):
            j = i
            while j < len(files) and files[j][1] == files[i][1]:
                j += 1
            if j - i >= fan and files[i][1] < CHAIN_TOP:
                runs.setdefault(files[i][1], i)
            i = j
        if not runs:
            return
        level = min(runs)
        start = runs[level]
        run = files[start:start + fan]
        links, prev = [], files[start - 1][2] if start else GENESIS
        for name, _, last in run:
            cf = parse_chain_file(name, (self.root / "chain" / name).read_bytes())
            for ln in cf.links:
                if ln.prev != prev or ln.computed() != ln.link:
                    raise OSError(f"chain/{name} no longer holds the links this writer wrote; not packed "
                                  "(`kvledger verify`)")
                prev = ln.link
                links.append(ln)
            if prev != last:
                raise OSError(f"chain/{name} no longer ends on the link this writer wrote; not packed")
        _atomic_write(self.root / "chain" / run[0][0], chain_body(self.wkeys, links, level + 1))
        files[start:start + fan] = [(run[0][0], level + 1, prev)]
        self.chain_packs += 1
        for name, _, _ in run[1:]:
            try:
                (self.root / "chain" / name).unlink(missing_ok=True)
            except OSError as e:        # left behind: readers leave it out, the next writer deletes it
                log.warning("store writer: packed chain file %s not deleted: %s", name, e)

    def _merge(self, table: str, parts: list[int]) -> None:
        """Merge these live segments of ``table`` into one, their rows in seq order, linked as a
        compaction. Each part's bytes are checked against the hash its link signed before they are
        read: a merge never signs over a segment changed since it was written."""
        live = self._live[table]
        size = sum((self.root / live[s][0]).stat().st_size for s in parts)
        if sum(live[s][1] for s in parts) > self.max_rows or size > self.max_bytes:
            for s in parts:             # as big as a segment gets (max_rows, or max_bytes of Parquet): as they are
                live[s] = (*live[s][:3], FINAL)
            return
        tables = []
        for s in parts:
            rel, _, sha, _ = live[s]
            body = (self.root / rel).read_bytes()
            if hashlib.sha256(body).hexdigest() != sha:
                raise OSError(f"{rel} no longer matches the hash its link signed; not merged (`kvledger verify`)")
            try:
                tables.append(conform(table, pq.read_table(pa.BufferReader(body))))
            except (ValueError, pa.ArrowException):    # an older schema that cannot be made today's
                for p in parts:
                    live[p] = (*live[p][:3], FINAL)
                return
        data = pa.concat_tables(tables)
        merged = [self.root / live[s][0] for s in parts]
        seq = self._seq
        rel, sha, body = self._parquet_body(table, seq, data)
        entry = (seq, table, rel, data.num_rows, sha, ",".join(map(str, parts)))
        _atomic_write(self.root / "intent.json", intent_body(self.wkeys, [entry]))
        _atomic_write(self.root / rel, body)
        self._seq = seq + 1
        self._unlinked.append(entry)
        self._link_unlinked()
        self.compactions += 1
        self._doomed.append((time.monotonic() + self.compact_grace, merged))

    def _anchor(self, seq: int, head: str, seal: bool) -> None:
        """The signed head, out of the store. A failing anchor (its disk gone) loses no row: the
        store stays whole and verifiable, the next flush anchors a newer head, and the failure is
        kept for close() and logged (verify reports the unanchored tail meanwhile)."""
        entry = anchor_entry(self.wkeys, seq, head, seal)
        try:
            append_anchor(self.anchor, entry)
            self.anchor_error = None           # a newer head anchored: it covers every earlier one
        except OSError as e:
            self.anchor_error = e
            log.warning("anchor %s not written: %s", self.anchor, e)
        for fn in self.on_anchor:             # e.g. Telemetry: the signed head out as a span (OTLP)
            fn(entry)
        if seal:
            _atomic_write(self.root / "seal.json", json.dumps(entry).encode())

    def _write_all(self) -> None:
        for drain in self._drains:
            for t, d in drain():
                self._buf[t].append(d)
                self._rows[t] += num_rows(d)
        self._write([t for t in self.schemas if self._rows[t]])

    def _write(self, tables: list[str]) -> None:
        """Write each table's buffered rows as one segment and link them: all are encoded and
        hashed in memory first, the signed intent naming them goes down, then each segment (temp
        file, fsync, rename). What was written is linked even if a later table fails; a failed
        table's rows stay buffered and its seq is not taken."""
        if not tables:
            return
        encoded = [self._encode(t, self._seq + i) for i, t in enumerate(tables)]
        try:
            # the intent names the segments still waiting for their link too (a chain write that failed):
            # a writer killed now leaves every one of them adoptable, none a stranger
            _atomic_write(self.root / "intent.json",
                          intent_body(self.wkeys, [*self._unlinked, *((*e[:5], "") for e in encoded)]))
            for seq, table, rel, rows, sha, body in encoded:
                _atomic_write(self.root / rel, body)
                self._seq = seq + 1              # taken only once the segment is in place: no gap on a failed write
                self.rows_written[table] += rows
                self.segments_written += 1
                self._buf[table], self._rows[table], self._bytes[table] = [], 0, 0
                self._unlinked.append((seq, table, rel, rows, sha, ""))
        finally:
            self._link_unlinked()

    def _encode(self, table: str, seq: int) -> tuple[int, str, str, int, str, "pa.Buffer"]:
        """The table's buffered rows as one Parquet segment, in memory, with its sha256."""
        raw = [b for b in self._buf[table] if not isinstance(b, pa.Table)]
        fill = {"boot": self.boot}
        # string columns stay the dictionaries the producers' columns hold (``writing_schema``) where every
        # part is columns; an Arrow table's strings (spans: ids that never repeat) are cheaper as strings
        coded = len(raw) == len(self._buf[table])
        tables = [conform(table, b, fill) for b in self._buf[table] if isinstance(b, pa.Table)]
        if raw:
            tables.append(conform(table, columns_to_arrow(raw), fill, dictionaries=coded))
        data = tables[0] if len(tables) == 1 else pa.concat_tables(tables)     # parts are conformed already
        rel, sha, body = self._parquet_body(table, seq, data)
        return seq, table, rel, data.num_rows, sha, body

    def _parquet_body(self, table: str, seq: int, data: pa.Table) -> tuple[str, str, "pa.Buffer"]:
        """(file, sha256, bytes) of ``data`` as the table's segment number ``seq``, in memory."""
        rel = f"segments/{table}/{seq:09d}.parquet"
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        sink = pa.BufferOutputStream()
        options = dict(sized_for(self._parquet[table], data.num_rows))     # (a copy: the table's own stays whole)
        group = options.pop("row_group_size", None)
        with pq.ParquetWriter(sink, data.schema, **options) as w:
            for part in parts_apart(table, data):   # (ngrams: the outputs in row groups of their own)
                w.write_table(part, row_group_size=group)
        body = sink.getvalue()
        return rel, hashlib.sha256(body).hexdigest(), body
