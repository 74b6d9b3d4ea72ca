"""The store: immutable Parquet segments, chained by a keyed hash, read through DuckDB.

DuckDB allows one writing process and no concurrent reader on one database file, yet the
dashboard reads while the engine writes. So the engine never holds a database file: its
``SegmentWriter`` writes each batch of rows as an immutable Parquet segment (temp file, fsync,
rename), then appends a chain link for it (temp file, rename). Readers open an in-memory DuckDB
over exactly the chained segments, so a reader never sees a half-written file.

    ROOT/segments/<table>/<seq>.parquet     one table's rows, seq global and increasing
    ROOT/chain/<seq>.json                   {seq, table, file, rows, sha256, prev, link}, or a list
                                            of them: the links of one flush, named by the first seq
    ROOT/secret.key                         store secret (or $KVLEDGER_STORE_SECRET)
    ROOT/writer.lock                        one writer at a time (flock)

link = HMAC(chain key, prev link | seq | table | file | rows | sha256(file)): a segment edited,
removed, reordered or inserted breaks the chain at that point (`verify` names it).

Durability: rows reach disk when their table's buffer is flushed - every ``flush_interval``
seconds (default ``FLUSH_INTERVAL``, 2 s), when ``max_rows`` are buffered, and on close. After
``kill -9`` at most the last ``flush_interval`` seconds of rows (plus one segment being written)
are lost; a segment written but not yet linked is reported by ``verify`` as an unlinked tail,
ignored by readers, and linked by the next writer that opens the store (``adopted``). A write
that fails mid-flush leaves what the flush wrote before it linked and its own rows buffered (the
next flush or the close retries them); the producer gets the StoreError.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import KvledgerError
from telemetry.keys import Keys, load_secret
from telemetry.schema import arrow_schemas, conform, empty

GENESIS = "0" * 64
# Seconds between flushes: the durability window after kill -9 and how far behind a live reader
# is. Each flush writes a segment and a chain link per table, a cost that does not shrink with
# fewer rows, so a shorter interval costs decode throughput (bench/telemetry.py measures 1 s and
# 2 s side by side; at 1 s the ledger's threads used about a quarter more CPU).
FLUSH_INTERVAL = 2.0


class StoreError(KvledgerError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


class Coded(NamedTuple):
    """A string column as codes into a few distinct values; becomes Arrow on the writer thread."""
    codes: np.ndarray
    values: list


class Ragged(NamedTuple):
    """A list column of variable length: row i is values[offsets[i]:offsets[i + 1]]."""
    offsets: np.ndarray
    values: np.ndarray


Columns = dict[str, "np.ndarray | Coded | Ragged"]   # 1-D arrays, 2-D arrays (one list per row), Coded strings (2-D: lists), Ragged lists


def _num_rows(data: "pa.Table | Columns") -> int:
    if isinstance(data, pa.Table):
        return data.num_rows
    first = next(iter(data.values()))
    if isinstance(first, Ragged):
        return len(first.offsets) - 1
    return len(first.codes if isinstance(first, Coded) else first)


def concat_columns(batches: list[Columns]) -> Columns:
    """Concatenate column batches (same keys) into one batch, all in numpy (string codes remapped)."""
    out: Columns = {}
    for name in batches[0]:
        parts = [b[name] for b in batches]
        if isinstance(parts[0], Coded):
            uniq: dict = {}
            codes = [np.array([uniq.setdefault(v, len(uniq)) for v in p.values], dtype=np.int32)[p.codes] for p in parts]
            out[name] = Coded(np.concatenate(codes), list(uniq))
        elif isinstance(parts[0], Ragged):
            sizes = [int(p.offsets[-1] - p.offsets[0]) for p in parts]
            base = np.cumsum([0] + sizes[:-1])
            offsets = np.concatenate([np.zeros(1, np.int64)] + [p.offsets[1:] - p.offsets[0] + b for p, b in zip(parts, base)])
            out[name] = Ragged(offsets, np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts]))
        else:
            out[name] = np.concatenate(parts)
    return out


def columns_to_arrow(batches: list[Columns]) -> pa.Table:
    """Concatenate column batches (same keys) into one Arrow table, all in numpy/C++."""
    cols = concat_columns(batches) if len(batches) > 1 else batches[0]
    out = {}
    for name, v in cols.items():
        if isinstance(v, Coded):
            codes = v.codes.astype(np.int32, copy=False)
            arr = pa.DictionaryArray.from_arrays(codes.ravel(), pa.array(v.values, pa.string()))
            if codes.ndim == 2:         # one list of strings per row (e.g. a scope per slot)
                arr = pa.ListArray.from_arrays(np.arange(codes.shape[0] + 1, dtype=np.int32) * codes.shape[1], arr)
            out[name] = arr
        elif isinstance(v, Ragged):
            out[name] = pa.ListArray.from_arrays(v.offsets.astype(np.int32), pa.array(v.values))
        elif (v := np.asarray(v)).ndim == 2:
            offsets = np.arange(v.shape[0] + 1, dtype=np.int32) * v.shape[1]
            out[name] = pa.ListArray.from_arrays(offsets, pa.array(v.ravel()))
        else:
            out[name] = pa.array(v)
    return pa.table(out)


NO_DICTIONARY = {"tag_h", "hash"}      # keyed content hashes: they do not repeat, a dictionary only costs


def _parquet_options(schema: pa.Schema) -> dict:
    """Statistics on scalar columns only (what a reader prunes on: times, clocks, ids; not lists
    of slots), no dictionary for the keyed hashes: every flush writes a segment per table, so its CPU counts."""
    return {"write_statistics": [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_map(f.type)],
            "use_dictionary": [_leaf_path(f) for f in schema if f.name not in NO_DICTIONARY]}


def _leaf_path(f: pa.Field) -> str:
    """The Parquet column path of a field's values ("found_writers.list.element" for a list)."""
    return f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name


