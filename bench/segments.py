"""How a store's segment count weighs on its readers: the same rows written in many small flushes
(the ledger writer flushes every 2 s, each flush a segment per table) against a few big ones.

The stores hold the same copies of the forensics bench's replays (bench/_bigstore.py: one copy in
100 from the incident's replay), flushed every ``--per-small`` copies (default 1: one flush per
copy, about 3.7 K page_reads rows a segment - a flush of a busy engine) by a writer that merges
nothing and packs no chain files (``many``, as before the thirty-fifth session) and by one that merges
as it writes and packs its chain files (``merged``: the writer's defaults, telemetry/store/writer.py
``COMPACT_FAN`` and ``CHAIN_FAN``, its merged files deleted at once), and every ``--per-big`` copies
(default 1000, ``few``). The writing of the two small-flush
stores is timed (what the merges cost the writer). Each is measured from the shell as a user runs
it, the stores in turn each round, medians of ``--repeats``:

- ``kvledger verify --no-anchor`` (it keeps no cache: every segment hashed; the bench's stores have no anchor);
- ``kvledger forensics exposures --format json`` with nothing kept but the verification cache (a
  state directory holding only what an earlier command's verification left: ``verified/``);
- the same command again on the same snapshot (the kept answer read back).

Writes bench/results/segments.json (``--results NAME``: NAME.json)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import add_results_option, results_name, write  # noqa: E402

WRITE_PER_FLUSH_S = 2.0        # the writer's default flush interval (telemetry.store.FLUSH_INTERVAL)


def build(root: Path, copies: int, per: int, fan: int = 0, chain_fan: int = 0) -> dict:
    """A store of ``copies`` copies flushed every ``per`` by a writer merging ``fan`` segments at a
    time and packing ``chain_fan`` chain files at a time (0: none) - made once, reused where its
    manifest says so."""
    import pyarrow as pa

    import bench._bigstore as B
    from telemetry.store import SegmentWriter
    manifest = root / "manifest.json"
    want = {"copies": copies, "per": per, "layout": B.LAYOUT, "compact_fan": fan, "chain_fan": chain_fan}
    if manifest.exists() and {k: json.loads(manifest.read_text()).get(k, 0 if k.endswith("_fan") else None)
                              for k in want} == want:
        return json.loads(manifest.read_text())
    shutil.rmtree(root, ignore_errors=True)
    _, vuln = B._base(root.parent, "vulnerable", 0, False)
    _, healthy = B._base(root.parent, "hardened", 0, False)
    w = SegmentWriter(root, max_rows=5_000_000, compact_fan=fan, compact_grace=0, chain_fan=chain_fan)
    reads, t0 = 0, time.perf_counter()
    for k0 in range(0, copies, per):
        ks = range(k0, min(copies, k0 + per))
        for t in B.TABLES:
            part = pa.concat_tables([B._copy((vuln if k % 100 == 0 else healthy)[t], t, k) for k in ks])
            reads += part.num_rows if t == "page_reads" else 0
            w.submit(t, part)
        w.flush()
    w.close()
    m = {**want, "read_rows": reads, "flushes": -(-copies // per), "write_s": time.perf_counter() - t0,
         "merges": w.compactions, "files": sum(1 for _ in (root / "segments").rglob("*.parquet")),
         "chain_packs": w.chain_packs, "chain_files": sum(1 for _ in (root / "chain").glob("*.json"))}
    manifest.write_text(json.dumps(m))
    return m


def _run(argv: list[str], state: Path) -> float:
    env = {**os.environ, "KVLEDGER_STATE_DIR": str(state)}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "engine.commands", *argv], env=env, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent)
    took = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[-400:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=2000, help="copies of the replays in each store (default 2000: "
                    "about 7.4 M page_reads rows)")
    ap.add_argument("--per-small", type=int, default=1, help="copies a flush in the many-segments store (default 1)")
    ap.add_argument("--per-big", type=int, default=1000, help="copies a flush in the few-segments store (default 1000)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds measured, the stores in turn (default 3)")
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "kvledger-bench-segments",
                    help="where the stores are made, or reused (default: a folder in the temp directory)")
    add_results_option(ap, "segments")
    args = ap.parse_args()
    name = results_name(ap, args.results, "segments")
    for flag, v in (("--copies", args.copies), ("--per-small", args.per_small), ("--per-big", args.per_big),
                    ("--repeats", args.repeats)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    from telemetry.store.writer import CHAIN_FAN, COMPACT_FAN
    stores = {"many": (args.root / f"many-{args.copies}-{args.per_small}", args.per_small, 0, 0),
              "merged": (args.root / f"merged-{args.copies}-{args.per_small}-{COMPACT_FAN}", args.per_small,
                         COMPACT_FAN, CHAIN_FAN),
              "few": (args.root / f"few-{args.copies}-{args.per_big}", args.per_big, 0, 0)}
    made = {}
    for label, (path, per, fan, chain_fan) in stores.items():
        t = time.perf_counter()
        made[label] = build(path, args.copies, per, fan, chain_fan)
        made[label].setdefault("chain_files", sum(1 for _ in (path / "chain").glob("*.json")))
        print(f"{label}: {made[label]['flushes']} flushes, {made[label]['files']} segment files, "
              f"{made[label]['chain_files']} chain files, "
              f"{made[label]['read_rows']:,} page_reads rows ({time.perf_counter() - t:.0f} s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-bench-segments-"))
    warm = {}
    for label, (path, *_) in stores.items():      # a first command leaves the verification cache (and more)
        warm[label] = tmp / f"warm-{label}"
        _run(["forensics", "exposures", "--format", "json", "--store", str(path)], warm[label])
    times: dict[str, dict[str, list[float]]] = {k: {"verify": [], "first": [], "later": []} for k in stores}
    for rep in range(args.repeats):
        for label, (path, *_) in (list(stores.items())[::1 if rep % 2 == 0 else -1]):
            times[label]["verify"].append(_run(["verify", "--no-anchor", "--store", str(path)], tmp / "none"))
            state = tmp / f"first-{label}-{rep}"
            shutil.copytree(warm[label] / "verified", state / "verified")
            q = ["forensics", "exposures", "--format", "json", "--store", str(path)]
            times[label]["first"].append(_run(q, state))
            times[label]["later"].append(_run(q, state))
            print(f"round {rep + 1}: {label} " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times[label].items()),
                  flush=True)
    med = {label: {k: statistics.median(v) for k, v in t.items()} for label, t in times.items()}
    ratio = {k: med["many"][k] / med["few"][k] for k in med["many"]}
    merged = {k: med["merged"][k] / med["few"][k] for k in med["many"]}
    for k in ratio:
        print(f"{k}: many {med['many'][k]:.2f} s ({ratio[k]:.1f}x), merged {med['merged'][k]:.2f} s ({merged[k]:.1f}x), "
              f"few {med['few'][k]:.2f} s")
    shutil.rmtree(tmp, ignore_errors=True)
    write(name, {"config": {"copies": args.copies, "per_small": args.per_small, "per_big": args.per_big,
                            "repeats": args.repeats, "writer_flush_interval_s": WRITE_PER_FLUSH_S},
                 "stores": made, "seconds": times, "median_s": med, "many_over_few": ratio, "merged_over_few": merged})


if __name__ == "__main__":
    main()
