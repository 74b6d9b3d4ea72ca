"""Answers that do not grow with history: the tables every query shares (``requests``,
``exposure_slots``, ``exposure_ngrams``) of one verified snapshot, kept between commands outside
the store, as the segment hashes are (``telemetry.store.chain.HashCache``).

An investigation asks many questions of one store that no longer changes (``exposures``, then
``tenants``, ``scores``, the report, the dashboard): the first command builds the shared tables
(seconds at 100 M ledger rows), the next ones read them back (a fraction of a second). The key is
the store's verified chain head - which commits to every segment's sha256 and their order - with
the run asked for, which slot-level source answered (exposure index or join), the text of the SQL
that built each table and the DuckDB version: any new segment, other SQL or other engine misses
and builds again. Only a store that verified and that no writer holds is kept (a live store grows
between two commands; a store that does not verify is never remembered). The cache lives in the
state directory beside the keys and the anchors (the same custody: whoever can write there can
already replace the anchor); it is speed only - an unreadable or damaged entry is rebuilt, an
unwritable directory is no error. ``KVLEDGER_ANSWER_CACHE=0`` turns it off.

A named query asked of the whole store (no window) is kept the same way beside its snapshot's
tables, as an Arrow IPC file named by the snapshot key and a hash of the query's SQL text and
parameters: the next command, or the dashboard's next render of an idle store, reads the answer
back instead of running it (a windowed query always runs).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Callable
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.ipc  # noqa: F401  (pa.ipc)

from telemetry.store.keys import state_dir
from telemetry.store.schema import SCHEMA_SQL

ENV = "KVLEDGER_ANSWER_CACHE"
KEEP = 3            # snapshots kept per store (the newest; older ones are removed when one is added)
_SAVING: dict[Path, threading.Thread] = {}      # entries being written by this process (in_background)
_SAVING_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


def answers_dir(store: str | Path) -> Path:
    """Where the kept answers of the store at this path live (one directory per resolved path)."""
    return state_dir() / "answers" / hashlib.sha256(str(Path(store).resolve()).encode()).hexdigest()[:32]


class Answers:
    """The cache entry of one snapshot: a DuckDB file holding its shared tables."""

    def __init__(self, store: str | Path, verdict, run: str | None, texts: dict[str, str]):
        self.dir = answers_dir(store)
        ident = [verdict.store_id, verdict.seq, verdict.head, run, duckdb.__version__,
                 hashlib.sha256(SCHEMA_SQL.read_bytes()).hexdigest(), sorted(texts.items())]
        self.key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()
        self.path = self.dir / f"{self.key[:40]}.duckdb"
        self.results: set[Path] = set()     # the answers kept through this object (keep_result)
        self.tables = list(texts)
        self._attached = False

    def load(self, con: duckdb.DuckDBPyConnection, tables: list[str]) -> bool:
        """``tables`` (of this entry's) as views in ``con`` over the entry, attached read-only for
        the connection's life (nothing is copied; a newer entry renamed over it later leaves this
        one's open file as it was); False when there is no usable entry (nothing is left in ``con``)."""
        if not self._attached:
            self.wait()                 # this process's own write of this entry, if one is under way
            if not self.path.is_file():
                return False
            try:
                con.execute("ATTACH ? AS kvledger_answers (READ_ONLY)", [str(self.path)])
            except duckdb.Error:
                return False
            try:
                ok = self._key(con) == self.key
            except duckdb.Error:
                ok = False
            if not ok:
                con.execute("DETACH kvledger_answers")
                return False
            self._attached = True
        made: list[str] = []
        try:
            for t in tables:
                con.execute(f"CREATE VIEW main.{t} AS SELECT * FROM kvledger_answers.{t}")
                made.append(t)
            return True
        except duckdb.Error:
            for t in made:
                con.execute(f"DROP VIEW IF EXISTS main.{t}")
            return False

    def _result_path(self, name: str, text: str, params: dict) -> tuple[Path, bytes]:
        """Where a kept answer lives, and the key it carries inside (a file renamed from another
        snapshot or query under this name is refused, as a foreign tables entry is)."""
        h = hashlib.sha256(json.dumps([self.key, name, text, sorted((k, str(v)) for k, v in params.items())]).encode())
        return self.dir / f"{self.key[:40]}.{h.hexdigest()[:24]}.arrow", h.hexdigest().encode()

    def result(self, name: str, text: str, params: dict) -> pl.DataFrame | None:
        """A kept whole-store answer of query ``name`` (its SQL ``text`` and ``params``), or None
        (once this process's write of it, if one is under way, is done)."""
        path, key = self._result_path(name, text, params)
        entry_written(path)
        try:
            table = read_kept(path)
        except (OSError, pa.ArrowException):        # absent, truncated, not Arrow: run the query instead
            return None
        if (table.schema.metadata or {}).get(b"kvledger_key") != key:
            return None
        return pl.from_arrow(table.replace_schema_metadata(None))

    def keep_result(self, name: str, text: str, params: dict, df: pl.DataFrame) -> None:
        """Keep a whole-store answer (written to a temporary name, renamed into place), on a thread
        of its own (``in_background``: a first dashboard page's TTFT and transfer answers at 121 M
        read rows are ~100 MB, which the page had waited for); ``result`` waits for it."""
        path, key = self._result_path(name, text, params)
        table = df.to_arrow()
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"kvledger_key": key})

        def write() -> None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                    w.write_table(table)
                os.replace(tmp, path)
                self._prune()
            except (OSError, pa.ArrowException):        # an unwritable state directory: no error
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
        self.results.add(path)
        in_background(path, write)

    def _prune(self) -> None:
        """Keep the entries of the newest KEEP snapshots of this store (tables and answers), remove
        the rest: a growing store asked only queries that build no table leaves no trail either."""
        snaps: dict[str, int] = {}
        for p in [*self.dir.glob("*.duckdb"), *self.dir.glob("*.arrow")]:
            try:
                k = p.name.split(".", 1)[0]
                snaps[k] = max(snaps.get(k, 0), p.stat().st_mtime_ns)
            except OSError:
                pass
        kept = set(sorted(snaps, key=snaps.get, reverse=True)[:KEEP])
        for p in [*self.dir.glob("*.duckdb"), *self.dir.glob("*.arrow")]:
            if p.name.split(".", 1)[0] not in kept:
                p.unlink(missing_ok=True)

    @staticmethod
    def _key(con) -> str | None:
        return con.execute("SELECT key FROM kvledger_answers.kvledger_key").fetchone()[0]

    def save_later(self, con: duckdb.DuckDBPyConnection) -> None:
        """``save`` on a thread of its own, off the answer's path (writing the entry is a second or
        so at 100 M ledger rows: the DuckDB file is compressed and checkpointed), through a cursor of
        ``con`` - the snapshot's tables as they are. ``wait`` (``load`` and ``Forensics.close`` call
        it) joins it; a process exits only after it (not a daemon thread)."""
        cur = con.cursor()

        def work() -> None:
            try:
                self.save(cur)
            finally:
                cur.close()
        in_background(self.path, work)

    def wait(self) -> None:
        """Return once no write of this entry or of an answer it keeps (``keep_result``) by this
        process is under way."""
        entry_written(self.path)
        for path in list(self.results):
            entry_written(path)

    def save(self, con: duckdb.DuckDBPyConnection) -> None:
        """Write the tables (a temporary file renamed into place: a reader sees a whole entry or
        none), then keep only the newest KEEP snapshots' entries of this store."""
        tmp = self.dir / f".{self.key[:40]}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.unlink(missing_ok=True)
            con.execute("ATTACH ? AS kvledger_answers_out", [str(tmp)])
            try:
                for t in self.tables:
                    con.execute(f"CREATE TABLE kvledger_answers_out.{t} AS SELECT * FROM main.{t}")
                con.execute("CREATE TABLE kvledger_answers_out.kvledger_key AS SELECT ? AS key", [self.key])
            finally:
                con.execute("DETACH kvledger_answers_out")
            os.replace(tmp, self.path)
            self._prune()
        except (OSError, duckdb.Error):
            pass
        finally:
            for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
                try:
                    leftover.unlink(missing_ok=True)
                except OSError:
                    pass


