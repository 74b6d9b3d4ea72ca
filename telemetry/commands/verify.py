"""``kvledger verify``: the store's signed chain against its anchor. Exit 1 naming the first
broken link or the truncation; needs no secret, writes nothing."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from engine.commands.options import add_store


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    store: str
    anchor: str | None = None


def add_arguments(v) -> None:
    add_store(v, "the store")
    v.add_argument("--anchor", default=None, metavar="PATH",
                   help="the anchor log to check against (default: $KVLEDGER_ANCHOR, else "
                        "$KVLEDGER_STATE_DIR/anchors/<store id>.jsonl, used when it exists)")


def make_config(a) -> VerifyConfig:
    return VerifyConfig(a.store, a.anchor)


def run(c: VerifyConfig) -> int:
    from telemetry.store import verify

    v = verify(c.store, c.anchor)
    for w in v.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not v.ok:
        print(f"kvledger: store {c.store} is BROKEN: {v.broken} (after {v.segments} good segments, "
              f"{v.rows} rows)", file=sys.stderr)
        return 1
    anchored = (f"anchored at seq {v.anchor_seq} in {v.anchor}" if v.anchor_seq is not None
                else "NOT anchored (truncation undetectable)")
    print(f"store {c.store}: chain intact and signed (key {v.fingerprint}), {v.segments} segments, {v.rows} rows, "
          f"head {v.head[:16]} at seq {v.seq}; {anchored}; {'sealed by a clean close' if v.sealed else 'not sealed'}")
    return 0