class Link(NamedTuple):
    seq: int
    table: str
    file: str
    rows: int
    sha256: str
    prev: str
    link: str

    def payload(self) -> str:
        return f"{self.seq}|{self.table}|{self.file}|{self.rows}|{self.sha256}"


def read_chain(root: Path) -> list[Link]:
    """Every link in seq order; a chain file holds one link, or the links of one flush (a list)."""
    out = []
    for p in sorted((root / "chain").glob("[0-9]*.json")):
        try:
            body = json.loads(p.read_text())
            out += [Link(**e) for e in (body if isinstance(body, list) else [body])]
        except (ValueError, TypeError) as e:
            raise StoreError(f"chain entry {p.name} is unreadable: {e}") from None
    return out


class SegmentWriter:
    """Buffers columnar batches per table and writes chained Parquet segments from one thread.

    ``submit`` puts a batch on a bounded queue and blocks when it is full (back-pressure, never
    loss). Functions given to ``add_drain`` run on the writer thread before every flush and return
    rows to write with it (the page ledger closes its open read runs there).
    """

    def __init__(self, root: str | Path, flush_interval: float = FLUSH_INTERVAL, max_rows: int = 1_000_000,
                 queue_size: int = 256, boot: str | None = None):
        from engine.request import new_boot_id
        self.root = Path(root)
        # the run this writer records: every row of a table with a ``boot`` column that its producer
        # did not label gets it (node names and logical clocks restart with every boot)
        self.boot = boot or new_boot_id()
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"store path {self.root} exists and is not a directory")
        (self.root / "chain").mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreError(f"store {self.root} already has a writer (another engine process holds writer.lock)") from None
        self.keys = Keys(load_secret(self.root))
        chain = read_chain(self.root)
        self._seq = chain[-1].seq + 1 if chain else 0
        self._prev = chain[-1].link if chain else GENESIS
        self._unlinked: list[tuple[int, str, str, int, str | None]] = []   # segments in place, not yet chained
        self.adopted = self._adopt_unlinked_tail()
        self.flush_interval, self.max_rows = flush_interval, max_rows
        self._drains: list[Callable[[], list[tuple[str, Columns]]]] = []
        self.schemas = arrow_schemas()
        self._parquet = {t: _parquet_options(s) for t, s in self.schemas.items()}
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._buf: dict[str, list[pa.Table]] = {t: [] for t in self.schemas}
        self._rows: dict[str, int] = dict.fromkeys(self.schemas, 0)
        self.rows_written: dict[str, int] = dict.fromkeys(self.schemas, 0)
        self.segments_written = 0
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvledger-store-writer", daemon=True)
        self._thread.start()

    def add_drain(self, drain: Callable[[], list[tuple[str, "Columns"]]]) -> None:
        self._drains.append(drain)

    @property
    def closed(self) -> bool:
        return self._closed

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
        if _num_rows(data):
            self._q.put((table, data))

    def submit_lazy(self, build: Callable[[], list[tuple[str, "pa.Table | Columns"]]]) -> None:
        """Queue a function the writer thread calls to build (table, rows) pairs: the engine hands over
        its step's immutable tensors and goes on; the column work happens here, off its path."""
        if self.error is not None:
            raise StoreError(f"store writer failed: {self.error}") from self.error
        self._q.put(("__lazy__", build))

    def flush(self) -> None:
        """Write every buffered row now and wait until it is linked."""
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
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join()
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)

    # ---- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        last = time.monotonic()
        while True:
            timeout = max(0.0, self.flush_interval - (time.monotonic() - last))
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = ("__tick__", None)
            if item is None:
                return
            table, data = item
            try:
                if table == "__flush__":
                    self._write_all()
                    last = time.monotonic()         # everything is written: the next periodic flush is an interval away
                    data.set()
                    continue
                items = data() if table == "__lazy__" else [] if table == "__tick__" else [(table, data)]
                for t, d in items:
                    if _num_rows(d):
                        self._buf[t].append(d)
                        self._rows[t] += _num_rows(d)
                        if self._rows[t] >= self.max_rows:
                            self._unlinked.append(self._write(t))
                            self._link_unlinked()
                if time.monotonic() - last >= self.flush_interval:
                    self._write_all()
                    last = time.monotonic()
            except BaseException as e:        # surfaced to the producer on its next call
                self.error = e
                if table == "__flush__":
                    data.set()

    def _adopt_unlinked_tail(self) -> list[str]:
        """Link segments a killed writer renamed into place but did not link (they are complete:
        rename follows fsync), so a crash loses only rows that never reached a segment."""
        adopted = []
        for p in sorted(self.root.glob("segments/*/[0-9]*.parquet"), key=lambda p: int(p.stem)):
            if int(p.stem) >= self._seq:
                rel = str(p.relative_to(self.root))
                self._unlinked.append((int(p.stem), p.parent.name, rel, pq.ParquetFile(p).metadata.num_rows, None))
                self._seq = int(p.stem) + 1
                adopted.append(rel)
        self._link_unlinked()
        return adopted

    def _link_unlinked(self) -> None:
        """Chain the segments written and not yet linked (seq order), one link each, as one chain
        file named by the first seq (temp file, fsync, rename): a flush's segments cost one chain
        write, not one each. A segment's hash is the one taken as it was written, or read back from
        its file (None). The chain head moves only once the file is in place: if writing it fails,
        the segments stay waiting and the next flush links them."""
        if not self._unlinked:
            return
        links, prev = [], self._prev
        for seq, table, rel, rows, sha in self._unlinked:
            link = Link(seq, table, rel, rows, sha or _sha256(self.root / rel), prev, "")
            link = link._replace(link=self.keys.link(prev, link.payload()))
            links.append(link._asdict())
            prev = link.link
        body = json.dumps(links[0] if len(links) == 1 else links)
        _atomic_write(self.root / "chain" / f"{self._unlinked[0][0]:09d}.json", body.encode())
        self._prev, self._unlinked = prev, []

    def _write_all(self) -> None:
        for drain in self._drains:
            for t, d in drain():
                self._buf[t].append(d)
                self._rows[t] += _num_rows(d)
        try:
            for t in self.schemas:
                if self._rows[t]:
                    self._unlinked.append(self._write(t))
        finally:                                # what was written is linked, even if a later table failed
            self._link_unlinked()

    def _write(self, table: str) -> tuple[int, str, str, int, str]:
        """Write the table's buffered rows as one segment (encoded in memory and hashed there, then
        temp file, fsync, rename); the caller links it."""
        raw = [b for b in self._buf[table] if not isinstance(b, pa.Table)]
        fill = {"boot": self.boot}
        tables = [conform(table, b, fill) for b in self._buf[table] if isinstance(b, pa.Table)]
        if raw:
            tables.append(conform(table, columns_to_arrow(raw), fill))
        data = tables[0] if len(tables) == 1 else pa.concat_tables(tables)     # parts are conformed already
        seq = self._seq
        rel = f"segments/{table}/{seq:09d}.parquet"
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = pa.BufferOutputStream()
        pq.write_table(data, sink, compression="lz4", **self._parquet[table])
        body = sink.getvalue()
        sha = hashlib.sha256(body).hexdigest()
        _atomic_write(path, body)
        self._seq = seq + 1                     # taken only once the segment is in place: no gap on a failed write
        self.rows_written[table] += data.num_rows
        self.segments_written += 1
        self._buf[table], self._rows[table] = [], 0
        return seq, table, rel, data.num_rows, sha


