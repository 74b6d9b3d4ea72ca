"""``kvledger tenants resolve``: from tenant pseudonym back to customer, for the key holder only.

The store holds tenants as keyed pseudonyms (HMAC of the name under the store's pseudonym key,
which lives outside the store). Whoever holds that key can map them back by trying candidate
names: a file of names, one per line, or ``serve``'s keys file (its tenant names). Refused without
the key; reads the store, writes nothing (not even a cache)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.commands.options import add_store
from engine.errors import InputError

MAX_NAMES_BYTES = 64 << 20
MAX_NAME = 1024


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    action: str
    store: str
    names: tuple[str, ...]
    format: str = "table"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="resolve (the one action)")
    r = sub.add_parser("resolve", help="map every tenant pseudonym in the store to its name (key holder only)",
                       description="Map every tenant pseudonym in the store to its name, by trying candidate names "
                                   "under the store's pseudonym key. Refused without that key; writes nothing.")
    add_store(r, "the store whose pseudonyms to resolve")
    r.add_argument("--names", required=True, metavar="FILE",
                   help="candidate tenant names, one per line, or the `serve --keys` file (JSON: its tenant names)")
    r.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="table (default), csv or json on stdout")


def read_names(path: str) -> tuple[str, ...]:
    """Candidate names from a list (one per line; blank lines and # comments skipped) or a keys file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--names {path}: no such file")
    if p.stat().st_size > MAX_NAMES_BYTES:
        raise InputError(f"--names {path}: larger than {MAX_NAMES_BYTES >> 20} MiB")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise InputError(f"--names {path}: not UTF-8 text") from None
    if text.lstrip().startswith("{"):
        try:
            keys = json.loads(text)
        except ValueError as e:
            raise InputError(f"--names {path}: starts like a keys file but is not JSON ({e})") from None
        names = [v if isinstance(v, str) else v.get("tenant") if isinstance(v, dict) else None for v in keys.values()]
        if any(not isinstance(n, str) or not n for n in names):
            raise InputError(f"--names {path}: a keys file maps each API key to a tenant name or to "
                             '{"tenant": NAME, ...}')
    else:
        names = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    long = [n for n in names if len(n) > MAX_NAME]
    if long:
        raise InputError(f"--names {path}: a name is longer than {MAX_NAME} characters")
    if not names:
        raise InputError(f"--names {path}: no names in it")
    return tuple(dict.fromkeys(names))


def make_config(a) -> TenantsConfig:
    return TenantsConfig(a.action, a.store, read_names(a.names), a.format)


def resolve(store: str, names: tuple[str, ...]):
    """Every tenant pseudonym the store holds (requests and foreign spans), its requests, and the
    candidate whose pseudonym it is (None: no candidate matched)."""
    import polars as pl

    from forensics.queries import open_forensics
    from telemetry.store.keys import reader_keys
    keys = reader_keys(Path(store))                  # refused here, before the store is read, without the key
    fx = open_forensics(store)
    seen = fx.query("fleet_ttft").select(pl.col("tenant_h")).vstack(fx.requests().select("tenant_h"))
    counts = seen.drop_nulls().group_by("tenant_h").agg(requests=pl.len()).sort("requests", "tenant_h",
                                                                                  descending=[True, False])
    by = {keys.pseudonym(n): n for n in names}
    return counts.with_columns(name=pl.col("tenant_h").replace_strict(by, default=None, return_dtype=pl.String))


def run(c: TenantsConfig) -> int:
    import sys

    import polars as pl

    from forensics.output import emit
    df = resolve(c.store, c.names).rename({"tenant_h": "tenant"}).select("tenant", "name", "requests")
    missing = df.filter(pl.col("name").is_null()).height
    if missing:
        print(f"kvledger: note: {missing} of {df.height} pseudonym(s) matched no candidate name", file=sys.stderr)
    return emit(df, c.format, title=f"kvledger tenants resolve ({c.store})")
