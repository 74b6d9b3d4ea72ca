"""Helpers for bench scripts: interleaved repeats (A B A B ...) and JSON output."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """Run each variant callable `repeats` times, interleaved, the order rotated each round (no
    variant always runs first, e.g. right after the other's garbage); the median seconds of each."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = variants[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def cpu() -> dict:
    """The CPU a figure was measured on (the machines these benches run on differ between sessions:
    e.g. AVX2-only vs AVX-512 with bf16 instructions, which changes what bf16 costs)."""
    info = {"cores": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and "model" not in info:
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
            break
    return info


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {"bench": name, "python": sys.version.split()[0], "machine": platform.machine(), "cpu": cpu(),
               "unix_time": int(time.time()), **payload}
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def add_results_option(ap: argparse.ArgumentParser, default: str) -> None:
    """--results NAME: the results file's stem under bench/results (another CPU's figures beside
    this one's rather than over them)."""
    ap.add_argument("--results", default=None, metavar="NAME",
                    help=f"results file stem under bench/results (default: {default}); 1-64 of a-z, 0-9 and _")


def results_name(ap: argparse.ArgumentParser, given: "str | None", default: str) -> str:
    """The checked stem (``ap.error`` - exit 2 - on anything but [a-z0-9_]{1,64})."""
    import re
    name = default if given is None else given      # an empty --results is refused, not the default
    if not re.fullmatch(r"[a-z0-9_]{1,64}", name):
        ap.error(f"--results must be 1-64 characters of a-z, 0-9 and _ (a file stem), got {name!r}")
    return name


def count(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi] (else argparse's own error line, exit 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def workload_parser(description: str, repeats: int) -> argparse.ArgumentParser:
    """The shared decode workload's options: --batch, --new-tokens, --repeats."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--batch", type=count(1, 256), default=8,
                    help="sequences decoded together (the tiny Llama workload's prompts; default 8)")
    ap.add_argument("--new-tokens", type=count(1, 4096), default=64, help="tokens generated per sequence (default 64)")
    ap.add_argument("--repeats", type=count(1, 1000), default=repeats,
                    help=f"interleaved rounds per variant, the median kept (default {repeats})")
    return ap


def kernel_bench_args(description: str, results: str) -> argparse.Namespace:
    """A kernel bench's --repeats, --threads and --results (bench/prefill_attention.py,
    decode_attention.py), checked, torch's threads set to them; ``args.results`` the checked stem
    (``results`` where not given)."""
    import torch
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="interleaved runs per variant, the median kept (default 9)")
    ap.add_argument("--threads", type=int, default=2, help="torch and kernel threads (default 2)")
    add_results_option(ap, results)
    args = ap.parse_args()
    if args.repeats < 1 or not 1 <= args.threads <= 1024:
        ap.error(f"--repeats must be >= 1 and --threads in [1, 1024], got {args.repeats} and {args.threads}")
    args.results = results_name(ap, args.results, results)
    torch.set_num_threads(args.threads)
    return args


def tiny_llama_workload(batch: int, seed: int = 0):
    """A tiny Llama (hidden 256, 4 layers) built locally with transformers, and ``batch`` random
    prompts of 16-199 tokens: the workload the engine, guard and telemetry benches share.
    Returns (model, prompts, generator, temp dir)."""
    import tempfile

    import torch

    from engine.models.llama import LlamaModel
    from tests.tiny_models import build_tiny
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    build_tiny("llama", tmp / "tiny", hidden=256, layers=4)
    model = LlamaModel.from_pretrained(tmp / "tiny")
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(16, 200, (batch,), generator=g)]
    return model, [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens], g, tmp
