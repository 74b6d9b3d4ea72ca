"""``kvledger verify``: the store's signed chain against its anchor. Exit 0 intact and anchored, 1
naming the first broken link or the truncation, 3 intact but not anchored (no anchor, or one that
holds nothing for this store: a truncation could not be seen) unless ``--no-anchor`` says that is
expected. Needs no secret, writes nothing."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from engine.commands.options import add_store

EXIT_NOT_ANCHORED = 3           # as probe's "inconclusive": nothing wrong was found, and not everything could be


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    store: str
    anchor: str | None = None
    no_anchor: bool = False
    format: str = "text"


def add_arguments(v) -> None:
    add_store(v, "the store")
    v.add_argument("--anchor", default=None, metavar="PATH",
                   help="the anchor log to check against (default: $KVLEDGER_ANCHOR, else "
                        "$KVLEDGER_STATE_DIR/anchors/<store id>.jsonl, used when it exists)")
    v.add_argument("--no-anchor", action="store_true",
                   help="exit 0 for an intact store with no anchor (default: exit 3, since without an anchor a "
                        "deleted tail of history cannot be detected)")
    v.add_argument("--format", choices=["text", "json"], default="text",
                   help="text (default): one line; json: the verdict as one object")


def make_config(a) -> VerifyConfig:
    return VerifyConfig(a.store, a.anchor, a.no_anchor, a.format)


def run(c: VerifyConfig) -> int:
    from telemetry.store import verify

    v = verify(c.store, c.anchor)
    anchored = v.ok and v.anchor_seq is not None
    code = 1 if not v.ok else 0 if anchored or c.no_anchor else EXIT_NOT_ANCHORED
    for w in v.warnings:
        print(f"kvledger: warning: {w}", file=sys.stderr)
    if c.format == "json":
        print(json.dumps({"store": c.store, "ok": v.ok, "anchored": anchored, "broken": v.broken,
                          "segments": v.segments, "rows": v.rows, "head": v.head, "seq": v.seq, "anchor": v.anchor,
                          "anchor_seq": v.anchor_seq, "sealed": v.sealed, "store_id": v.store_id,
                          "fingerprint": v.fingerprint, "warnings": v.warnings, "exit": code}))
    if not v.ok:
        if c.format != "json":
            print(f"kvledger: store {c.store} is BROKEN: {v.broken} (after {v.segments} good segments, "
                  f"{v.rows} rows)", file=sys.stderr)
        return 1
    if c.format != "json":
        where = (f"anchored at seq {v.anchor_seq} in {v.anchor}" if anchored
                 else "NOT anchored (truncation undetectable)")
        print(f"store {c.store}: chain intact and signed (key {v.fingerprint}), {v.segments} segments, {v.rows} rows, "
              f"head {v.head[:16]} at seq {v.seq}; {where}; {'sealed by a clean close' if v.sealed else 'not sealed'}")
        if code == EXIT_NOT_ANCHORED:
            print("kvledger: error: not anchored: nothing shows that no newer history was deleted (give --anchor, "
                  "or --no-anchor when this store is known to have none)", file=sys.stderr)
    return code
