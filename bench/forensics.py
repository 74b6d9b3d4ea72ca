"""The exposure as-of join over ~100 million page_reads rows made by the engine's own ledger
writer (replicated, bench/_bigstore.py), in DuckDB (the shipped exposure_slots query), the same
computation in polars, and ClickHouse (embedded: chdb, the shipped ClickHouse SQL, after
`kvledger export` copied the store into it) beside them, in one run. Every answer is checked
against copies x the base store's answer. Writes bench/results/forensics.json; ``--scale`` also
runs smaller stores (how the cost grows with rows) into its "scaling" list.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._bigstore import build  # noqa: E402
from bench._common import cpu, write  # noqa: E402
from forensics.queries.duckdb import Forensics, sql  # noqa: E402
from telemetry.store import open_store, read_chain  # noqa: E402
from telemetry.store.chain import live_links  # noqa: E402


def duckdb_index(store: Path) -> tuple[int, int]:
    """The same rows from the exposure index the ledger writer kept (exposure_runs_index.sql, as slot rows)."""
    con = open_store(store)
    con.sql(sql("exposure_slots_index")).to_table("exposure_slots")
    rows = con.sql("SELECT count(*), count(DISTINCT (response, donor, node, page)) FROM exposure_slots").fetchall()
    return rows[0]


def duckdb_verify_index(store: Path) -> tuple[int, int]:
    """What `kvledger forensics verify-index` computes (after verifying the store): the as-of join and
    the index materialised and compared slot row for slot row: the join's rows and the index's, or -1
    where they differ."""
    from forensics.queries.duckdb import check_index
    chk = check_index(open_store(store))
    return chk.join_rows, chk.index_rows if chk.ok else -1


COMMANDS = ("exposures", "tenants", "scores")


def commands(store: Path, repeats: int = 3) -> dict:
    """What a user waits for: each of exposures, tenants and scores as a reader answers it (open the
    store, verify it - the verification cache warm - and answer from the index), in this process and
    as the whole command from the shell (`kvledger forensics Q --format json`, the interpreter's start
    included); medians of ``repeats``. Two cases: ``first_*`` - the first command after the store
    changed (the snapshot's shared tables built: requests, exposure_slots, n-gram evidence; measured
    with the answer cache off), and the plain keys - a later command on the same snapshot (its answer,
    and the shared tables where a query runs, read back from the state directory:
    forensics/queries/answers.py)."""
    import os
    import statistics
    import subprocess
    import shutil

    from forensics.queries import evidence, grown
    from forensics.queries.answers import answers_dir
    fx = Forensics(store)                       # verification cache filled, answers kept: as after a first command
    fx.materialise()
    fx.close()
    out: dict = {"in_process_s": {}, "shell_s": {}, "first_in_process_s": {}, "first_shell_s": {},
                 "changed_in_process_s": {}, "changed_shell_s": {}, "rows": {}}
    exe = str(Path(sys.executable).with_name("kvledger"))
    # first: nothing kept anywhere (answer cache off: neither the answers nor the evidence's rows);
    # changed: the store changed since the last command - no answers for this snapshot, the n-gram
    # evidence's rows and the grown tables kept by an earlier command read back
    # (forensics/queries/evidence.py, grown.py; no segment is added, so none is read); kept: a later
    # command on the same snapshot
    for q in COMMANDS:
        for case in ("first", "changed", "kept"):
            pre = "" if case == "kept" else case + "_"
            t = []
            for _ in range(repeats):
                evidence._KEPT.clear()              # each run as a new process would
                grown._KEPT.clear()
                if case == "changed":
                    shutil.rmtree(answers_dir(store), ignore_errors=True)
                t0 = time.perf_counter()
                fx = Forensics(store, answer_cache=case != "first")
                df = fx.query(q)
                t.append(time.perf_counter() - t0)
                assert case == "kept" or not fx.from_cache        # first, changed: no table read back
                fx.close()
            out[pre + "in_process_s"][q], out["rows"][q] = statistics.median(t), df.height
            env = {**os.environ, "KVLEDGER_ANSWER_CACHE": "0" if case == "first" else "1"}
            t = []
            for _ in range(repeats):
                if case == "changed":
                    shutil.rmtree(answers_dir(store), ignore_errors=True)
                t0 = time.perf_counter()
                subprocess.run([exe, "forensics", q, "--store", str(store), "--format", "json"], check=True,
                               capture_output=True, env=env)
                t.append(time.perf_counter() - t0)
            out[pre + "shell_s"][q] = statistics.median(t)
    t0 = time.perf_counter()
    fx = Forensics(store, answer_cache=False)
    out["open_and_verify_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fx.materialise()
    out["materialise_s"] = time.perf_counter() - t0
    fx.close()
    fx = Forensics(store)
    t0 = time.perf_counter()
    fx.materialise()
    out["read_back_s"] = time.perf_counter() - t0
    fx.close()
    return out


def _manifest(store: Path) -> dict:
    """The bench store's manifest, or the error line (no traceback) where no bench store is there."""
    try:
        return json.loads((store / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"forensics bench: error: {store} is not a bench store this script built ({e}); "
                         "build it first with --rows N (without --commands-only / --joins-only)")


def update_commands(path: Path, stores: list[Path]) -> dict:
    """Re-measure only the commands of an earlier run's JSON, on the same stores (the joins and the
    export untouched: the export alone is minutes); says when."""
    res = json.loads(path.read_text())
    res["commands_measured_unix_time"], res["commands_cpu"] = int(time.time()), cpu()
    for store in stores:
        rows = _manifest(store)["read_rows"]
        known = [res["config"]["read_rows"], *(x["read_rows"] for x in res.get("scaling", []))]
        if rows not in known:       # another store (e.g. rebuilt on a new layout): its joins were never measured
            raise SystemExit(f"{store} holds {rows} page_reads rows; {path.name} has figures for {known} only: "
                             "run the bench without --commands-only (or --add-scale) on it")
        c = commands(store)
        if rows == res["config"]["read_rows"]:
            res["commands"] = c
        for x in res.get("scaling", []):
            if x["read_rows"] == rows:
                x["commands"] = c
    return res


def update_joins(path: Path, stores: list[Path], engines: list[str]) -> dict:
    """Re-measure only the as-of join rows (and the index's) of an earlier run's JSON, on the same
    stores, in one run: chdb on the copy an earlier run exported (the export itself, minutes, is not
    re-run; without that copy chdb is left as it was). Says when."""
    res = json.loads(path.read_text())
    res["joins_measured_unix_time"], res["join_rounds"], res["joins_cpu"] = int(time.time()), ROUNDS, cpu()
    fns = {"duckdb": duckdb_join, "polars": polars_join, "chdb": chdb_join, "index": duckdb_index,
           "verify_index": duckdb_verify_index}
    for store in stores:
        m = _manifest(store)
        rows = m["read_rows"]
        entries = ([res] if rows == res["config"]["read_rows"] else []) + [
            x for x in res.get("scaling", []) if x["read_rows"] == rows]
        if not entries:
            raise SystemExit(f"{store} holds {rows} page_reads rows; {path.name} has no figures for it: "
                             "run the bench without --joins-only (or --add-scale) on it")
        base = duckdb_join(Path(m["base"]))
        want = (base[0] * m["exposed_copies"], base[1] * m["exposed_copies"])
        todo = {n: fn for n, fn in fns.items() if n in engines and (n != "chdb" or _chdb_dir(store).exists())}
        for name, (st, ans, sec) in _timed(todo, store, rows).items():
            for x in entries:
                x["seconds"][name] = sec
                x.setdefault("status", {})[name] = st
                x[f"{name}_equals_copies_x_base"] = (tuple(ans) == (want if name != "verify_index" else (want[0],) * 2)
                                                     if ans else False)
    s = res["seconds"]
    for e in ("polars", "chdb", "index"):
        res[f"ratio_{e}_over_duckdb"] = s[e] / s["duckdb"] if s.get("duckdb") and s.get(e) else None
    return res


def duckdb_join(store: Path) -> tuple[int, int]:
    con = open_store(store)          # the join alone: Forensics would verify (hash) every segment first
    con.sql(sql("exposure_slots")).to_table("exposure_slots")     # the shipped as-of join, alone
    rows = con.sql("SELECT count(*), count(DISTINCT (response, donor, node, page)) FROM exposure_slots").fetchall()
    return rows[0]


GROUP = ["node", "reader", "page", "generation", "block_index", "found_generation", "bad_mask"]


def polars_join(store: Path) -> tuple[int, int]:
    """The same computation as exposure_slots.sql, in polars: group failing reads with identical
    findings, cut groups at writes to a failing slot, expand runs to failing slots and the touched
    pages' write runs to slots, as-of join."""
    files = {t: [str(store / c.file) for c in live_links(read_chain(store)) if c.table == t] for t in ("page_reads", "page_writes")}
    f = (pl.scan_parquet(files["page_reads"]).filter(pl.col("bad_mask") != 0)
         .select(*GROUP, "slots_read", "lclock_first").collect())
    g = f.group_by(GROUP).agg(lo=pl.col("lclock_first").min(), hi=pl.col("lclock_first").max())
    wr = (pl.scan_parquet(files["page_writes"]).filter(pl.col("path") != "offload")
          .select("node", "page", "slot_first", "n_slots", "lclock", "writer")
          .join(g.lazy().select("node", "page").unique(), on=["node", "page"], how="semi").collect())
    two = pl.lit(2, pl.Int64)
    cuts = (g.join(wr, on=["node", "page"])
            .filter((pl.col("lclock") > pl.col("lo")) & (pl.col("lclock") <= pl.col("hi"))
                    & ((pl.col("bad_mask") // two.pow(pl.col("slot_first").cast(pl.Int64)))
                       % two.pow(pl.col("n_slots").cast(pl.Int64)) != 0))
            .select(*GROUP, cut=pl.col("lclock")).unique().sort("cut"))
    plain = f.join(cuts, on=GROUP, how="anti").with_columns(epoch=pl.lit(None, pl.Int64))
    with warnings.catch_warnings():     # sorted by the clock above; polars cannot check it within by-groups
        warnings.simplefilter("ignore", UserWarning)
        split = (f.join(cuts.select(GROUP).unique(), on=GROUP, how="semi").sort("lclock_first")
                 .join_asof(cuts, left_on="lclock_first", right_on="cut", by=GROUP, strategy="backward")
                 .rename({"cut": "epoch"}))
    runs = (pl.concat([plain, split], how="diagonal").group_by(*GROUP, "epoch")
            .agg(pl.col("slots_read").max(), pl.col("lclock_first").min()))
    reads = (runs.with_columns(slot=pl.int_ranges(0, pl.col("slots_read").cast(pl.Int64))).explode("slot")
             .filter((pl.col("bad_mask") // two.pow(pl.col("slot"))) % 2 == 1)
             .select("node", "reader", "page", "slot", "lclock_first").sort("lclock_first"))
    writes = (wr.with_columns(slot=pl.int_ranges(pl.col("slot_first").cast(pl.Int64),
                                                 pl.col("slot_first").cast(pl.Int64) + pl.col("n_slots")))
              .explode("slot").select("node", "page", "slot", "lclock", "writer").sort("lclock"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        j = reads.join_asof(writes, left_on="lclock_first", right_on="lclock", by=["node", "page", "slot"],
                            strategy="backward")
    j = j.with_columns(donor=pl.col("writer").fill_null(-1)).filter(pl.col("donor") != pl.col("reader"))
    return j.height, j.select("reader", "donor", "node", "page").unique().height


def _chdb_dir(store: Path) -> Path:
    return store.parent / f"chdb-{store.name}"


def chdb_export(store: Path) -> tuple[int, int]:
    """`kvledger export` of the store into embedded ClickHouse (verify, then every segment not yet
    there): (segments, rows) copied."""
    from telemetry.clickhouse import connect, export
    res = export(store, connect(f"chdb:{_chdb_dir(store)}?db=bench"))
    return res["segments"], res["rows"]


def chdb_join(store: Path) -> tuple[int, int]:
    """The shipped ClickHouse SQL: exposure_g, exposure_x (the as-of join) and exposure_slots,
    materialised (the index not used: exposure_slots is then the join's second half, not the index's rows)."""
    from forensics.queries.clickhouse import ClickHouseForensics
    fx = ClickHouseForensics(engine="clickhouse", dsn=f"chdb:{_chdb_dir(store)}?db=bench", use_index=False)
    fx._ensure("exposure_x")
    fx._ensure("exposure_slots")
    t = fx.target.query_arrow(f"SELECT count() AS n, uniqExact(response, donor, node, page) AS u "
                              f"FROM {fx.uid}_exposure_slots")
    return t.column(0)[0].as_py(), t.column(1)[0].as_py()


ROUNDS = 3      # the joins' timings: medians of this many rounds, the engines interleaved in each


def _timed(fns: dict, store: Path, rows: int, rounds: int = ROUNDS) -> dict:
    """Each engine's join in a child process of its own, the engines in turn, ``rounds`` times (each
    engine's files read as often, and as warm, as the others': one run each had put whichever ran
    after polars - whose memory pushes the other engines' files out of the page cache - far behind,
    chdb 5.3 s alone against 9.3 s there): name -> (status, answer, median seconds)."""
    import statistics
    got: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(_isolated(fn, store))
    out = {}
    for name, runs in got.items():
        ok = [r for r in runs if r[0] == "ok"]
        out[name] = ((ok[0][0], ok[0][1], statistics.median(r[2] for r in ok)) if len(ok) == len(runs)
                     else next(r for r in runs if r[0] != "ok"))
        st, ans, sec = out[name]
        print(f"{rows / 1e6:.0f} M rows, {name}: {st} {sec if sec is None else round(sec, 2)} s {ans} "
              f"({', '.join(f'{r[2]:.2f}' for r in ok)})", flush=True)
    return out


def _isolated(fn, store: Path):
    """Run fn(store) in a forked child: if the kernel kills it for memory, that is the result."""
    import multiprocessing as mp

    def child(q):
        try:
            t = time.perf_counter()
            r = fn(store)
            q.put(("ok", r, time.perf_counter() - t))
        except MemoryError:
            q.put(("oom", None, None))
        except Exception as e:                   # polars raises its own error types on allocation failure
            q.put(("error: " + type(e).__name__ + ": " + str(e)[:200], None, None))

    q = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=child, args=(q,))
    proc.start()
    proc.join()
    return q.get() if not q.empty() else (f"killed (exit {proc.exitcode})", None, None)


def run(rows: int, directory: str, engines: list[str], keep_mirror: bool = False) -> dict:
    root = Path(directory) / f"sparse-{rows}"
    t0 = time.perf_counter()
    m = build(root, rows)
    built = time.perf_counter() - t0
    if not keep_mirror and "chdb" in engines:      # the export is timed from empty, every run
        import shutil
        shutil.rmtree(_chdb_dir(root), ignore_errors=True)
    base_d = duckdb_join(Path(m["base"]))
    k = m["exposed_copies"]
    failing = Forensics(root).con.sql("SELECT count(*), sum(bit_count(bad_mask) * n_reads) FROM page_reads "
                                      "WHERE bad_mask <> 0").fetchall()[0]
    want = (base_d[0] * k, base_d[1] * k)
    fns = {"duckdb": duckdb_join, "polars": polars_join, "chdb_export": chdb_export, "chdb": chdb_join,
           "index": duckdb_index}
    status, seconds, answers = {}, {}, {}
    if "chdb" in engines:               # once, timed from empty: the joins' rounds read its copy
        status["chdb_export"], answers["chdb_export"], seconds["chdb_export"] = _isolated(chdb_export, root)
        print(f"{rows / 1e6:.0f} M rows, chdb_export: {status['chdb_export']} {seconds['chdb_export']} s", flush=True)
    for name, (st, ans, sec) in _timed({e: fns[e] for e in fns if e in engines and e != "chdb_export"},
                                       root, rows).items():
        status[name], seconds[name], answers[name] = st, sec, ans
    return {"config": {"read_rows": m["read_rows"], "write_rows": m["write_rows"], "copies": m["copies"],
                       "exposed_copies": k},
            "status": status, "seconds": seconds,
            "ratio_polars_over_duckdb": (seconds["polars"] / seconds["duckdb"]
                                         if seconds.get("duckdb") and seconds.get("polars") else None),
            "ratio_chdb_over_duckdb": (seconds["chdb"] / seconds["duckdb"]
                                       if seconds.get("duckdb") and seconds.get("chdb") else None),
            "failing_read_rows": failing[0], "failing_slot_reads": int(failing[1]), "exposure_slot_rows": want[0],
            "chdb_export_rows_per_s": (answers["chdb_export"][1] / seconds["chdb_export"]
                                       if answers.get("chdb_export") and answers["chdb_export"][1] else None),
            **{f"{e}_equals_copies_x_base": tuple(answers[e]) == want if answers.get(e) else False
               for e in ("duckdb", "polars", "chdb", "index") if e in answers},
            "ratio_index_over_duckdb": (seconds["index"] / seconds["duckdb"]
                                        if seconds.get("duckdb") and seconds.get("index") else None),
            **({"commands": commands(root)} if "commands" in engines else {}),
            "goal_seconds": 10, "store_build_seconds": built, "join_rounds": ROUNDS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000_000, help="page_reads rows to build (default 100M)")
    ap.add_argument("--dir", default="/tmp/kvledger-bench-store", help="where the big store lives (reused)")
    ap.add_argument("--engines", default="duckdb,polars,chdb,index,commands",
                    help="which to run: duckdb, polars, chdb (the as-of join), index (the same rows from the exposure "
                         "index), commands (exposures/tenants/scores as a reader answers them; default: all)")
    ap.add_argument("--scale", type=int, nargs="*", default=[], metavar="ROWS",
                    help="also run these smaller row counts (DuckDB and chdb) for the growth table")
    ap.add_argument("--keep-mirror", action="store_true",
                    help="reuse embedded ClickHouse's copy of a store (default: export it again, timed)")
    ap.add_argument("--commands-only", action="store_true",
                    help="re-measure only the commands on the existing --rows and --scale stores and update bench/results/forensics.json "
                         "in place (the joins' and the export's figures kept, with when the commands were measured)")
    ap.add_argument("--joins-only", action="store_true",
                    help="re-measure only the as-of joins (--engines: duckdb, polars, chdb on the copy an earlier "
                         "run exported, index, verify_index: the join and the index compared) on the existing --rows and --scale stores and update "
                         "bench/results/forensics.json in place (the export's and the commands' figures kept)")
    ap.add_argument("--add-scale", type=int, metavar="ROWS",
                    help="build (or reuse) a store of ROWS page_reads rows, run --engines on it and add it to the growth "
                         "table of bench/results/forensics.json (the main figures kept)")
    args = ap.parse_args()
    if args.add_scale:
        path = Path(__file__).parent / "results" / "forensics.json"
        r = run(args.add_scale, args.dir, args.engines.split(","), args.keep_mirror)
        res = json.loads(path.read_text())
        entry = {"read_rows": r["config"]["read_rows"], "write_rows": r["config"]["write_rows"], "seconds": r["seconds"],
                 "exposure_slot_rows": r["exposure_slot_rows"], "commands": r.get("commands"),
                 "store_build_seconds": r["store_build_seconds"], "measured_unix_time": int(time.time()),
                 **{k: v for k, v in r.items() if k.endswith("_equals_copies_x_base")}}
        res["scaling"] = sorted([x for x in res.get("scaling", []) if x["read_rows"] != entry["read_rows"]] + [entry],
                                key=lambda x: x["read_rows"])
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"added {entry['read_rows'] / 1e6:.0f} M rows to the growth table: {entry['seconds']}; "
              f"commands {entry['commands']}")
        return
    if args.joins_only:
        path = Path(__file__).parent / "results" / "forensics.json"
        res = update_joins(path, [Path(args.dir) / f"sparse-{n}" for n in [*args.scale, args.rows]],
                           args.engines.split(","))
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"as-of join at {res['config']['read_rows'] / 1e6:.0f} M read rows: "
              + ", ".join(f"{e} {v:.2f} s" for e, v in res["seconds"].items() if v is not None and e != "chdb_export"))
        print(f"wrote {path}")
        return
    if args.commands_only:
        path = Path(__file__).parent / "results" / "forensics.json"
        res = update_commands(path, [Path(args.dir) / f"sparse-{n}" for n in [*args.scale, args.rows]])
        path.write_text(json.dumps(res, indent=2) + "\n")
        c = res["commands"]
        print(", ".join(f"{q}: first {c['first_in_process_s'][q]:.2f} / {c['first_shell_s'][q]:.2f} s, changed "
                        f"{c['changed_in_process_s'][q]:.2f} / {c['changed_shell_s'][q]:.2f} s, kept "
                        f"{c['in_process_s'][q]:.2f} / {c['shell_s'][q]:.2f} s" for q in COMMANDS))
        print(f"wrote {path}")
        return
    res = run(args.rows, args.dir, args.engines.split(","), args.keep_mirror)
    res["scaling"] = [{"read_rows": r["config"]["read_rows"], "write_rows": r["config"]["write_rows"],
                       "seconds": r["seconds"], "exposure_slot_rows": r["exposure_slot_rows"],
                       "commands": r.get("commands")}
                      for r in [run(n, args.dir, ["duckdb", "chdb", "index", "commands"], args.keep_mirror)
                                for n in args.scale]]
    res["scaling"].append({"read_rows": res["config"]["read_rows"], "write_rows": res["config"]["write_rows"],
                           "seconds": res["seconds"], "exposure_slot_rows": res["exposure_slot_rows"],
                           "commands": res.get("commands")})
    out = write("forensics", res)
    sec, st = res["seconds"], res["status"]
    print(f"as-of join over {res['config']['read_rows'] / 1e6:.0f} M read rows x {res['config']['write_rows'] / 1e6:.0f} "
          f"M write rows: " + ", ".join(f"{e} {st[e]} {sec[e]} s" for e in sec)
          + "; answers equal copies x the incident's: "
          + ", ".join(f"{e} {res.get(e + '_equals_copies_x_base')}" for e in ("duckdb", "polars", "chdb", "index")))
    if res.get("commands"):
        c = res["commands"]
        print("commands (from the index; open + verify with a warm cache " f"{c['open_and_verify_s']:.2f} s): "
              + ", ".join(f"{q} {c['in_process_s'][q]:.2f} s in process, {c['shell_s'][q]:.2f} s from the shell"
                          for q in COMMANDS))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
