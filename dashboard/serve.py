"""Start Streamlit on the dashboard with its libraries already imported.

Streamlit runs the app script inside the server process, on the first page load; importing
polars, DuckDB and the forensic layer there, and DuckDB's first Parquet read in a process, cost
about a second on this machine. ``kvledger dashboard`` runs ``python -m dashboard.serve APP
[streamlit options]``, which does both while the server starts, so the first page load does not
pay for them. It also verifies the store once (every segment hashed) into the dashboard's
verification cache, so the first page load only checks what was written since.

Then, on a thread of its own while the server starts and serves, it builds the store's shared
tables - every request from the spans, the exposure slots from the index, the n-gram evidence:
what every page's queries read (``warm``) - into this process's kept rows (``grown.py``,
``evidence.py``), so a page load finds them built and reads only the segments written since,
instead of building them from every segment (at 100 M+ read rows about a second of a first page
on a 2-core machine). A page that loads while they are still being built waits for that build
(each is under its own lock) rather than doing it twice; its early banner does not wait. Where
no page has loaded by then and the store's whole-store answers are kept (it verifies and no
writer holds it: answers.py), it then runs the page's named queries over the whole store too, so
a first page reads their answers back instead of running them.
``KVLEDGER_DASHBOARD_WARM=0`` (``kvledger dashboard --no-warm``) leaves them to the first page.
"""
from __future__ import annotations

import importlib
import sys
import threading

# (pandas' Styler: the tables' red rows, ~0.03 s; the ClickHouse backend's errors, which every page
# load's opening names: ~0.025 s - each on the first page load otherwise)
PRELOAD = ("polars", "dashboard.data", "pandas.io.formats.style", "forensics.queries.clickhouse")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    import tempfile
    from pathlib import Path

    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    from telemetry.store.schema import arrow_schemas
    arrow_schemas()
    with tempfile.TemporaryDirectory() as d:      # DuckDB's first Parquet read sets up its reader
        pq.write_table(pa.table({"x": [1]}), Path(d) / "warm.parquet")
        duckdb.connect().read_parquet([str(Path(d) / "warm.parquet")], union_by_name=True).fetchall()
    map_modules()
    import os

    from dashboard.data import verified
    from telemetry.store import verify
    store = os.environ.get("KVLEDGER_STORE")
    if store and (Path(store) / "chain").is_dir():  # hash the store's segments now, not on the first page load
        cache = verified(store)
        verify(store, cache=cache)
        cache.save()


def map_modules() -> None:
    """Streamlit's first element in a process asks whether it runs in a REPL (``env_util.is_repl``:
    ``inspect.stack()``, which maps the file of every module loaded since its last call - 0.05-0.1 s
    with the ~1,400 modules loaded by then, on the first page load otherwise); inspect keeps the map,
    so mapping them now leaves that call only the modules loaded after."""
    import inspect
    inspect.stack()


WARM = "KVLEDGER_DASHBOARD_WARM"
_stopping = threading.Event()       # set at the process's exit: the warm-up stops after its step in progress
EXIT_WAIT_S = 30.0                  # the longest the exit waits for that step
warmed: dict[str, float | str] = {}         # what the warm-up did: "seconds" (and "answers": the page's queries
                                            # run and kept), or "skipped" / "failed": why