# ---- readers ---------------------------------------------------------------------------------
def open_store(root: str | Path, run: str | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table over the chained segments (read-only use).
    ``run``: a boot id, or a unique prefix of one: every table with a ``boot`` column shows that
    run's rows only (``ngrams`` is keyed by incarnation, unique across runs, and stays whole)."""
    root = Path(root)
    if not (root / "chain").is_dir():
        raise StoreError(f"no kvledger store at {root} (expected {root}/chain); run `kvledger replay` with --store first")
    # big joins spill to disk: keep that out of the caller's working directory
    import tempfile
    con = duckdb.connect(config={"temp_directory": str(Path(tempfile.gettempdir()) / "kvledger-duckdb-spill")})
    by_table: dict[str, list[str]] = {t: [] for t in arrow_schemas()}
    for link in read_chain(root):
        if link.table in by_table and (root / link.file).exists():
            by_table[link.table].append(str(root / link.file))
    schemas = arrow_schemas()
    rels = {}
    for table, files in by_table.items():
        if not files:
            rels[table] = con.from_arrow(empty(table))
            continue
        # Segments written by an older schema lack the columns added since: read by name, and
        # give every column of today's schema (NULL where a segment did not have it), so an old
        # store opens and every query runs on it.
        rel = con.read_parquet(files, union_by_name=True)
        have = set(rel.columns)
        cols = [duckdb.ColumnExpression(f.name) if f.name in have else
                duckdb.ConstantExpression(None).cast(_duck_type(con, table, f.name)).alias(f.name)
                for f in schemas[table]]
        if "boot" in schemas[table].names:      # rows written before runs had ids: one run, ''
            cols[schemas[table].names.index("boot")] = duckdb.CoalesceOperator(
                duckdb.ColumnExpression("boot") if "boot" in have else duckdb.ConstantExpression(None).cast("VARCHAR"),
                duckdb.ConstantExpression("")).alias("boot")
        rels[table] = rel.select(*cols)
    if run is not None:
        boot = resolve_run(rels["config_snapshots"], run)
        for table, rel in rels.items():
            if "boot" in schemas[table].names:
                rels[table] = rel.filter(duckdb.ColumnExpression("boot") == duckdb.ConstantExpression(boot))
    for table, rel in rels.items():
        rel.create_view(table)
    return con


def resolve_run(config_snapshots: duckdb.DuckDBPyRelation, run: str) -> str:
    """The boot id a user named by a unique prefix (as git names commits)."""
    boots = sorted({r[0] for r in config_snapshots.select(duckdb.ColumnExpression("boot")).fetchall()})
    hits = [b for b in boots if b.startswith(run)] if run else [b for b in boots if b == ""]
    if len(hits) == 1:
        return hits[0]
    listed = ", ".join(b or "''" for b in boots[:8]) + (" ..." if len(boots) > 8 else "")
    if not hits:
        raise StoreError(f"--run {run!r}: no run with that boot id in this store (it holds {len(boots)}: {listed}; "
                         "see `kvledger forensics runs`)")
    raise StoreError(f"--run {run!r} is ambiguous: it starts {len(hits)} boot ids ({', '.join(hits[:8])}); "
                     "give more characters")


def _duck_type(con: duckdb.DuckDBPyConnection, table: str, column: str) -> duckdb.typing.DuckDBPyType:
    """The DuckDB type of a schema column (from the empty Arrow table of that schema)."""
    return con.from_arrow(empty(table)).select(duckdb.ColumnExpression(column)).types[0]


class Verdict(NamedTuple):
    ok: bool
    segments: int
    rows: int
    head: str                 # the last good link: the store's digest
    broken: str | None        # the first broken link, named
    warnings: list[str]


def verify(root: str | Path) -> Verdict:
    root = Path(root)
    if not (root / "chain").is_dir():
        raise StoreError(f"no kvledger store at {root}")
    keys = Keys(load_secret(root))
    prev, rows, warnings = GENESIS, 0, []
    chain = read_chain(root)
    for i, link in enumerate(chain):
        where = f"segment {link.seq} ({link.file})"
        problem = None
        if link.seq != (chain[i - 1].seq + 1 if i else 0):
            problem = f"sequence gap: expected {chain[i - 1].seq + 1 if i else 0}, found {link.seq} (a segment was removed)"
        elif link.prev != prev:
            problem = "does not link to the previous segment (reordered or inserted)"
        elif keys.link(prev, link.payload()) != link.link:
            problem = "link hash does not match its entry (the entry was edited)"
        elif not (root / link.file).exists():
            problem = "segment file is missing"
        elif _sha256(root / link.file) != link.sha256:
            problem = "segment content does not match its hash (the file was modified)"
        if problem:
            return Verdict(False, i, rows, prev, f"{where}: {problem}", warnings)
        prev, rows = link.link, rows + link.rows
    linked = {c.file for c in chain}
    last = chain[-1].seq if chain else -1
    for p in sorted(root.glob("segments/*/[0-9]*.parquet")):
        rel = str(p.relative_to(root))
        if rel in linked:
            continue
        if int(p.stem) > last:
            warnings.append(f"{rel}: written but not linked (the writer stopped between segment and link); "
                            "readers ignore it until the next writer links it")
        else:
            return Verdict(False, len(chain), rows, prev, f"{rel}: segment not in the chain (inserted)", warnings)
    return Verdict(True, len(chain), rows, prev, None, warnings)
