"""Big stores for the forensics and dashboard benches, made by the engine's own ledger writer.

A real ``glm53`` replay (vulnerable, disaggregated) is recorded with read-run coalescing off (one
page_reads row per reader, page and step, as the engine emits them), then its ledger is
replicated: copy k renames every node to "<node>#k" and shifts every incarnation by k * SHIFT,
so copies never join each other and every query's answer is exactly k times the base answer
(the benches check that). Rows go through SegmentWriter: real chained segments.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.scenarios import glm53  # noqa: E402
from telemetry.store import SegmentWriter, open_store  # noqa: E402

SHIFT = 1 << 40
TABLES = ("page_reads", "page_writes", "config_snapshots", "spans", "transfers", "ngrams")
ID_COLS = {"page_reads": ["reader"], "page_writes": ["writer"], "spans": ["incarnation"], "transfers": ["incarnation"],
           "ngrams": ["incarnation"]}
NODE_COLS = {"page_reads": ["node"], "page_writes": ["node"], "config_snapshots": ["node"], "spans": ["node"],
             "transfers": ["src_node", "dst_node"]}


def _copy(t: pa.Table, table: str, k: int) -> pa.Table:
    for c in ID_COLS.get(table, []):
        t = t.set_column(t.schema.get_field_index(c), c, pc.add(t[c], pa.scalar(k * SHIFT, pa.int64())))
    if table == "page_reads":
        fw = t["found_writers"].combine_chunks()
        vals = pc.if_else(pc.less(fw.values, 0), fw.values, pc.add(fw.values, pa.scalar(k * SHIFT, pa.int64())))
        t = t.set_column(t.schema.get_field_index("found_writers"), "found_writers",
                         pa.ListArray.from_arrays(fw.offsets, vals))
    for c in NODE_COLS.get(table, []):
        t = t.set_column(t.schema.get_field_index(c), c, pc.binary_join_element_wise(t[c], pa.scalar(f"#{k}"), ""))
    return t


def build(root: Path, read_rows: int, seed: int = 0) -> dict:
    """Make (or reuse) a store of about `read_rows` page_reads rows under root; returns its manifest."""
    manifest = root / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text())["read_rows"] >= read_rows:
        return json.loads(manifest.read_text())
    base = root.parent / f"{root.name}-base"
    if not (base / "chain").is_dir():
        glm53("vulnerable", "disaggregated", seed=seed, victims=4, max_tokens=160, store=str(base), coalesce=False)
    con = open_store(base)
    tabs = {t: con.table(t).to_arrow_table() for t in TABLES}
    copies = max(1, -(-read_rows // tabs["page_reads"].num_rows))
    w = SegmentWriter(root, max_rows=5_000_000)
    per = max(1, 5_000_000 // tabs["page_reads"].num_rows)
    for k0 in range(0, copies, per):
        for t, base_t in tabs.items():
            w.submit(t, pa.concat_tables([_copy(base_t, t, k) for k in range(k0, min(copies, k0 + per))]))
        w.flush()
        print(f"  copies {min(copies, k0 + per)}/{copies}", flush=True)
    w.close()
    m = {"copies": copies, "read_rows": copies * tabs["page_reads"].num_rows,
         "write_rows": copies * tabs["page_writes"].num_rows, "base_read_rows": tabs["page_reads"].num_rows,
         "base": str(base)}
    manifest.write_text(json.dumps(m))
    return m