def warm() -> None:
    """Build the store's shared tables in this process (``Forensics.materialise``: requests, the
    exposure slots, the n-gram evidence), kept by grown.py and evidence.py for the page loads - and,
    where no page has loaded yet and the store's answers are kept, run the page's named queries over
    the whole store (their answers kept by answers.py for the first page) - on the
    store, run and anchor the app shows (KVLEDGER_STORE, KVLEDGER_RUN, KVLEDGER_ANCHOR). Skipped where
    KVLEDGER_DASHBOARD_WARM=0, the engine is not the local DuckDB one (ClickHouse keeps no such rows
    here), there is no store yet, or it does not verify (the page says why). It opens the store with a
    verification cache of its own (the one preload saved), not the pages' object. Never raises: the
    page builds what the warm-up did not, and says what is wrong."""
    import os
    import time
    from pathlib import Path
    t0 = time.perf_counter()
    store = os.environ.get("KVLEDGER_STORE")
    if (os.environ.get(WARM, "1") == "0" or os.environ.get("KVLEDGER_ENGINE", "duckdb") != "duckdb"
            or os.environ.get("KVLEDGER_DSN") or not store or not (Path(store) / "chain").is_dir()):
        warmed["skipped"] = "off, another engine or no store"
        return
    try:
        from forensics.queries import open_forensics
        from telemetry.errors import StoreError
        from telemetry.store.chain import HashCache
        try:
            fx = open_forensics(store, os.environ.get("KVLEDGER_RUN") or None, cache=HashCache(store),
                                anchor=os.environ.get("KVLEDGER_ANCHOR") or None)
        except StoreError as e:      # does not verify, no such run: the page names it
            warmed["skipped"] = str(e)
            return
        try:
            fx.request_count()  # requests first, alone: what a page loaded meanwhile waits for to draw its
            if _stopping.is_set():      # early banner (built beside the slots it came 0.3 s later); then the rest
                warmed["skipped"] = "interrupted: the server is stopping"
                return
            fx.materialise()
            # then, where no page has loaded yet and the store's answers are kept (verified, no writer
            # holds it), the page's own named queries over the whole store: a page loaded after
            # this reads them back (answers.py) instead of running them
            from dashboard.data import PAGE, UNORDERED, page_loaded
            if fx.answers is not None and not page_loaded.is_set() and not _stopping.is_set():
                fx.queries(list(PAGE), unordered=UNORDERED)
                warmed["answers"] = len(PAGE)
        finally:
            fx.close()
        warmed["seconds"] = time.perf_counter() - t0
    except Exception as e:          # (only speed is lost: the first page builds them)
        import duckdb
        # the server is stopping (SIGTERM, Ctrl-C): DuckDB interrupted, or the process's exit begun
        # (concurrent.futures then refuses materialise's side-by-side builds) - nothing to say
        if (_stopping.is_set() or isinstance(e, duckdb.InterruptException)
                or (isinstance(e, RuntimeError) and "interpreter shutdown" in str(e))):
            warmed["skipped"] = "interrupted: the server is stopping"
            return
        warmed["failed"] = f"{type(e).__name__}: {e}"
        print(f"kvledger: note: the dashboard did not build the store's tables at its start ({warmed['failed']}); "
              "the first page builds them", file=sys.stderr)


LISTEN_WAIT_S = 60.0        # the longest the warm-up waits for the server to listen before it starts anyway


def _listening(host: str, port: int) -> None:
    """Return once something accepts connections at host:port (the server is up), or after LISTEN_WAIT_S."""
    import socket
    import time
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    end = time.monotonic() + LISTEN_WAIT_S
    while time.monotonic() < end and not _stopping.is_set():     # (a server that failed to start exits)
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            _stopping.wait(0.05)


def start_warm(after: "tuple[str, int] | None" = None) -> threading.Thread:
    """``warm`` on a daemon thread; the thread. ``after``: the server's (host, port) - the warm-up
    starts once the server listens, so the server is up as soon as without it (started beside
    Streamlit's own start, it delayed the server's first answer by 1.3-1.7 s at 121 M read rows).
    At the process's exit the warm-up stops after its step in progress, which the exit waits for (up
    to EXIT_WAIT_S): a thread left inside DuckDB while the interpreter finalizes aborted the process
    (a server stopped 1.2 s after its start: "terminate called ...", exit 250)."""
    import atexit

    def run() -> None:
        if after is not None:
            _listening(*after)
            map_modules()       # (the server's own modules are loaded now)
        if not _stopping.is_set():
            warm()
    t = threading.Thread(target=run, name="kvledger-warm", daemon=True)

    def stop() -> None:
        _stopping.set()
        t.join(EXIT_WAIT_S)
    atexit.register(stop)
    t.start()
    return t


def _address(argv: list[str]) -> tuple[str, int]:
    """The --server.address and --server.port among Streamlit's options (Streamlit's defaults)."""
    def value(name: str, default: str) -> str:
        for i, a in enumerate(argv):
            if a == name and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        return default
    try:
        return value("--server.address", "127.0.0.1"), int(value("--server.port", "8501"))
    except ValueError:
        return "127.0.0.1", 8501


def main(argv: list[str]) -> None:
    preload()
    start_warm(after=_address(argv))
    from streamlit.web import cli
    sys.argv = ["streamlit", "run", *argv]
    sys.exit(cli.main())


if __name__ == "__main__":
    main(sys.argv[1:])