def read_kept(path: str | Path) -> pa.Table:
    """A kept Arrow IPC file, memory-mapped rather than read into fresh memory: a kept ``ttft`` or
    ``transfers`` answer is ~50 MB at 121 M read rows and an idle store's dashboard reads both back
    on every refresh (the copy took half of such a render: 0.69 -> 0.37 s in AppTest, this machine).
    Safe to map: every entry is written under a temporary name and renamed into place, and a file
    removed while mapped stays readable until its tables are gone."""
    with pa.memory_map(str(path)) as f:
        return pa.ipc.open_file(f).read_all()


def write_entry(d: Path, tables: dict[str, pa.Table], meta: dict) -> bool:
    """Write a kept entry in the state directory: each table as ``NAME-GEN.arrow``, then
    ``meta.json`` (``meta`` with ``gen`` added) naming them, each renamed into place - a reader sees
    a whole entry or the previous one - then remove the older generation's files. False (and no
    error) when it cannot (an unwritable state directory)."""
    gen = f"{time.time_ns()}-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, table in tables.items():
            tmp = d / f".{name}-{gen}.tmp"
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
            os.replace(tmp, d / f"{name}-{gen}.arrow")
        tmp = d / f".meta-{gen}.tmp"
        tmp.write_text(json.dumps({**meta, "gen": gen}))
        os.replace(tmp, d / "meta.json")
        for p in d.glob("*.arrow"):
            if not p.name.endswith(f"-{gen}.arrow"):
                p.unlink(missing_ok=True)
    except (OSError, pa.ArrowException):
        return False
    return True


