"""Big stores for the forensics and dashboard benches, made by the engine's own ledger writer.

Two real ``glm53`` replays of the same traffic are recorded with read-run coalescing off (one
page_reads row per reader, page and step, as the engine emits them): ``vulnerable`` (an incident:
every over-pool response reads stale KV) and ``hardened`` (healthy: nobody does). The store is
their ledgers replicated as a fleet's traffic: copy k runs on instance k % INSTANCES (every node
renamed "<node>#i": a fleet of tens of instances, not one per copy) in its own page range (pages
shifted by (k // INSTANCES) * PAGE_STRIDE: copies on one instance never read or write each other's
pages) and shifts every incarnation by k * SHIFT, so copies never join each other; one copy in
``exposed_every`` comes from the
vulnerable replay, the rest from the hardened one (an incident is rare in a fleet's traffic), so
every query's answer is exactly (number of vulnerable copies) x the vulnerable base's answer (the
benches check that). Rows go through SegmentWriter: real chained segments.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from telemetry.recorder import recording
from engine.replay.glm53 import glm53  # noqa: E402
from telemetry.store import SegmentWriter, open_store  # noqa: E402

SHIFT = 1 << 40
INSTANCES = 32              # the fleet's instances (3 nodes each in the disaggregated replay: 96 nodes)
PAGE_STRIDE = 1 << 14       # pages a copy may use on its instance (the replays use a few hundred)
LAYOUT = 3                  # 3: ngrams segments with the outputs in row groups of their own (columns.APART);
                            # 2: before that; 1: a node per copy (88 k nodes at 136 M rows: guards and
                            # preflight then measured the node count, not the ledger)
TABLES = ("page_reads", "page_writes", "exposure_index", "config_snapshots", "spans", "transfers", "ngrams")
ID_COLS = {"page_reads": ["reader"], "page_writes": ["writer"], "spans": ["incarnation"], "transfers": ["incarnation"],
           "ngrams": ["incarnation"], "exposure_index": ["reader", "donor"]}
NODE_COLS = {"page_reads": ["node"], "page_writes": ["node"], "config_snapshots": ["node"], "spans": ["node"],
             "transfers": ["src_node", "dst_node"], "exposure_index": ["node"]}


def _copy(t: pa.Table, table: str, k: int) -> pa.Table:
    for c in ID_COLS.get(table, []):     # (-1: no one - an unwritten slot's donor - stays -1)
        col = pc.if_else(pc.less(t[c], 0), t[c], pc.add(t[c], pa.scalar(k * SHIFT, pa.int64())))
        t = t.set_column(t.schema.get_field_index(c), c, col)
    if table == "page_reads":
        fw = t["found_writers"].combine_chunks()
        vals = pc.if_else(pc.less(fw.values, 0), fw.values, pc.add(fw.values, pa.scalar(k * SHIFT, pa.int64())))
        t = t.set_column(t.schema.get_field_index("found_writers"), "found_writers",
                         pa.ListArray.from_arrays(fw.offsets, vals))
    for c in NODE_COLS.get(table, []):
        t = t.set_column(t.schema.get_field_index(c), c,
                         pc.binary_join_element_wise(t[c], pa.scalar(f"#{k % INSTANCES}"), ""))
    if "page" in t.column_names:
        assert t.num_rows == 0 or pc.max(t["page"]).as_py() < PAGE_STRIDE, "a base replay uses more pages than PAGE_STRIDE"
        shifted = pc.add(t["page"], pa.scalar((k // INSTANCES) * PAGE_STRIDE, t.schema.field("page").type))
        t = t.set_column(t.schema.get_field_index("page"), "page", shifted)
    return t


def _base(root: Path, policy: str, seed: int, coalesce: bool) -> tuple[Path, dict[str, pa.Table]]:
    base = root / f"base-{policy}{'-coalesced' if coalesce else ''}"
    if not (base / "chain").is_dir():
        glm53(policy, "disaggregated", seed=seed, victims=4, max_tokens=160, recorder=recording(str(base), coalesce=coalesce))
    con = open_store(base)
    return base, {t: con.table(t).to_arrow_table() for t in TABLES}


def build(root: Path, rows: int, exposed_every: int = 100, seed: int = 0, coalesce: bool = False,
          count: str = "page_reads") -> dict:
    """Make (or reuse) a store of about `rows` rows (page_reads rows, or with count="ledger" page_reads
    plus page_writes) under root; returns its manifest. coalesce: read runs as the engine stores
    them by default (True) or one row per read step (False)."""
    manifest = root / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("layout") == LAYOUT:
        return json.loads(manifest.read_text())
    if root.exists():                   # an earlier layout's store: made again
        import shutil
        shutil.rmtree(root)
    vbase, vuln = _base(root.parent, "vulnerable", seed, coalesce)
    _, healthy = _base(root.parent, "hardened", seed, coalesce)
    per_copy = healthy["page_reads"].num_rows + (healthy["page_writes"].num_rows if count == "ledger" else 0)
    copies = max(1, -(-rows // per_copy))
    exposed = [k for k in range(copies) if k % exposed_every == 0]
    w = SegmentWriter(root, max_rows=5_000_000)
    per = max(1, 5_000_000 // healthy["page_reads"].num_rows)
    reads = writes = 0
    for k0 in range(0, copies, per):
        ks = range(k0, min(copies, k0 + per))
        for t in TABLES:
            part = pa.concat_tables([_copy((vuln if k % exposed_every == 0 else healthy)[t], t, k) for k in ks])
            reads += part.num_rows if t == "page_reads" else 0
            writes += part.num_rows if t == "page_writes" else 0
            w.submit(t, part)
        w.flush()
        print(f"  copies {ks.stop}/{copies}", flush=True)
    w.close()
    m = {"copies": copies, "exposed_copies": len(exposed), "read_rows": reads, "write_rows": writes,
         "coalesced": coalesce, "base": str(vbase), "layout": LAYOUT, "instances": min(copies, INSTANCES)}
    manifest.write_text(json.dumps(m))
    return m
