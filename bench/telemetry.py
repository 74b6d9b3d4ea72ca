"""Telemetry cost and ledger ingest, measured side by side in one run.

1. decode tokens/s of the same workload with no recorder, with spans + metrics only, and with
   spans + metrics + the page ledger (all into a real store), interleaved: the cost ratios. Each
   variant's window includes a flush of everything it recorded (written and linked), so no work
   is left outside the measurement (pessimistic for the idle-priority store writer: the work it
   would do in the gaps of the next window is done at the window's end, with the engine waiting).
   Then the ledger variant's telemetry CPU per second of decoding, accounted where it runs: the
   engine thread's recorder calls, the store writer, the OpenTelemetry SDK's threads.
2. ledger ingest, end to end: real StepOutputs captured from a decode-heavy batch are fed through
   the ledger (numpy columns -> bounded queue -> writer thread -> coalesce -> Parquet segment ->
   chain link) as fast as it takes them; rows/s counts per-step read rows plus slot writes.
Writes bench/results/telemetry.json (``--results NAME``: NAME.json).
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import add_results_option, count, results_name, tiny_llama_workload, workload_parser, write  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from telemetry import Telemetry  # noqa: E402
from telemetry.store import FLUSH_INTERVAL  # noqa: E402


def main() -> None:
    ap = workload_parser(__doc__, repeats=16)
    ap.add_argument("--gens-per-round", type=int, default=8,
                    help="generate calls per variant per round (8: 8 x 64 decode steps of 8 sequences, about 1.2 s "
                         "on the Zen 4 machine - less than one 2 s flush interval; 64: about 10 s, the README's "
                         "long-turn run)")
    ap.add_argument("--flush-intervals", default=None,
                    help="comma-separated flush intervals (s) to measure the ledger at (default: the default only)")
    ap.add_argument("--account-gens", type=int, default=40, help="generate calls of the CPU accounting pass")
    ap.add_argument("--calibrate-rounds", type=count(1, 1000), default=12,
                    help="rounds of the priority calibration (the writer's CPU burnt by a Python thread at normal and "
                         "at idle priority, by an idle thread holding no GIL, by one letting the GIL go every 200 us, "
                         "and by an idle process burning Python or streaming memory, vs nothing)")
    ap.add_argument("--calibrate-gens", type=count(1, 100), default=4,
                    help="generate calls in each calibration window (a burner keeps its rate over a window's wall time)")
    ap.add_argument("--ingest-steps", type=count(1, 100_000), default=300,
                    help="decode steps captured and fed through the ledger in the ingest part (default 300)")
    ap.add_argument("--ingest-context", type=count(16, 4092), default=2048,
                    help="prompt tokens of each of the 32 captured decode sequences (default 2048; their engine holds 4096)")
    ap.add_argument("--ingest-repeats", type=int, default=3, help="measured ingest runs (median), after one warm-up")
    add_results_option(ap, "telemetry")
    args = ap.parse_args()
    name = results_name(ap, args.results, "telemetry")
    model, prompts, g, tmp = tiny_llama_workload(args.batch)
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    cfg = lambda: EngineConfig(kv_memory_budget=64 << 20, page_size=16, max_num_seqs=args.batch)  # noqa: E731
    default_interval = FLUSH_INTERVAL
    intervals = sorted({default_interval} | ({float(x) for x in args.flush_intervals.split(",")} if args.flush_intervals else set()))
    tels = {"spans": Telemetry(tmp / "spans", record_ledger=False, model_name="tiny"),
            **{_ledger(fi): Telemetry(tmp / _ledger(fi), model_name="tiny", flush_interval=fi) for fi in intervals}}
    engines = {"off": LLMEngine(model, None, cfg()), **{k: LLMEngine(model, None, cfg(), recorder=t) for k, t in tels.items()}}
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    bg: dict[str, list[float]] = {k: [] for k in engines}     # CPU of the telemetry threads (store writer, OTel SDK)
    names = list(engines)
    for k, e in engines.items():                   # warm-up, untimed: first allocations, first segments
        e.generate(prompts, sp)
        if k in tels:
            tels[k].writer.flush()
    stop_gc_watch = _watch_gc()     # Python's cyclic GC from here to the end of the CPU accounting
    for rep in track(range(args.repeats), description="rounds"):   # interleaved, the order rotated each round
        for k in names[rep % len(names):] + names[:rep % len(names)]:     # (no variant always first)
            e = engines[k]
            b0, c0, t0 = _background_cpu(), time.process_time(), time.perf_counter()
            for _ in range(args.gens_per_round):
                e.generate(prompts, sp)
            if k in tels:        # the window ends when every row the variant caused is written and linked (the
                tels[k].writer.flush()    # flush is charged to it); a round holds the flushes a steady decode would
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            bg[k].append(_background_cpu() - b0)
    # throughput over the whole run (total tokens / total time), not a median: the ledger's cost is
    # lumpy (a flush lands in some stretches and not others), and a median would drop it
    t = {k: statistics.fmean(v) for k, v in wall.items()}
    cpu_s = {k: statistics.fmean(v) for k, v in cpu.items()}
    new_tokens = args.batch * args.new_tokens * args.gens_per_round
    tps = {k: new_tokens / v for k, v in t.items()}
    account = _account(engines[_ledger(default_interval)], tels[_ledger(default_interval)], prompts, sp, args.account_gens,
                       args.batch * args.new_tokens)
    gc_seen = stop_gc_watch()
    calibration = _calibrate(engines["off"], prompts, sp, account["writer_ms_per_s"], args.calibrate_rounds,
                             args.calibrate_gens)
    closed = {k: tel.close() for k, tel in tels.items()}
    ledger = {fi: {"flush_interval_s": fi, "tokens_per_s": tps[_ledger(fi)], "cost": 1 - tps[_ledger(fi)] / tps["off"],
                   "cost_ci95": _bootstrap_cost(wall["off"], wall[_ledger(fi)]),
                   "cost_per_round": [1 - o / s for o, s in zip(wall["off"], wall[_ledger(fi)])],
                   "cpu_cost": cpu_s[_ledger(fi)] / cpu_s["off"] - 1, "segments": closed[_ledger(fi)]["segments"],
                   # the writer's compaction and chain packing, on at their defaults (since the 35th/36th sessions)
                   "merges": tels[_ledger(fi)].writer.compactions, "chain_packs": tels[_ledger(fi)].writer.chain_packs,
                   "background_cpu_ms_per_decode_s": 1e3 * sum(bg[_ledger(fi)]) / sum(wall[_ledger(fi)])}
              for fi in intervals}
    tps["spans_ledger"], cpu_s["spans_ledger"] = tps[_ledger(default_interval)], cpu_s[_ledger(default_interval)]

    # ---- ingest: capture real decode steps of a long-context batch, then replay them into a ledger
    captured = []
    eng = LLMEngine(model, None, EngineConfig(kv_memory_budget=1 << 30, page_size=16, max_num_seqs=32,
                                              max_step_tokens=8192, context_length=4096))
    eng.observers.append(lambda e, out: captured.append(out))
    long = [torch.randint(3, 512, (args.ingest_context,), generator=g).tolist() for _ in range(32)]
    eng.generate(long, SamplingParams(max_tokens=4, ignore_eos=True))
    step = max(captured, key=lambda o: int((o.layout.block_tables >= 0).sum()))   # the step that read most pages
    node = type("Node", (), {})()
    node.cfg, node.pool = eng.cfg, eng.pool
    reads_per_step = int(((step.layout.block_tables >= 0) & (step.read_check.slots_read > 0)).sum())
    writes_per_step = int(step.slot_pages.numel())
    rows_in = args.ingest_steps * (reads_per_step + writes_per_step)
    runs = []
    for rep in range(args.ingest_repeats + 1):          # the first is a warm-up (first allocations, imports)
        tel = Telemetry(tmp / f"ingest{rep}", model_name="tiny", flush_interval=1.0)
        t0 = time.perf_counter()
        for i in range(args.ingest_steps):
            node.steps = node.lclock = i + 1
            tel.ledger.on_step(node, step)
        submitted = time.perf_counter() - t0
        tel.writer.flush()
        total = time.perf_counter() - t0
        stored = dict(tel.writer.rows_written)
        tel.writer.close()
        size = sum(p.stat().st_size for p in (tmp / f"ingest{rep}").rglob("*.parquet"))
        runs.append((total, submitted))
    total = statistics.median(t for t, _ in runs[1:])
    submitted = statistics.median(s for _, s in runs[1:])
    res = {"config": {"model": "tiny llama hidden 256, 4 layers", "batch": args.batch, "new_tokens": args.new_tokens,
                      "repeats": args.repeats, "gens_per_round": args.gens_per_round, "ingest_batch": len(step.batch), "ingest_context": args.ingest_context,
                      "ingest_steps": args.ingest_steps, "ingest_repeats": args.ingest_repeats},
           "tokens_per_s": tps,
           "spans_cost": 1 - tps["spans"] / tps["off"],
           "flush_interval_s": default_interval,
           "spans_ledger_cost": ledger[default_interval]["cost"],
           "spans_ledger_cost_per_round": ledger[default_interval]["cost_per_round"],
           "spans_ledger_cost_ci95": ledger[default_interval]["cost_ci95"],
           "ledger_by_flush_interval": list(ledger.values()),
           "cpu_seconds": cpu_s, "spans_cpu_cost": cpu_s["spans"] / cpu_s["off"] - 1,
           "spans_background_cpu_ms_per_decode_s": 1e3 * sum(bg["spans"]) / sum(wall["spans"]),
           "spans_ledger_cpu_cost": ledger[default_interval]["cpu_cost"],
           "store_rows": {k: c["rows"] for k, c in closed.items()},
           "gc": gc_seen,
           "cpu_accounting": account, "priority_calibration": calibration, "writer_priority": closed[_ledger(default_interval)]["writer_priority"],
           "ledger_waited_s": closed[_ledger(default_interval)]["ledger_waited_s"],
           "ingest": {"rows_in": rows_in, "reads_per_step": reads_per_step, "writes_per_step": writes_per_step,
                      "seconds_engine_side": submitted, "seconds_end_to_end": total,
                      "rows_per_s_end_to_end": rows_in / total, "rows_per_s_engine_side": rows_in / submitted,
                      "cold_rows_per_s_end_to_end": rows_in / runs[0][0],
                      "rows_stored": stored["page_reads"] + stored["page_writes"], "bytes_on_disk": size}}
    out = write(name, res)
    print(f"decode tokens/s: off {tps['off']:.0f}, spans {tps['spans']:.0f} (cost {100 * res['spans_cost']:+.1f} %, "
          f"CPU {100 * res['spans_cpu_cost']:+.1f} %)")
    for fi, r in ledger.items():
        print(f"  spans + ledger, flush every {fi:g} s{' (default)' if fi == default_interval else ''}: "
              f"{r['tokens_per_s']:.0f} (cost {100 * r['cost']:+.1f} %, 95 % interval {100 * r['cost_ci95'][0]:+.1f} to "
              f"{100 * r['cost_ci95'][1]:+.1f} %; CPU {100 * r['cpu_cost']:+.1f} %); telemetry threads "
              f"{r['background_cpu_ms_per_decode_s']:.1f} ms CPU per second of decoding")
    a = account
    print(f"telemetry CPU per second of decoding (spans + metrics + ledger, {a['tokens_per_s']:.0f} tokens/s): "
          f"{a['total_ms_per_s']:.1f} ms = engine thread {a['engine_thread_ms_per_s']:.1f} ("
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(a["engine_thread_by_call_ms_per_s"].items(), key=lambda x: -x[1]))
          + f") + store writer {a['writer_ms_per_s']:.1f} ({a['writer_priority']} priority) + OTel SDK threads "
          f"{a['otel_threads_ms_per_s']:.1f}")
    c = calibration
    gcs = res["gc"]
    print(f"Python's GC over the rounds and the accounting ({'heap frozen by the engine' if gcs['frozen_objects'] else 'heap NOT frozen'}, "
          f"{gcs['frozen_objects']} objects): full collections {gcs['full']}, longest {gcs['longest_full_ms']:.1f} ms; "
          f"all collections {gcs['count']}, {gcs['total_ms']:.0f} ms, longest {gcs['longest_ms']:.1f} ms")
    print(f"{c['burn_ms_per_s']:.1f} ms of CPU a second (the writer's) burnt beside the decode costs it: a Python "
          f"thread {100 * c['normal_cost']:+.1f} % at normal priority, {100 * c['idle_cost']:+.1f} % under SCHED_IDLE; "
          f"under SCHED_IDLE holding no GIL {100 * c['idle_nogil_cost']:+.1f} %, letting the GIL go every "
          f"{c['yield_every_us']:.0f} us {100 * c['idle_yield_cost']:+.1f} %; from a separate process "
          f"{100 * c['idle_process_cost']:+.1f} %, streaming {c['stream_mib']} MiB {100 * c['idle_process_mem_cost']:+.1f} %")
    ing = res["ingest"]
    print(f"ledger ingest end to end: {ing['rows_per_s_end_to_end'] / 1e6:.2f} M rows/s "
          f"({rows_in} rows in {total:.2f} s; engine-side {ing['rows_per_s_engine_side'] / 1e6:.1f} M rows/s); "
          f"{ing['rows_stored']} rows stored after coalescing, {size / 2**20:.1f} MiB")
    print(f"wrote {out}")
    shutil.rmtree(tmp, ignore_errors=True)


HOOKS = ("request_arrived", "step", "pages_released", "pages_held", "pages_moved", "guard_checked", "rejected",
         "request_finished", "transfer_landed")


def _watch_gc():
    """Every collection of Python's cyclic GC from now (gc.callbacks): call the result to stop and get
    how many, how long in all and the longest - full (oldest generation) ones apart: those scan every
    object the heap's freeze (engine/osutil.freeze_heap) did not take out, with the engine stalled
    if its thread set one off."""
    import gc
    seen = {"count": 0, "total_ms": 0.0, "longest_ms": 0.0, "full": 0, "longest_full_ms": 0.0}
    started: dict[int, int] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter_ns()
            return
        ms = (time.perf_counter_ns() - started.pop(threading.get_ident(), time.perf_counter_ns())) / 1e6
        seen["count"] += 1
        seen["total_ms"] += ms
        seen["longest_ms"] = max(seen["longest_ms"], ms)
        if info["generation"] == 2:
            seen["full"] += 1
            seen["longest_full_ms"] = max(seen["longest_full_ms"], ms)
    gc.callbacks.append(on_gc)

    def stop() -> dict:
        gc.callbacks.remove(on_gc)
        return seen | {"frozen_objects": gc.get_freeze_count()}
    return stop


def _account(engine, tel, prompts, sp, gens: int, tokens_per_gen: int) -> dict:
    """The telemetry's CPU per second of decoding, where it runs: the engine thread's time in the
    recorder's calls (each wrapped in a thread-CPU clock, in this pass only), and the CPU of the store
    writer's and the OpenTelemetry SDK's threads (from /proc). Not timed against anything: on cores
    the engine's torch threads fill, what the telemetry costs is about this CPU (the writer's share
    less what it finds idle)."""
    spent = dict.fromkeys(HOOKS, 0)
    for name in HOOKS:
        fn = getattr(tel, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t = time.thread_time_ns()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] += time.thread_time_ns() - t
        setattr(tel, name, timed)              # the instance's attribute: the engine and the request hooks find it
    tel.writer.flush()
    w0, o0, t0 = _thread_cpu("kvledger-store-writer"), _thread_cpu("Otel"), time.perf_counter()
    for _ in track(range(gens), description="CPU accounting"):
        engine.generate(prompts, sp)
    tel.writer.flush()
    wall = time.perf_counter() - t0
    writer, otel = _thread_cpu("kvledger-store-writer") - w0, _thread_cpu("Otel") - o0
    for name in HOOKS:
        delattr(tel, name)
    hooks = {k: 1e3 * v / 1e9 / wall for k, v in spent.items() if v}
    total = sum(hooks.values()) + 1e3 * (writer + otel) / wall
    return {"wall_s": wall, "tokens_per_s": gens * tokens_per_gen / wall, "engine_thread_ms_per_s": sum(hooks.values()),
            "engine_thread_by_call_ms_per_s": hooks, "writer_ms_per_s": 1e3 * writer / wall,
            "otel_threads_ms_per_s": 1e3 * otel / wall, "total_ms_per_s": total,
            "writer_priority": tel.writer.priority}


BURN_SLICE_S = 0.005      # a burner's CPU in slices of 5 ms, each followed by the sleep that keeps its rate

# the separate process's burner (_calibrate): SCHED_IDLE, burning while told "on" (stdin) - pure Python, or
# (a third argument > 0) numpy copies over a buffer of that many bytes, streaming memory as a fold does
_PROCESS_BURNER = """
import os, select, sys, time
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
rate, piece, size = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
if size:
    import numpy as np
    src, dst = np.ones(size // 8), np.empty(size // 8)
    burn = lambda: np.copyto(dst, src)
else:
    burn = lambda: sum(range(200))
on, line, burnt = False, b"", 0.0
while True:
    if select.select([0], [], [], 0 if on else None)[0]:
        chunk = os.read(0, 64)
        if not chunk:
            break
        line += chunk
        while b"\\n" in line:
            cmd, line = line.split(b"\\n", 1)
            if cmd == b"on" and not on:
                t_on, c_on = time.perf_counter(), time.process_time()
            elif cmd != b"on" and on:
                burnt += time.process_time() - c_on
            on = cmd == b"on"
            os.write(1, b"ok %.6f\\n" % burnt)       # the CPU burnt in windows so far (the caller takes differences)
        continue
    ahead = time.process_time() - c_on - rate / 1e3 * (time.perf_counter() - t_on)
    if ahead >= 0:      # until the rate catches up, in waits of at most 10 ms (a command ends one)
        select.select([0], [], [], min(0.01, max(0.0005, ahead * 1e3 / rate)))
        continue
    t = time.process_time()
    while time.process_time() - t < piece and not select.select([0], [], [], 0)[0]:   # a command ends a slice
        burn()
"""
STREAM_BYTES = 32 << 20   # the memory-streaming burner copies an array this big into another: each beyond this
                          # CPU's L2s and as big as the Zen 4's L3 (where the engine's weights and KV pages live)
YIELD_EVERY_S = 200e-6    # the yielding burner lets the GIL go (a 10 us sleep) after this much of its CPU


def _burn_slices(stop, on: threading.Event, ms_per_s: float, burn, burnt: list) -> None:
    """While ``on`` is set: keep this thread's CPU since the window opened at ``ms_per_s`` a second of
    the window's wall time - ``burn()`` in slices of at most BURN_SLICE_S while behind that, a short
    sleep while not (the rate spread over the window, as the writer's work is, not one burst). A burner
    the cores have no room for falls behind and burns whenever it can, as the writer's queue does; it
    stops when the window closes. ``burnt[0]`` adds up the CPU burnt inside windows: the rate a
    burner achieved, which under SCHED_IDLE beside this decode is far below the one asked for."""
    while not stop.is_set():
        if not on.wait(0.1):
            continue
        t_on, c_on = time.perf_counter(), time.thread_time()
        while on.is_set():
            ahead = time.thread_time() - c_on - ms_per_s / 1e3 * (time.perf_counter() - t_on)
            if ahead >= 0:              # until the rate catches up, in waits of at most 10 ms
                time.sleep(min(0.01, max(0.0005, ahead * 1e3 / ms_per_s)))
                continue
            t = time.thread_time()
            while time.thread_time() - t < BURN_SLICE_S and on.is_set():
                burn()
        burnt[0] += time.thread_time() - c_on


def _calibrate(engine, prompts, sp, ms_per_s: float, rounds: int, gens: int = 4) -> dict:
    """What the store writer's CPU costs the decode, and why, with no store in the way: ``ms_per_s``
    of CPU a second burnt beside the decode (kept at that rate over each window, in slices of at most 5 ms) by
    - a pure-Python thread (it holds the GIL, as the writer's Python does) at normal priority and under
      SCHED_IDLE (``normal``, ``idle``);
    - a thread under SCHED_IDLE whose burn holds no GIL (sha256 of 64 KiB blocks: hashlib lets the GIL go),
      the same CPU (``idle_nogil``);
    - a Python thread under SCHED_IDLE that lets the GIL go for 10 us after every YIELD_EVERY_S of its CPU
      (``idle_yield``): whether what costs is holding the GIL at all or holding it long;
    - a separate process under SCHED_IDLE burning pure Python (its own GIL) (``idle_process``), and one
      streaming memory instead (numpy copies over STREAM_BYTES, ``idle_process_mem``): whether a fold's
      memory traffic, moved to a process of its own, would still cost the decode through the caches;
    vs nothing; ``gens`` generate calls a window, rounds interleaved, the order rotated. Each burner's CPU
    in its windows is counted (``{k}_achieved_ms_per_s``): under SCHED_IDLE beside this decode a burner
    gets far less than the rate (the sixty-first session: 5-29 of 38-42 ms a second), and a variant's cost
    is only comparable with another's at the CPU each achieved."""
    import hashlib
    import subprocess
    from telemetry.store.writer import enter_idle_priority
    ms_per_s = max(ms_per_s, 0.1)
    on = {k: threading.Event() for k in ("normal", "idle", "idle_nogil", "idle_yield")}
    burnt = {k: [0.0] for k in (*on, "idle_process", "idle_process_mem")}     # CPU seconds burnt in the windows
    stop = threading.Event()
    block = os.urandom(64 << 10)

    def burner(k: str) -> None:
        if k != "normal":
            enter_idle_priority()
        if k == "idle_nogil":
            burn = lambda: hashlib.sha256(block).digest()          # noqa: E731
        elif k == "idle_yield":
            mark = [time.thread_time()]

            def burn() -> None:
                sum(range(200))
                if time.thread_time() - mark[0] >= YIELD_EVERY_S:
                    time.sleep(10e-6)
                    mark[0] = time.thread_time()
        else:
            burn = lambda: sum(range(200))                          # noqa: E731
        _burn_slices(stop, on[k], ms_per_s, burn, burnt[k])
    threads = [threading.Thread(target=burner, args=(k,), daemon=True) for k in on]
    for t in threads:
        t.start()
    children = {k: subprocess.Popen([sys.executable, "-c", _PROCESS_BURNER, str(ms_per_s), str(BURN_SLICE_S), str(size)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for k, size in (("idle_process", 0), ("idle_process_mem", STREAM_BYTES))}

    def tell(k: str, cmd: bytes) -> float:
        """``cmd`` to a burner process; returns the CPU it had burnt so far."""
        child = children[k]
        child.stdin.write(cmd + b"\n")
        child.stdin.flush()
        answer = child.stdout.readline().split()
        if not answer or answer[0] != b"ok":
            raise RuntimeError("the calibration's burner process did not answer")
        return float(answer[1])
    wall: dict[str, list[float]] = {"off": [], **{k: [] for k in on}, **{k: [] for k in children}}
    names = list(wall)
    try:
        for rep in track(range(rounds), description="priority calibration"):
            for k in names[rep % len(names):] + names[:rep % len(names)]:
                if k in on:
                    on[k].set()
                elif k in children:
                    before = tell(k, b"on")
                t0 = time.perf_counter()
                for _ in range(gens):
                    engine.generate(prompts, sp)
                wall[k].append(time.perf_counter() - t0)
                for ev in on.values():
                    ev.clear()
                if k in children:
                    burnt[k][0] += tell(k, b"off") - before
    finally:
        stop.set()
        for t in threads:
            t.join()
        for child in children.values():
            child.stdin.close()
            child.wait(10)
    off = sum(wall["off"])
    burners = [k for k in names if k != "off"]
    return {"burn_ms_per_s": ms_per_s, "rounds": rounds, "gens_per_window": gens, "slice_ms": 1e3 * BURN_SLICE_S,
            "yield_every_us": 1e6 * YIELD_EVERY_S, "stream_mib": STREAM_BYTES >> 20,
            **{f"{k}_cost": 1 - off / sum(wall[k]) for k in burners},
            **{f"{k}_achieved_ms_per_s": 1e3 * burnt[k][0] / sum(wall[k]) for k in burners},
            **{f"{k}_cost_ci95": _bootstrap_cost(wall["off"], wall[k]) for k in burners}}


def _thread_cpu(prefix: str) -> float:
    """CPU seconds so far of this process's threads whose names start with ``prefix``, from /proc."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            try:
                stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            except OSError:
                continue
            f = stat[stat.rindex(")") + 2:].split()
            total += int(f[11]) + int(f[12])          # utime + stime, clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def _background_cpu() -> float:
    """CPU seconds so far of this process's telemetry threads (the store writer and the OTel SDK's
    export threads), from /proc: the ledger's own work, free of the machine's wall-clock noise."""
    return _thread_cpu("kvledger-store-writer") + _thread_cpu("Otel")


def _ledger(flush_interval: float) -> str:
    return f"spans_ledger_{flush_interval:g}s"


def _bootstrap_cost(off: list[float], on: list[float], n: int = 2000) -> list[float]:
    """95 % interval of the cost (1 - throughput ratio over all rounds), resampling whole rounds:
    how far this run's figure could be from the machine's, given its round-to-round noise."""
    import random
    rng = random.Random(0)
    k = len(off)
    costs = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        costs.append(1 - sum(off[i] for i in idx) / sum(on[i] for i in idx))
    costs.sort()
    return [costs[int(0.025 * n)], costs[int(0.975 * n)]]


if __name__ == "__main__":
    main()
