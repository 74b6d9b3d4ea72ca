"""What keeping the exposure index costs the engine, measured side by side in one run.

1. The shared tiny-Llama decode workload (bench/_common.py) with the page ledger recording into a
   real store, the exposure index on and off, interleaved rounds (the order rotated): tokens/s of
   each, and the CPU the index's fold took on the store writer's thread (thread CPU clock around
   it) per second of decoding - the cost wherever it lands (the writer runs at idle priority, so
   on a core the engine leaves idle it costs the decode nothing; this is the upper bound).
2. The GLM-5.3 incident replay (disaggregated, vulnerable: every over-pool response reads stale
   KV - the index's worst case, failing reads in every step of the victims) recorded with the
   index on: its CPU against the replay's own CPU, and the index checked against the as-of join.
Writes bench/results/index.json.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import tiny_llama_workload, workload_parser, write  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from telemetry import Telemetry  # noqa: E402


def decode(args) -> dict:
    model, prompts, _, tmp = tiny_llama_workload(args.batch)
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    cfg = lambda: EngineConfig(kv_memory_budget=64 << 20, page_size=16, max_num_seqs=args.batch)  # noqa: E731
    tels = {k: Telemetry(tmp / k, model_name="tiny", exposure_index=k == "index_on") for k in ("index_on", "index_off")}
    engines = {k: LLMEngine(model, None, cfg(), recorder=t) for k, t in tels.items()}
    for k, e in engines.items():                    # warm-up, untimed
        e.generate(prompts, sp)
        tels[k].writer.flush()
    wall: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    led = tels["index_on"].ledger
    cpu0 = led.index_cpu_s
    for rep in range(args.repeats):
        for k in names[rep % 2:] + names[:rep % 2]:
            t0 = time.perf_counter()
            for _ in range(args.gens_per_round):
                engines[k].generate(prompts, sp)
            tels[k].writer.flush()                  # the window holds the flush of what it recorded
            wall[k].append(time.perf_counter() - t0)
    tokens = args.gens_per_round * args.batch * args.new_tokens
    tps = {k: tokens * len(v) / sum(v) for k, v in wall.items()}
    index_cpu = led.index_cpu_s - cpu0
    for t in tels.values():
        t.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"tokens_per_s": tps, "ratio_on_over_off": tps["index_on"] / tps["index_off"],
            "index_cpu_ms_per_decode_s": 1e3 * index_cpu / sum(wall["index_on"]),
            "index_cpu_share_of_decode": index_cpu / sum(wall["index_on"]),
            "rounds": args.repeats, "round_s_median": {k: statistics.median(v) for k, v in wall.items()}}


def incident() -> dict:
    from engine.replay.glm53 import glm53
    from forensics.queries.duckdb import Forensics
    from telemetry.recorder import recording
    store = Path(tempfile.mkdtemp()) / "glm53"
    c0, t0 = time.process_time(), time.perf_counter()
    res = glm53("vulnerable", "disaggregated", seed=0, victims=4, max_tokens=160, recorder=recording(str(store)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    index_cpu = res.telemetry["index_cpu_s"]        # the writer thread's CPU in the index's fold
    fx = Forensics(store)
    chk = fx.verify_index()
    rows = {t: fx.rows(t) for t in ("page_reads", "page_writes", "exposure_index")}
    shutil.rmtree(store.parent, ignore_errors=True)
    return {"replay_cpu_s": cpu, "replay_wall_s": wall, "index_cpu_s": index_cpu,
            "index_share_of_replay_cpu": index_cpu / cpu,
            "index_equals_join": chk.ok, "exposure_slot_rows": chk.join_rows, "rows": rows}


def main() -> None:
    ap = workload_parser(__doc__, repeats=8)
    ap.add_argument("--gens-per-round", type=int, default=4, help="generate calls per variant per round")
    args = ap.parse_args()
    res = {"decode": decode(args), "incident": incident(), "goal_share_of_decode": 0.01}
    out = write("index", res)
    d, i = res["decode"], res["incident"]
    print(f"decode, tiny Llama: index on {d['tokens_per_s']['index_on']:.0f} tok/s vs off "
          f"{d['tokens_per_s']['index_off']:.0f} ({d['ratio_on_over_off']:.3f}x); the index's fold "
          f"{d['index_cpu_ms_per_decode_s']:.2f} ms CPU per second of decoding "
          f"({100 * d['index_cpu_share_of_decode']:.2f} %, goal <= 1 %)")
    print(f"incident replay: the index {i['index_cpu_s']:.2f} s CPU of the replay's {i['replay_cpu_s']:.1f} s "
              f"({100 * i['index_share_of_replay_cpu']:.2f} %); index == join: {i['index_equals_join']} "
              f"({i['exposure_slot_rows']} slot rows; {i['rows']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
