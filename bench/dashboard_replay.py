"""The dashboard on the quick start's store (one `kvledger replay glm53`): how long until the banner
can be drawn - the store opened and verified, the page's queries run, the protection state and the
totals computed (what `banner` needs) - and the whole page (the script's own footer timing, and the
AppTest run around it), first and warm. Issue 34's goals: banner <= 1 s, page <= 2 s. Medians of 5
warm runs; writes bench/results/dashboard_replay.json."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import count, write  # noqa: E402

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=count(1, 1000), default=5, help="warm runs measured (default 5)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-bench-dash-"))
    os.environ.setdefault("KVLEDGER_STATE_DIR", str(tmp / "state"))
    from engine.replay.glm53 import glm53
    from telemetry.recorder import recording
    store = tmp / "store"
    res = glm53("vulnerable", recorder=recording(store))
    os.environ["KVLEDGER_STORE"] = str(store)
    from tests.streamlit_app import timed_run

    from dashboard.data import VERIFIED, Panels
    from dashboard.serve import preload
    preload()               # as `kvledger dashboard` does while its server starts

    def banner() -> float:
        t = time.perf_counter()
        p = Panels(store)
        p.prefetch()
        p.protection()
        p.totals()
        return time.perf_counter() - t

    def page() -> tuple[float, float]:
        _, took, script = timed_run(APP, 120)
        return took, script

    VERIFIED.clear()
    first_banner = banner()
    first_page, first_script = page()
    banners, pages, scripts = [], [], []
    for _ in range(args.repeats):
        banners.append(banner())
        a, b = page()
        pages.append(a)
        scripts.append(b)
    m = statistics.median
    out = {"config": {"requests": len(res.requests), "rows": sum(res.telemetry["rows"].values()),
                      "segments": res.telemetry["segments"], "repeats": args.repeats},
           "first_banner_s": first_banner, "banner_s": m(banners), "first_page_s": first_page,
           "page_s": m(pages), "first_script_s": first_script, "script_s": m(scripts),
           "goal_banner_s": 1.0, "goal_page_s": 2.0}
    path = write("dashboard_replay", out)
    print(f"dashboard on the quick start's store ({out['config']['rows']:,} rows): banner data {m(banners):.2f} s "
          f"(first {first_banner:.2f} s; goal <= 1 s), whole page {m(pages):.2f} s in AppTest, the script itself "
          f"{m(scripts):.2f} s (first {first_page:.2f} / {first_script:.2f} s; goal <= 2 s)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
