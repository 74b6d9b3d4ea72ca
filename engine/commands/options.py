"""Options and checks more than one command shares (pip's ``cmdoptions``): the store, ports, times."""
from __future__ import annotations

import argparse
import datetime as dt
import os
from pathlib import Path

from engine.errors import InputError

DEFAULT_STORE = "./kvledger-store"
STORE_ENV = "KVLEDGER_STORE"        # the default store of every command, as kubectl's KUBECONFIG


def add_store(p: argparse.ArgumentParser, what: str, default: str | None = None) -> None:
    """``--store``: ``default``, else $KVLEDGER_STORE, else ./kvledger-store."""
    default = default or os.environ.get(STORE_ENV) or DEFAULT_STORE
    p.add_argument("--store", default=default, help=f"{what} (default ${STORE_ENV}, else {DEFAULT_STORE}; "
                   f"now {default})")


def check_range(flag: str, value, lo, hi, unit: str = "") -> None:
    """``flag`` lies in [lo, hi], or the InputError that names the limit."""
    if not lo <= value <= hi:
        raise InputError(f"{flag} must be in [{lo}, {hi}]{unit}, got {value}")


def check_port(flag: str, port: int) -> None:
    if not 0 < port < 65536:
        raise InputError(f"{flag} must be in 1..65535, got {port}")


def check_listen(host: str, *ports: tuple[str, int], host_flag: str = "--host") -> None:
    """``host`` resolves and each (flag, port) can be bound on it now (0: any port, not checked),
    found before a store or a process exists; the bind is released at once."""
    import socket
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"{host_flag} {host!r} is not an address this machine can bind ({e.args[-1]})") from None
    family, *_, addr = infos[0]
    for flag, port in ports:
        if not port:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr[0], port))
            except OSError as e:
                raise InputError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); is another "
                                 "server using it?") from None


def check_writable_store(store: str) -> None:
    """Refuse a store that cannot be written at ``store`` (or a writer secret that is malformed),
    found before anything is created."""
    from telemetry.store.keys import KeyError_, check_secret_env
    try:
        check_secret_env()
    except KeyError_ as e:
        raise InputError(str(e)) from None
    p = Path(store).absolute()
    if p.exists() and not p.is_dir():
        raise InputError(f"--store {store} exists and is not a directory")
    up = p
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise InputError(f"--store {store}: {up} is a file, not a directory")
    if not os.access(up, os.W_OK | os.X_OK):
        raise InputError(f"--store {store}: {up} is not writable")


def timestamp(text: str) -> dt.datetime:
    """An ISO 8601 time as naive UTC (a time without a zone is UTC), or one relative to now
    (``now-15m``, ``2h``: forensics.window)."""
    from forensics.window import parse_when
    try:
        return parse_when(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_window(start: dt.datetime | None, end: dt.datetime | None) -> None:
    if start is not None and end is not None and start > end:
        raise InputError(f"--from {start.isoformat()}Z is after --to {end.isoformat()}Z: the window would be empty")