def in_background(key: Path, work: Callable[[], None]) -> None:
    """``work()`` on a thread of its own, after any work of the same entry (``key``) this process has
    under way, at the lowest CPU priority (``lowest_priority``). Not a daemon thread: a process exits
    only after it (``exit_at_once`` joins it after the answer is written); ``entry_written(key)``
    waits for it."""
    with _SAVING_LOCK:
        before = _SAVING.get(key)

        def run() -> None:
            lowest_priority()
            try:
                if before is not None:
                    before.join()
                work()
            finally:
                with _SAVING_LOCK:
                    if _SAVING.get(key) is t:
                        del _SAVING[key]
        t = threading.Thread(target=run, name="kvledger-entry-save")
        _SAVING[key] = t
        t.start()


def lowest_priority() -> None:
    """Nice 19 for the calling thread (Linux: a thread's id is a PRIO_PROCESS target; elsewhere
    nothing): the kept entries are written for a later reader, and written beside a first dashboard
    page at normal priority they took its cores' time - the page with nothing kept 2.40 -> 2.23 s
    without them (medians of 7, interleaved, 121 M read rows). Still scheduled when the cores are
    busy (not SCHED_IDLE: a busy server's page would wait on an entry that never got a core)."""
    import sys
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def write_entry_later(d: Path, tables: dict[str, pa.Table], meta: dict) -> None:
    """``write_entry`` off the answer's path (``in_background``): grown.py's and evidence.py's kept
    tables, 0.1-0.15 s each of a first build at 121 M read rows, which a dashboard's render or a
    command's answer had waited for. Their loaders call ``entry_written`` first."""
    in_background(d, lambda: write_entry(d, tables, meta))


def entry_written(key: Path) -> None:
    """Return once no write of this entry by this process is under way."""
    with _SAVING_LOCK:
        t = _SAVING.get(key)
    if t is not None:
        t.join()


def file_key(path: str) -> tuple[int, int, int]:
    """How a kept entry knows a segment file again: inode, size, change time (a store replaced at
    the same path, a segment rewritten or touched is another file)."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_ctime_ns

