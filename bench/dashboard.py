"""First render of the dashboard on a store of ~10 million ledger rows (page_reads + page_writes,
read runs coalesced as the engine stores them; bench/_bigstore.py):
the whole script run (open the store, every panel's queries, charts, tables) through Streamlit's
AppTest, first (after the app's libraries are imported, as `kvledger dashboard` does while its
server starts) and warm, beside the bare queries. The AppTest instances share one discovery of the
installed packages' components, as a server's page loads do (tests/streamlit_app.py: before the
forty-first session each render carried 0.25-0.5 s of it). Also a first page load with the
defaults, as an on-call engineer's first look at a store is: a process of its own (the server just
started: the app's libraries imported, components discovered), a state directory holding nothing
but the store's keys and its verification cache (no answer, no grown table, no evidence kept),
the shared tables grown and kept as they are by default - what ``kvledger dashboard`` does the
first time it is pointed at a store - in three ways a round, in turn: requested at once while the
server's warm-up of the shared tables runs (dashboard/serve.py; the real server starts it once it
listens, this bench at once: the harder case), with the warm-up off (``--no-warm``), and requested
after the warm-up finished (with how long it took). Writes bench/results/dashboard.json.
(--live hard-links the store's segments into its copy: a link changes a file's ctime, so a
verification cache of the base store is stale afterwards and the next reader hashes it again.)"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._bigstore import build  # noqa: E402
from bench._common import count, write  # noqa: E402

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000, help="ledger rows of the store (default 10 M)")
    ap.add_argument("--dir", default="/tmp/kvledger-bench-store", help="where the big stores live (reused)")
    ap.add_argument("--sparse", action="store_true",
                    help="the forensics bench's store instead (one page_reads row per read step, --rows page_reads "
                         "rows: bench/forensics.py's sparse-ROWS); default: read runs coalesced as the engine stores them")
    ap.add_argument("--live", action="store_true",
                    help="also a live store: a copy of it (hard links) with a writer open that flushes one more "
                         "healthy copy of the base traffic (new segments, a new chain head) before each render; "
                         "renders with the shared tables grown (the default) and rebuilt, interleaved")
    ap.add_argument("--first-page", type=count(0, 100), default=3, metavar="N",
                    help="rounds of first page loads with the defaults, each in a process of its own with nothing kept "
                         "but the verification cache: the page at the server's start, with the warm-up off, and after "
                         "the warm-up (default 3; 0: none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)     # one such page load
    args = ap.parse_args()
    if args.child:
        return _child()
    if args.sparse:
        root = Path(args.dir) / f"sparse-{args.rows}"
        m = build(root, args.rows)
    else:
        root = Path(args.dir) / f"ledger-coalesced-{args.rows}"
        m = build(root, args.rows, coalesce=True, count="ledger")      # as the engine stores it by default
    os.environ["KVLEDGER_STORE"] = str(root)
    from streamlit.testing.v1 import AppTest

    from tests.streamlit_app import timed_run

    from dashboard.data import Panels
    from dashboard.serve import preload
    preload()               # as `kvledger dashboard` does while its server starts (dashboard/serve.py)
    banners: list[float] = []
    earlies: list[float | None] = []

    def render(n: int) -> tuple[list[float], list[float], "AppTest"]:
        renders, scripts = [], []
        for _ in range(n):
            at, took, script = timed_run(APP, 600)
            renders.append(took)
            scripts.append(script)          # the script's own time
            banners.append(at.session_state["state_line_s"])     # the banner and tiles drawn, in the script
            # the banner said what the exposure index knows before the n-gram evidence was built (None:
            # the evidence was at hand, no early banner)
            earlies.append(at.session_state["early_banner_s"] if "early_banner_s" in at.session_state else None)
        return renders, scripts, at
    # a store that changed since the last render (a live one): the shared tables built every time
    os.environ["KVLEDGER_ANSWER_CACHE"] = "0"
    os.environ["KVLEDGER_GROW"] = "0"       # (nor grown from the last render's in this process: --live does)
    renders, scripts, at = render(3)
    os.environ.pop("KVLEDGER_GROW")
    first_banner, warm_banner = banners[0], min(banners[1:3])
    firsts = _first_pages(root, args.first_page)     # (the renders above left the verification cache)
    # an idle store (after the incident): the shared tables kept by the first render, read back
    os.environ["KVLEDGER_ANSWER_CACHE"] = "1"
    kept, kept_scripts, _ = render(3)
    kept_banner = min(banners[4:6])
    affected = next(int(x.value) for x in at.metric if x.label == "Affected responses")
    t = time.perf_counter()
    Panels(root).totals()
    totals_s = time.perf_counter() - t
    live = _live(root, args, render, banners) if args.live else {}     # (points the app at a copy of the store)
    res = {"config": {"read_rows": m["read_rows"], "write_rows": m["write_rows"], "copies": m["copies"], "exposed_copies": m["exposed_copies"]},
           "first_render_s": renders[0], "warm_render_s": min(renders[1:]), "totals_query_s": totals_s,
           "first_script_s": scripts[0], "warm_script_s": min(scripts[1:]),
           "kept_render_s": min(kept[1:]), "kept_script_s": min(kept_scripts[1:]), "store": root.name,
           "first_banner_s": first_banner, "warm_banner_s": warm_banner, "kept_banner_s": kept_banner,
           "first_early_banner_s": earlies[0], "early_banners": sum(e is not None for e in earlies),
           "goal_banner_s": 1.0,
           "affected_responses_shown": affected, "goal_s": 2.0, **firsts, **live}
    # the README's 136 M-row figures are dashboard_sparse.json; a smaller sparse store's run is kept beside them
    name = "dashboard" if not args.sparse else "dashboard_sparse" if args.rows >= 100_000_000 else \
        f"dashboard_sparse_{args.rows // 1_000_000}m"
    out = write(name, res)
    print(f"dashboard on {(m['read_rows'] + m['write_rows']) / 1e6:.0f} M ledger rows: first render {renders[0]:.2f} s, "
          f"warm {res['warm_render_s']:.2f} s (goal < 2 s; the script itself: first {scripts[0]:.2f} s, warm "
          f"{res['warm_script_s']:.2f} s); an idle store's later renders (shared tables read back) "
          f"{res['kept_render_s']:.2f} s; the banner drawn (in the script) first {first_banner:.2f} s, warm "
          f"{warm_banner:.2f} s, kept {kept_banner:.2f} s; first render's early banner (before the n-gram evidence) "
          f"{'-' if earlies[0] is None else f'{earlies[0]:.2f} s'}; header totals alone {totals_s:.2f} s; "
          f"{affected} affected responses shown")
    if firsts:
        print(f"a first page load with the defaults (a process of its own, nothing kept but the verification "
              f"cache; medians of {len(firsts['first_page_renders_s'])}; the server's warm-up "
              f"{firsts['warm_up_s']:.2f} s):")
        for mode, what in MODES.items():
            pre = "first_page_" if mode == "at_start" else f"first_page_{mode}_"
            print(f"  {what}: render {firsts[pre + 'render_s']:.2f} s, the script {firsts[pre + 'script_s']:.2f} s, "
                  f"the banner {firsts[pre + 'banner_s']:.2f} s (early banner {firsts[pre + 'early_banner_s']:.2f} s)")
    if live:
        print(f"a live store (a writer open, one flush of new traffic before each render): render "
              f"{live['live_render_s']:.2f} s, the script {live['live_script_s']:.2f} s, the banner "
              f"{live['live_banner_s']:.2f} s (medians of {len(live['live_renders_s'])}); interleaved with every "
              f"shared table rebuilt (KVLEDGER_GROW=0): render {live['live_rebuilt_render_s']:.2f} s, the script "
              f"{live['live_rebuilt_script_s']:.2f} s, the banner {live['live_rebuilt_banner_s']:.2f} s")
    print(f"wrote {out}")


MODES = {"at_start": "the shipped default: the warm-up started, the page requested at once",
         "no_warm": "the warm-up off (--no-warm): the page builds the shared tables",
         "warmed": "the page requested after the warm-up finished"}


def _child() -> None:
    """One first page load in this process (``--child``): the server's start (the app's libraries,
    the components' discovery, the store's verification) untimed, then the script run; its times as
    a JSON line. KVLEDGER_BENCH_MODE (MODES): whether the server's warm-up of the shared tables
    (dashboard/serve.py) runs, and whether the page waits for it."""
    import json

    from tests.streamlit_app import timed_run

    from dashboard import serve
    mode = os.environ["KVLEDGER_BENCH_MODE"]
    serve.preload()
    t = serve.start_warm()          # (returns at once where KVLEDGER_DASHBOARD_WARM=0: no_warm)
    if mode == "warmed":
        t.join()
    at, render_s, script_s = timed_run(APP, 600)
    t.join()
    print(json.dumps({"render_s": render_s, "script_s": script_s,
                      "banner_s": at.session_state["state_line_s"],
                      "early_banner_s": at.session_state["early_banner_s"] if "early_banner_s" in at.session_state
                      else None, "warm_s": serve.warmed.get("seconds"), "warm_answers": serve.warmed.get("answers")}))


def _first_pages(root: Path, n: int) -> dict:
    """``n`` rounds of first page loads with the defaults, one of each of MODES a round in turn, each
    in a process of its own with a state directory of its own holding only this one's keys and
    verification cache (copied)."""
    import json
    import shutil
    import statistics
    import subprocess
    import tempfile

    from telemetry.store.keys import state_dir
    if not n:
        return {}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(n):
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="kvledger-bench-first-") as tmp:
                for part in ("keys", "verified"):
                    if (state_dir() / part).is_dir():
                        shutil.copytree(state_dir() / part, Path(tmp) / part)
                env = {k: v for k, v in os.environ.items() if k not in ("KVLEDGER_GROW", "KVLEDGER_ANSWER_CACHE")}
                out = subprocess.run([sys.executable, __file__, "--child"], env=env | {
                    "KVLEDGER_STATE_DIR": tmp, "KVLEDGER_STORE": str(root), "KVLEDGER_BENCH_MODE": mode,
                    "KVLEDGER_DASHBOARD_WARM": "0" if mode == "no_warm" else "1"}, capture_output=True, text=True,
                    check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = statistics.median
    res = {}
    for mode, rs in runs.items():
        pre = "first_page_" if mode == "at_start" else f"first_page_{mode}_"
        res |= {pre + "renders_s": [r["render_s"] for r in rs], pre + "render_s": med(r["render_s"] for r in rs),
                pre + "script_s": med(r["script_s"] for r in rs), pre + "banner_s": med(r["banner_s"] for r in rs),
                pre + "early_banner_s": med(r["early_banner_s"] if r["early_banner_s"] is not None else r["banner_s"]
                                            for r in rs)}
    res["warm_up_s"] = med(r["warm_s"] for r in runs["warmed"])
    # the page's named queries the warm-up ran and kept (no page had loaded yet; dashboard/serve.py)
    res["warm_up_answers"] = min((r.get("warm_answers") or 0) for r in runs["warmed"])
    return res


def _live(root: Path, args, render, banners: list[float]) -> dict:
    """Renders of a live store: a copy of ``root`` (segments hard-linked, never written: a new
    segment is a new file; the chain's files are replaced by rename), its own anchor, a writer open
    on it that flushes one more healthy copy of the base traffic (every table, new incarnations,
    about one replay's worth) before each render - what a dashboard on a serving store sees each
    refresh. One unmeasured render first (the copy's segments are hashed once)."""
    import shutil
    import statistics
    import tempfile

    from bench._bigstore import TABLES, _base, _copy
    from dashboard.serve import preload
    from engine.errors import KvledgerError
    from telemetry.store import SegmentWriter
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-bench-live-"))
    store = tmp / "store"
    shutil.copytree(root, store, copy_function=os.link)
    os.environ["KVLEDGER_STORE"], os.environ["KVLEDGER_ANCHOR"] = str(store), str(tmp / "anchor.jsonl")
    _, healthy = _base(root.parent, "hardened", 0, not args.sparse)
    try:
        w = SegmentWriter(store, anchor=tmp / "anchor.jsonl")
    except KvledgerError as e:         # (the store's writer key not in this state directory)
        shutil.rmtree(tmp, ignore_errors=True)
        os.environ["KVLEDGER_STORE"] = str(root)
        os.environ.pop("KVLEDGER_ANCHOR")
        print(f"bench/dashboard.py: no live store rows: {e}", file=sys.stderr)
        return {}
    runs: dict[str, dict[str, list[float]]] = {v: {"render": [], "script": [], "banner": []} for v in ("1", "0")}
    try:
        preload()
        # interleaved: the shipped default (the snapshot's shared tables grown from the last render's,
        # forensics/queries/grown.py: KVLEDGER_GROW=1) and every table rebuilt (KVLEDGER_GROW=0); a
        # grown render after a rebuilt one reads two flushes' new segments
        for k in range(7):          # the first render unmeasured: the copy's segments are hashed then
            for t in TABLES:
                w.submit(t, _copy(healthy[t], t, 100_000 + k))
            w.flush()                # (the first flush also writes the copy's anchor)
            variant = "1" if k % 2 else "0"
            os.environ["KVLEDGER_GROW"] = variant
            r, sc, _ = render(1)
            if k:
                runs[variant]["render"] += r
                runs[variant]["script"] += sc
                runs[variant]["banner"].append(banners[-1])
    finally:
        os.environ.pop("KVLEDGER_GROW", None)
        w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    grown, rebuilt = runs["1"], runs["0"]
    return {"live_renders_s": grown["render"], "live_render_s": med(grown["render"]),
            "live_script_s": med(grown["script"]), "live_banner_s": med(grown["banner"]),
            "live_rebuilt_renders_s": rebuilt["render"], "live_rebuilt_render_s": med(rebuilt["render"]),
            "live_rebuilt_script_s": med(rebuilt["script"]), "live_rebuilt_banner_s": med(rebuilt["banner"])}


if __name__ == "__main__":
    main()
