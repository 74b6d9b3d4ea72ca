"""Helpers for bench scripts: interleaved repeats (A B A B ...) and JSON output."""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """Run each variant callable `repeats` times, interleaved; return the median seconds of each."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {"bench": name, "python": sys.version.split()[0], "machine": platform.machine(),
               "unix_time": int(time.time()), **payload}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out
