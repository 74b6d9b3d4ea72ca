"""Where the store goes: a ClickHouse server (clickhouse-connect, HTTP) or embedded ClickHouse (chdb),
behind one ``Target`` of four operations; ``connect(url)`` parses the address."""
from __future__ import annotations

import datetime as dt
import os
import re
import threading
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow as pa

from telemetry.clickhouse.ddl import ClickHouseError, quote

class Target:
    """Where the store goes: four operations, the same on a server and on embedded ClickHouse."""
    database: str
    url: str

    def command(self, sql: str) -> None: ...
    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None: ...
    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table: ...
    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None: ...
    def close(self) -> None: ...


_chdb_lock = threading.Lock()
_chdb_session = None          # chdb runs one embedded server per process, at one path


def chdb_session(path: str | Path):
    """The process's embedded ClickHouse at ``path`` (created on first use)."""
    global _chdb_session
    path = str(Path(path).expanduser().resolve())
    with _chdb_lock:
        if _chdb_session is None:
            try:
                from chdb import session
            except ImportError as e:
                raise ClickHouseError(f"chdb is not installed ({e}); pip install chdb") from None
            Path(path).mkdir(parents=True, exist_ok=True)
            _chdb_session = (path, session.Session(path))
            threads = os.environ.get("KVLEDGER_CHDB_THREADS")      # e.g. 1 beside other work on a small machine
            if threads:
                _chdb_session[1].query(f"SET max_threads = {int(threads)}")
        elif _chdb_session[0] != path:
            raise ClickHouseError(f"embedded ClickHouse (chdb) is already open at {_chdb_session[0]} in this process; "
                                  f"it runs one data directory per process, so {path} cannot be opened beside it")
        return _chdb_session[1]


def _literal(v) -> str:
    """A query parameter's value as ClickHouse reads it (TSV-escaped text)."""
    if isinstance(v, dt.datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


class ChdbTarget(Target):
    def __init__(self, path: str | Path, database: str = "kvledger"):
        self.path, self.database = Path(path), database
        self.url = f"chdb:{self.path}/{database}"
        self.session = chdb_session(path)
        self.lock = threading.Lock()        # one statement at a time on the embedded server

    def _q(self, sql: str, fmt: str = "CSV", params: dict | None = None, settings: dict | None = None):
        if settings:
            sql = f"{sql}\nSETTINGS " + ", ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {int(v)}"
                                                  for k, v in settings.items())
        with self.lock:
            try:
                return self.session.query(sql, fmt, params={k: _literal(v) for k, v in (params or {}).items()})
            except Exception as e:          # chdb raises a bare RuntimeError with ClickHouse's message
                raise ClickHouseError(f"chdb: {str(e).strip()[:2000]}") from None

    def command(self, sql: str) -> None:
        self._q(sql)

    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None:
        self._q(sql, "CSV", params, settings)

    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table:
        return self._q(sql, "ArrowTable", params, settings)

    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None:
        rows = data      # noqa: F841 - chdb's Python() table function reads the local variable by name
        cols = ", ".join(quote(c) for c in data.column_names)
        self._q(f"INSERT INTO {quote(self.database)}.{quote(table)} ({cols}) SETTINGS insert_deduplication_token = "
                f"'{token}' SELECT {cols} FROM Python(rows)")

    def close(self) -> None:
        pass         # the embedded server lives as long as the process


class ServerTarget(Target):
    """A ClickHouse server over HTTP (clickhouse-connect, Arrow inserts)."""

    def __init__(self, host: str, port: int, database: str, username: str, password: str, secure: bool):
        import logging

        import clickhouse_connect
        logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)   # its errors reach the user as ours
        self.database = database
        self.url = f"clickhouse{'s' if secure else ''}://{host}:{port}/{database}"
        try:
            self.client = clickhouse_connect.get_client(host=host, port=port, username=username, password=password,
                                                        secure=secure, database="default")
        except Exception as e:
            raise ClickHouseError(f"cannot reach ClickHouse at {self.url}: {e}") from None

    def command(self, sql: str) -> None:
        self.command_params(sql, None, None)

    def command_params(self, sql: str, params: dict | None, settings: dict | None) -> None:
        try:
            self.client.command(sql, parameters={k: _literal(v) for k, v in (params or {}).items()} or None,
                                settings=settings)
        except Exception as e:
            raise ClickHouseError(f"{self.url}: {e}") from None

    def query_arrow(self, sql: str, params: dict | None = None, settings: dict | None = None) -> pa.Table:
        try:     # parameters as ClickHouse text (DateTime64(9) keeps its fraction); String columns as strings
            return self.client.query_arrow(sql, parameters={k: _literal(v) for k, v in (params or {}).items()},
                                           settings=settings, use_strings=True)
        except Exception as e:
            raise ClickHouseError(f"{self.url}: {e}") from None

    def insert_arrow(self, table: str, data: pa.Table, token: str) -> None:
        self.client.insert_arrow(f"{self.database}.{table}", data, settings={"insert_deduplication_token": token})

    def close(self) -> None:
        self.client.close()


NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def connect(url: str) -> Target:
    """``clickhouse://[user[:password]@]host[:port]/database`` (HTTP, port 8123; ``clickhouses://``:
    HTTPS, 8443) or ``chdb:PATH[?db=NAME]`` - embedded ClickHouse keeping its data in PATH, database
    NAME (default ``kvledger``)."""
    u = urlparse(url)
    if u.scheme == "chdb":
        path = u.netloc + u.path if u.netloc else u.path
        db = parse_qs(u.query).get("db", ["kvledger"])[0]
        if not path:
            raise ClickHouseError(f"{url!r}: chdb needs a data directory, e.g. chdb:/var/lib/kvledger-chdb")
        if not NAME.match(db):
            raise ClickHouseError(f"{url!r}: database name {db!r} must be letters, digits and _ (at most 64)")
        return ChdbTarget(path, db)
    if u.scheme in ("clickhouse", "clickhouses"):
        db = u.path.strip("/") or "kvledger"
        if not u.hostname:
            raise ClickHouseError(f"{url!r}: no host (expected clickhouse://HOST:8123/DATABASE)")
        if not NAME.match(db):
            raise ClickHouseError(f"{url!r}: database name {db!r} must be letters, digits and _ (at most 64)")
        secure = u.scheme == "clickhouses"
        try:
            port = u.port or (8443 if secure else 8123)
        except ValueError:
            raise ClickHouseError(f"{url!r}: the port must be a number from 1 to 65535") from None
        return ServerTarget(u.hostname, port, db, unquote(u.username or "default"), unquote(u.password or ""), secure)
    raise ClickHouseError(f"{url!r}: expected clickhouse://HOST:8123/DATABASE, clickhouses://... or chdb:PATH")
