"""Regenerate the README's figures from bench/results/*.json (between <!-- bench --> markers)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _isa(c: dict | None) -> str:
    return ("not recorded" if not c else "AVX-512 with bf16 instructions and AMX tiles" if "amx_bf16" in c["isa"]
            else "AVX-512 with bf16 instructions" if "avx512_bf16" in c["isa"]
            else "AVX-512" if "avx512f" in c["isa"] else "AVX2, no AVX-512")


def _measured(w: dict) -> str:
    """Which CPU and day each workload's row was measured on (a subset run keeps the others' rows,
    and the sessions' machines differ: AVX2-only or AVX-512 with bf16 instructions)."""
    import time as _t
    parts = []
    for name, x in w.items():
        isa = _isa(x.get("cpu"))
        day = _t.strftime("%Y-%m-%d", _t.gmtime(x["unix_time"])) if "unix_time" in x else "?"
        parts.append(f"{name} {day} (CPU {isa})")
    return "Rows measured: " + "; ".join(parts) + "."


def engine_table(r: dict) -> str:
    w = r["workloads"]
    desc = {"tiny": "tiny Llama (hidden {hidden}, {layers} layers, GQA {heads}:{kv_heads})",
            "big": "Qwen2 shape (hidden {hidden}, {layers} layers, GQA {heads}:{kv_heads}, intermediate {intermediate})",
            "long": "tiny Llama, long prompts"}
    rows = ["| workload | batch x prompt tokens, new tokens | kvledger vs transformers tokens/s | ratio "
            "| vLLM-CPU tokens/s | kvledger vs vLLM |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, x in w.items():
        c, t = x["config"], x["tokens_per_s"]
        vl = (f"{t['vllm']:.0f} ({x['vllm_same_greedy_outputs']}/{c['batch']} greedy outputs equal) | "
              f"**{x['ratio_kvledger_vs_vllm']:.2f}x**") if "vllm" in t else "not measured | "
        rows.append(f"| {name}: {desc[name].format(**c)} | {c['batch']} x {min(c['prompt_lens'])}-{max(c['prompt_lens'])}, "
                    f"{c['new_tokens']} | {t['kvledger']:.0f} vs {t['transformers']:.0f} | "
                    f"**{x['ratio_kvledger_vs_transformers']:.2f}x** | {vl} |")
    for name, x in w.items():
        t = x["tokens_per_s"]
        if "read_check_cost" in x:
            rows.append(f"| {name}: read check on vs off | | {t['kvledger']:.0f} vs {t['check_off']:.0f} | "
                        f"cost {100 * x['read_check_cost']:+.1f} % | | |")
        if "read_check_share_of_run" in x:
            rows.append(f"| {name}: read check timed alone on the run's layouts | "
                        f"{1e6 * x['read_check_seconds_per_step']:.0f} us per step | | "
                        f"{100 * x['read_check_share_of_run']:.1f} % of the run | | |")
        if "ratio_native_vs_torch_decode" in x:
            rows.append(f"| {name}: native decode kernel vs torch's gather + bmm | | {t['kvledger']:.0f} vs "
                        f"{t['torch_decode']:.0f} | **{x['ratio_native_vs_torch_decode']:.2f}x** | | |")
        if "ledger_cost" in x:
            vl = (f"{t['with_ledger']:.0f} vs {t['vllm']:.0f} | **{x['ratio_with_ledger_vs_vllm']:.2f}x**"
                  if "ratio_with_ledger_vs_vllm" in x else " | ")
            rows.append(f"| {name}: telemetry on (spans, metrics, page ledger into a store) vs off | | {t['with_ledger']:.0f} vs "
                        f"{t['kvledger']:.0f} | cost {100 * x['ledger_cost']:+.1f} % | {vl} |")
        if "zero_on_free_cost" in x:
            rows.append(f"| {name}: `zero_on_free` on vs off | | {t['zero_on_free']:.0f} vs {t['kvledger']:.0f} | "
                        f"cost {100 * x['zero_on_free_cost']:+.1f} % | | |")
    reps = {x["config"]["repeats"] for x in w.values()}
    prof = [f"{name}: " + ", ".join(f"`{p['op'].removeprefix('aten::')}` {100 * p['share']:.0f} %" for p in x["profile"][:6])
            for name, x in w.items() if "profile" in x]
    vllm = next((x["vllm_version"] for x in w.values() if "vllm_version" in x), None)
    proj = [f"{name} ({next(iter(x['decode_projections'].values()))['rows']} rows): " + ", ".join(
        f"{k} {v['n']}x{v['k']} {v['onednn_us']:.0f} vs {v['kernel_us']:.0f} us"
        + (" (oneDNN used)" if v.get("engine_uses") == "onednn" else "") for k, v in x["decode_projections"].items())
        for name, x in w.items() if x.get("decode_projections")]
    tail = ([] if not proj else [
        "", "A decode step's projections, one call each, oneDNN (weight prepacked) vs the native few-rows kernel "
        "(median of interleaved calls; the engine runs the kernel except where it says oneDNN: "
        "`engine.models.llama.few_rows`; since the thirty-third session, for a weight of more than 2 M values, whichever of "
        "the two it timed faster when it loaded the weight, `kernel_decodes_faster`; the marks are the choice of the engine "
        "that measured the table): " + "; ".join(proj) + "."]) + ([] if vllm is None else [
        "", f"vLLM-CPU {vllm} (the interop tier's venv), each workload in its own process, prefix caching off, "
        "token ids in, fp32 like the others, one warm-up run, then interleaved with kvledger and transformers run "
        "by run (bench/vllm_worker.py)." + _budget(w)]) + ([] if not prof else [
        "", "Where kvledger's CPU time goes (torch profiler, self time of the top torch ops, one run; the native "
        "kernels of engine/kernels are ctypes calls, not torch ops, and are not in these shares): " + "; ".join(prof) + "."])
    return "\n".join([
        f"Greedy decoding, median of {'/'.join(map(str, sorted(reps)))} interleaved runs per variant, "
        f"{r.get('threads', 2)} torch thread(s) for every engine, on this 2-core CPU machine "
        "(`transformers` with its `sdpa` attention, left-padded batch):",
        "", *rows, "", _measured(w), *tail])


def _budget(w: dict) -> str:
    """The per-step token budget the rows ran with (both engines), where the JSON records it."""
    b = {x["config"].get("step_tokens") for x in w.values()}
    if b == {None}:
        return " Per-step token budget: kvledger's default 512, vLLM-CPU's own default (4096)."
    per = ", ".join(f"{k} {x['config'].get('step_tokens', 512)}" for k, x in w.items())
    return (f" Per-step token budget of both engines (kvledger's max_step_tokens, vLLM's max_num_batched_tokens; "
            f"4096 is vLLM-CPU's default for its LLM class): {per}.")


def _tps(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def engine_bf16_table(r: dict) -> str:
    w = r["workloads"]
    rows = ["| workload | kvledger bf16 vs its fp32 tokens/s | ratio | transformers bf16 | kvledger vs transformers "
            "| vLLM-CPU bf16 | kvledger vs vLLM |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, x in w.items():
        c, t = x["config"], x["tokens_per_s"]
        vl = (f"{_tps(t['vllm'])} | **{x['ratio_kvledger_vs_vllm']:.2f}x**") if "vllm" in t else "not measured | "
        rows.append(f"| {name} ({c['batch']} x {min(c['prompt_lens'])}-{max(c['prompt_lens'])}, {c['new_tokens']} new) | "
                    f"{_tps(t['kvledger'])} vs {_tps(t['fp32'])} | {x['ratio_bf16_vs_fp32']:.2f}x | {_tps(t['transformers'])} | "
                    f"**{x['ratio_kvledger_vs_transformers']:.2f}x** | {vl} |")
    native = "; ".join(f"{name} {x['ratio_native_vs_torch_decode']:.2f}x" for name, x in w.items())
    div = "; ".join(f"{name} {x['vllm_same_greedy_outputs']}/{x['config']['batch']} equal, first divergence at token "
                    f"{x['vllm_first_divergence']}" for name, x in w.items() if "vllm_first_divergence" in x)
    reps = {x["config"]["repeats"] for x in w.values()}
    return "\n".join([
        f"bf16, median of {'/'.join(map(str, sorted(reps)))} interleaved runs per variant, {r.get('threads', 2)} torch "
        "thread(s) for every engine (kvledger: weights and KV stored in bf16; where the CPU has bf16 instructions "
        "the products in bf16 through oneDNN - all of them on weights of 2^19 values or more, a smaller weight's "
        "decode rows in fp32 - elsewhere all arithmetic fp32; transformers and vLLM-CPU: their own bf16 models):",
        "", *rows, "",
        f"The native kernels on the bf16 pool and weights vs torch's ops on the same values: {native}. Greedy outputs "
        f"against vLLM's bf16 (both round to bf16, at different points - decode attention, norms and activations "
        f"are fp32 in kvledger - so they drift apart): {div}." + _budget(w) + " "
        + _measured(w)])


def guards_table(r: dict) -> str:
    t, c, cpu = r["tokens_per_s"], r["config"], r["cpu_seconds"]
    return "\n".join([
        f"Every hardened guard on vs every guard off, same workload ({c['batch']} prompts of "
        f"{min(c['prompt_lens'])}-{max(c['prompt_lens'])} tokens, {c['new_tokens']} new tokens, {c['nodes']}, "
        f"median of {c['repeats']} interleaved runs; same tokens in both: {r['same_tokens']}):",
        "",
        "| measurement | hardened vs vulnerable | cost | goal |",
        "| --- | --- | --- | --- |",
        f"| cluster tokens/s (wall time) | {t['hardened']:.0f} vs {t['vulnerable']:.0f} | {100 * r['guard_cost']:+.1f} % "
        f"| <= {100 * r['goal_cost']:.0f} % |",
        f"| CPU seconds of the process (all threads) | {cpu['hardened']:.2f} vs {cpu['vulnerable']:.2f} "
        f"| {100 * r['guard_cost_cpu']:+.1f} % | |",
        "",
        "Run-to-run noise on this shared machine is several percent, larger than the goal: read the two "
        "rows together, not either one alone.",
    ])


def telemetry_table(r: dict) -> str:
    t, c, i = r["tokens_per_s"], r["config"], r["ingest"]
    by_interval = r.get("ledger_by_flush_interval", [])
    default = r.get("flush_interval_s", 1.0)
    rows = [f"| decode tokens/s, no recorder vs spans + metrics + page ledger, flush every {x['flush_interval_s']:g} s"
            f"{' (the default)' if x['flush_interval_s'] == default else ''} | {t['off']:.0f} vs {x['tokens_per_s']:.0f} "
            f"(cost {100 * x['cost']:+.1f} %; 95 % interval over rounds {100 * x['cost_ci95'][0]:+.1f} to "
            f"{100 * x['cost_ci95'][1]:+.1f} %; CPU {100 * x['cpu_cost']:+.1f} %"
            + (f"; telemetry threads {x['background_cpu_ms_per_decode_s']:.0f} ms of CPU per second of decoding"
               if "background_cpu_ms_per_decode_s" in x else "")
            + (f"; the writer merging segments and packing chain files at its defaults: {x['merges']} merges, "
               f"{x['chain_packs']} packs of {x['segments']} segments' files" if "merges" in x else "") + ") | "
            f"{'<= 3 %' if x['flush_interval_s'] == default else ''} |" for x in by_interval] or [
        f"| decode tokens/s, no recorder vs spans + metrics + page ledger | {t['off']:.0f} vs {t['spans_ledger']:.0f} "
        f"(cost {100 * r['spans_ledger_cost']:+.1f} %) | <= 3 % |"]
    return "\n".join([
        f"Telemetry (`bench/results/{r.get('bench', 'telemetry')}.json`, a CPU with {_isa(r.get('cpu'))}), same workload as above "
        f"({c['batch']} prompts, {c['new_tokens']} new tokens), "
        f"{c['repeats']} rounds of the variants back to back, their order rotated each round. A variant's turn is "
        f"{c.get('gens_per_round', 1)} generate calls and ends when everything it recorded is "
        f"written and linked, so no ledger work falls outside its window (pessimistic for the idle-priority writer: "
        f"what it would do in the next window's gaps is done with the engine waiting); throughput is total tokens over total time "
        f"(the ledger's cost is lumpy - a flush lands in some stretches and not others - and a median would leave it "
        f"out). Ledger ingest runs end to end from real captured steps ({c['ingest_batch']} requests of "
        f"{c['ingest_context']} tokens, {c['ingest_steps']} steps):",
        "",
        "| measurement | value | goal |",
        "| --- | --- | --- |",
        f"| decode tokens/s, no recorder vs spans + metrics | {t['off']:.0f} vs {t['spans']:.0f} "
        f"(cost {100 * r['spans_cost']:+.1f} %) | |",
        *rows,
        f"| ledger ingest, end to end (engine -> Parquet segment linked; rows as the engine emits them: a read per "
        f"reader, page and step plus a write per slot; median of {c.get('ingest_repeats', 1)} after a warm-up) | "
        f"{i['rows_per_s_end_to_end'] / 1e6:.2f} M rows/s (cold first run "
        f"{i.get('cold_rows_per_s_end_to_end', i['rows_per_s_end_to_end']) / 1e6:.2f}) | >= 5 M rows/s |",
        f"| ledger, engine-thread side only | {i['rows_per_s_engine_side'] / 1e6:.1f} M rows/s | |",
        f"| rows stored (read runs coalesced, write runs) | {i['rows_stored']} of {i['rows_in']} | |",
        "",
        *_accounting(r),
        f"Per round the ledger's cost at the default interval spreads from "
        f"{100 * _q(r['spans_ledger_cost_per_round'], 0.25):+.0f} % to "
        f"{100 * _q(r['spans_ledger_cost_per_round'], 0.75):+.0f} % (quartiles)"
        + (": this shared machine's noise is larger than the goal"
           if _q(r['spans_ledger_cost_per_round'], 0.75) - _q(r['spans_ledger_cost_per_round'], 0.25) > 0.03 else
           ": the whole interquartile range is above the goal")
        + f", and whole runs of this bench differ by a few percent. Each flush writes a segment and a chain "
        f"link per table whatever its size, so a shorter interval costs more (`--flush-intervals 1,2` measures both); "
        f"it is also the durability window after `kill -9` and how far a live reader lags."
        if "spans_ledger_cost_per_round" in r else "",
    ])


def _accounting(r: dict) -> list[str]:
    """The CPU accounting and the priority calibration (bench/telemetry.py), when the run has them."""
    a, c = r.get("cpu_accounting"), r.get("priority_calibration")
    if not a or not c:
        return []
    calls = ", ".join(f"`{k}` {v:.1f}" for k, v in sorted(a["engine_thread_by_call_ms_per_s"].items(), key=lambda x: -x[1]))
    return [
        f"Where the telemetry's CPU goes (spans + metrics + ledger, {a['tokens_per_s']:.0f} tokens/s): "
        f"**{a['total_ms_per_s']:.1f} ms of CPU per second of decoding** - the engine thread's recorder calls "
        f"{a['engine_thread_ms_per_s']:.1f} ({calls}), the store writer {a['writer_ms_per_s']:.1f} (under "
        f"{'SCHED_IDLE' if a['writer_priority'] == 'idle' else 'normal priority'}), the OpenTelemetry SDK's threads "
        f"{a['otel_threads_ms_per_s']:.1f}. The engine thread's share is on the decode's path; on these two cores, "
        "which torch's threads fill, CPU taken by another thread at normal priority costs the decode about the same "
        f"share. Calibration in the same run: the writer's {c['burn_ms_per_s']:.1f} ms of CPU a second burnt beside the "
        f"decode{_slices(c)} by a pure-Python thread (it holds the GIL, as the writer's Python does) cost the decode "
        f"{_ci(c, 'normal')} at normal priority and {_ci(c, 'idle')} under SCHED_IDLE"
        + (f"; the same CPU under SCHED_IDLE by a thread that holds no GIL while it burns (sha256 of 64 KiB blocks) "
           f"{_ci(c, 'idle_nogil')}, and by a separate process (pure Python, its own GIL) {_ci(c, 'idle_process')}"
           + _yield_and_stream(c) + f" ({c['rounds']} rounds). " + _gil_reading(c)
           if "idle_process_cost" in c else f" ({c['rounds']} rounds).")
        + " The writer runs under SCHED_IDLE so that it takes the gaps between the engine's steps first. "
        "The page ledger makes the engine wait only if "
        "the writer falls "
        f"more than MAX_WAITING_CELLS behind (it waited {r.get('ledger_waited_s', 0):.2f} s in this run).",
        "",
        *_gc(r),
    ]


def _ci(c: dict, k: str) -> str:
    """A calibration variant's cost with its 95 % interval (and the CPU its burner achieved, where the
    run counted it)."""
    lo, hi = c[f"{k}_cost_ci95"]
    got = f", burning {c[f'{k}_achieved_ms_per_s']:.1f} ms a second" if f"{k}_achieved_ms_per_s" in c else ""
    return f"{100 * c[f'{k}_cost']:+.1f} % ({100 * lo:+.1f} to {100 * hi:+.1f} %{got})"


STARVED = 0.8      # a burner that achieved less than this share of the rate is not the writer's CPU


def _gil_reading(c: dict) -> str:
    """What the calibration says about the writer's cost, as far as its intervals separate - and
    nothing where the idle burners did not burn the writer's CPU (a run that counted it)."""
    if "idle_process_achieved_ms_per_s" in c:
        rate = c["burn_ms_per_s"]
        starved = [k for k in ("idle", "idle_nogil", "idle_yield", "idle_process", "idle_process_mem")
                   if f"{k}_achieved_ms_per_s" in c and c[f"{k}_achieved_ms_per_s"] < STARVED * rate]
        if starved:
            got = ", ".join(f"{k} {c[f'{k}_achieved_ms_per_s']:.1f}" for k in starved)
            return (f"Under SCHED_IDLE the burners did not burn the writer's {rate:.1f} ms a second ({got} ms a second "
                    "in their windows): the cores these decodes leave idle are a small part of that, so the idle "
                    "variants' costs are those of less CPU and say nothing of the GIL's share. The writer is not "
                    "starved that way (its work waits in its queue, an overdue flush is raised to normal priority, "
                    "the ledger's windows above end with a flush), so the normal-priority burner, which did burn "
                    "the rate, is the closer price of the writer's CPU; a process of its own would take that CPU "
                    "from the same two cores (not measured): the 3 % goal needs less telemetry CPU.")
        return ("Under SCHED_IDLE the burners burnt at least "
                f"{100 * STARVED:.0f} % of the rate asked: their costs compare with the normal-priority burner's.")
    return ("This run did not count the CPU each burner achieved; under SCHED_IDLE beside this decode they burn far "
            "less than asked (the sixty-first session's runs: 5-29 of 38-42 ms a second), so its idle variants' costs "
            "say nothing of the GIL's share, and the reading earlier sessions drew from them (the writer's CPU about "
            "free in a process of its own) is withdrawn.")


def _yield_and_stream(c: dict) -> str:
    """The calibration's two later variants (the fifty-ninth session), when the run has them."""
    if "idle_yield_cost" not in c:
        return ""
    return (f"; by a Python thread under SCHED_IDLE that lets the GIL go for 10 us after every "
            f"{c['yield_every_us']:.0f} us of its CPU {_ci(c, 'idle_yield')}, and by a separate process streaming "
            f"memory (numpy copies over {c['stream_mib']} MiB) {_ci(c, 'idle_process_mem')}")


def _slices(c: dict) -> str:
    if "gens_per_window" in c:
        return (f" (kept at that rate over each window of {c['gens_per_window']} generate calls, in slices of at "
                f"most {c['slice_ms']:.0f} ms)")
    return f" (in {c['slice_ms']:.0f} ms slices at that rate)" if "slice_ms" in c else ""


def _gc(r: dict) -> list[str]:
    """Python's cyclic GC over the run's rounds and accounting (bench/telemetry.py), when it has it."""
    g = r.get("gc")
    if not g:
        return []
    frozen = (f"the heap frozen once the engines were built, {g['frozen_objects']:,} objects: "
              "engine/osutil.freeze_heap, as vLLM's engine does" if g["frozen_objects"] else "the heap not frozen")
    off = _load(f"{r.get('bench', 'telemetry')}_gc_off")    # the same bench run with KVLEDGER_GC_FREEZE=0
    text = (f"Python's garbage collector over the rounds and the accounting ({frozen}): {g['full']} full "
            f"collections, the longest {g['longest_full_ms']:.1f} ms; {g['count']} collections in all, "
            f"{g['total_ms']:.0f} ms, the longest {g['longest_ms']:.1f} ms. A full collection scans every object "
            "not frozen, on whichever thread set it off - the engine's included, every running request stalled.")
    if off and off.get("gc") and not off["gc"]["frozen_objects"]:
        go, lo = off["gc"], off["spans_ledger_cost_ci95"]
        text += (f" The same bench with KVLEDGER_GC_FREEZE=0 (`bench/results/telemetry_gc_off.json`, run in the "
                 f"same hour): {go['full']} full collection(s), the longest {go['longest_full_ms']:.0f} ms; "
                 f"{go['count']} in all, {go['total_ms']:.0f} ms; spans + ledger cost "
                 f"{100 * off['spans_ledger_cost']:+.1f} % ({100 * lo[0]:+.1f} to {100 * lo[1]:+.1f} %), the writer "
                 f"{off['cpu_accounting']['writer_ms_per_s']:.1f} ms of CPU a second in its accounting pass "
                 f"({r['cpu_accounting']['writer_ms_per_s']:.1f} with the heap frozen).")
    return [text, ""]


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def forensics_table(r: dict) -> str:
    c, sec, st = r["config"], r["seconds"], r["status"]
    fmt = lambda k: f"{sec[k]:.1f} s" if sec[k] is not None else st[k]  # noqa: E731
    return "\n".join([
        f"The exposure as-of join (`exposure_slots`) over {c['read_rows'] / 1e6:.0f} M page_reads rows and "
        f"{c['write_rows'] / 1e6:.0f} M page_writes rows made by the ledger writer (one row per read step, "
        f"replicated: {c['exposed_copies']} of {c['copies']} copies are the incident"
        f"{', the rest healthy traffic' if c['exposed_copies'] < c['copies'] else ''}), "
        f"{r['failing_read_rows'] / 1e6:.1f} M failing read rows ({r['failing_slot_reads'] / 1e6:.1f} M failing slot "
        f"reads) to attribute, on this 2-core machine{_when(r, 'joins')}"
        f"{f' (medians of {rounds} rounds, the engines in turn in each)' if (rounds := r.get('join_rounds')) else ''}"
        f". Failing read rows with identical findings are merged into runs, "
        f"cut only where a write changed a failing slot, and only the touched pages' write runs are expanded to "
        f"slots: {r['exposure_slot_rows'] / 1e3:.0f} K (run, failing slot) rows reach the as-of join.",
        "",
        "| engine | time | answer = copies x incident |",
        "| --- | --- | --- |",
        f"| DuckDB (the shipped SQL) | {fmt('duckdb')} | {r['duckdb_equals_copies_x_base']} |",
        f"| polars (same computation, `join_asof`) | {fmt('polars')} | {r['polars_equals_copies_x_base']} |",
        *([f"| ClickHouse, embedded (chdb; the shipped ClickHouse SQL) | {fmt('chdb')} | "
           f"{r.get('chdb_equals_copies_x_base')} |"] if "chdb" in sec else []),
        *([f"| the same rows from the exposure index the ledger writer kept (DuckDB, "
           f"`exposure_runs_index.sql` read as slot rows; what readers use) | {fmt('index')} | {r.get('index_equals_copies_x_base')} |"]
          if "index" in sec else []),
        *([f"| `kvledger forensics verify-index`'s work: the join and the index materialised and compared slot row for "
           f"slot row (DuckDB) | {fmt('verify_index')} | {r.get('verify_index_equals_copies_x_base')} |"]
          if sec.get("verify_index") else []),
        f"| goal | <= {r['goal_seconds']} s (the issue: <= 3 s) | |",
        *(["", f"Before ClickHouse can answer, `kvledger export` copies the store into it: "
           f"{r['chdb_export_rows_per_s'] * sec['chdb_export'] / 1e6:.0f} M rows in {fmt('chdb_export')} "
           f"({r['chdb_export_rows_per_s'] / 1e6:.2f} M rows/s, the chain verified first; "
           f"{(c['read_rows'] + c['write_rows']) / 1e6:.0f} M of them the page ledger, most of the rest n-gram "
           f"hashes), once; later exports copy only new segments."] if sec.get("chdb_export") else []),
        *(["", "How the cost grows with the store (same machine; `exposures` in this process / from the shell, the "
           "verification cache warm, the first command after the store changed and a later one on the same snapshot; "
           "a size added later with `--add-scale` ran without chdb, whose export alone takes about 3 minutes per "
           "100 M rows here: -):", "",
           "| page_reads rows | page_writes rows | exposure slot rows | join: DuckDB | join: chdb | index | "
           "`exposures` first | `exposures` later |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
          + [f"| {x['read_rows'] / 1e6:.0f} M | {x['write_rows'] / 1e6:.0f} M | {x['exposure_slot_rows'] / 1e3:.0f} K | "
             f"{_s(x['seconds'].get('duckdb'))} | {_s(x['seconds'].get('chdb'))} | {_s(x['seconds'].get('index'))} | "
             f"{_cmd(x.get('commands'), 'exposures', 'first_')} | {_cmd(x.get('commands'), 'exposures')} |"
             for x in r["scaling"]]
          if len(r.get("scaling", [])) > 1 else []),
        *(["", f"The commands at {c['read_rows'] / 1e6:.0f} M rows (`kvledger forensics Q --format json`; in this "
           f"process / the whole command from the shell, Python's start included; medians of 3{_when(r, 'commands')}):", "",
           "| command | first: nothing kept | after the store changed: what an earlier command kept | "
           "later, same snapshot | goal |",
           "| --- | --- | --- | --- | --- |"]
          + [f"| `{q}` | {_cmd(r['commands'], q, 'first_')} | "
             f"{_cmd(r['commands'], q, 'changed_')} | "
             f"{_cmd(r['commands'], q)} | <= 1 s / <= 2 s |"
             for q in ("exposures", "tenants", "scores")]
          + ["", f"Where the time goes: open the store and verify it (verification cache warm) "
             f"{r['commands']['open_and_verify_s']:.1f} s; build the snapshot's shared tables (every request from "
             f"the spans, exposure_slots from the index, the n-gram evidence: `materialise()`, what any query may "
             f"need) {r['commands']['materialise_s']:.1f} s the first time (the three commands above make only the "
             f"requests rows they read, their pairs' and the evidence's (`Forensics.narrowed`)), read them back later {r['commands'].get('read_back_s', 0):.2f} s (from what `grown.py` and "
             f"`evidence.py` keep in the state directory - or, where the tables are built rather than grown, from "
             f"the snapshot's entry keyed by the verified chain head: `forensics/queries/answers.py`); a later command's "
             f"whole-store answer is itself kept there and read back (no query runs); after the store changed, "
             f"exposure_slots (and requests, where a command made every one) start from the tables an earlier command kept "
             f"(`forensics/queries/grown.py`) and the n-gram evidence from its rows and last answer "
             f"(`forensics/queries/evidence.py`), reading only the segments added since (measured with no segment "
             f"added, so that read is not in it); the rest is, from the shell, Python's start and imports."]
            if r.get("commands", {}).get("first_shell_s") else []),
    ])


def _when(r: dict, part: str) -> str:
    """``; measured DAY on a CPU with ISA`` for a part re-measured on its own (``--commands-only``),
    where the run recorded its CPU; else nothing (the table's own machine)."""
    import time as _t
    if f"{part}_cpu" not in r or f"{part}_measured_unix_time" not in r:
        return ""
    return (f"; measured {_t.strftime('%Y-%m-%d', _t.gmtime(r[part + '_measured_unix_time']))} on a CPU with "
            f"{_isa(r[part + '_cpu'])}")


def _cmd(c: "dict | None", q: str, pre: str = "") -> str:
    if not c or f"{pre}shell_s" not in c:
        return "-"
    return f"{c[pre + 'in_process_s'][q]:.1f} / {c[pre + 'shell_s'][q]:.1f} s"


def index_table(r: dict) -> str:
    d, i = r["decode"], r["incident"]
    return "\n".join([
        "What keeping the exposure index costs (bench/index.py; the index's fold timed by the writer thread's "
        "CPU clock, the decode interleaved with the index on and off):", "",
        "| measurement | value | goal |", "| --- | --- | --- |",
        f"| decode tokens/s, tiny Llama, ledger on: index on vs off | {d['tokens_per_s']['index_on']:.0f} vs "
        f"{d['tokens_per_s']['index_off']:.0f} ({d['ratio_on_over_off']:.3f}x; {d['rounds']} rounds, within noise) | |",
        f"| the index's fold, CPU per second of decoding | {d['index_cpu_ms_per_decode_s']:.1f} ms "
        f"({100 * d['index_cpu_share_of_decode']:.2f} %) | <= {100 * r['goal_share_of_decode']:.0f} % |",
        f"| the incident replay (every victim's every step reads stale KV): the fold's CPU of the replay's | "
        f"{i['index_cpu_s']:.2f} of {i['replay_cpu_s']:.1f} s ({100 * i['index_share_of_replay_cpu']:.1f} %) | |",
        f"| index == as-of join on that replay | {i['index_equals_join']} ({i['exposure_slot_rows']} slot rows from "
        f"{i['rows']['exposure_index']} index rows; the ledger {i['rows']['page_reads']} read and "
        f"{i['rows']['page_writes']} write rows) | |",
    ])


def _s(v) -> str:
    return "-" if v is None else f"{v:.1f} s"


def clickhouse_layout(_: dict) -> str:
    from telemetry.clickhouse import layouts
    rows = ["| table | ORDER BY | PARTITION BY | cluster: sharded by |", "| --- | --- | --- | --- |"]
    for table, lay in layouts().items():
        shard = "every shard holds it whole" if lay["SHARD BY"] == "everywhere" else f"`{lay['SHARD BY']}`"
        rows.append(f"| `{table}` | `{lay['ORDER BY']}` | {'`' + lay['PARTITION BY'] + '`' if 'PARTITION BY' in lay else '-'} "
                    f"| {shard} |")
    return "\n".join(rows)


def dashboard_table(r: dict) -> str:
    c = r["config"]
    how = ("one page_reads row per read step: the forensics bench's store" if r.get("store", "").startswith("sparse")
           else "read runs coalesced as stored by default")
    kept = (f" A store no writer holds any more (after the incident): its later renders read the snapshot's shared "
            f"tables and whole-store answers back instead of building them (`forensics/queries/answers.py`): "
            f"{r['kept_render_s']:.1f} s "
            f"(the script itself {r['kept_script_s']:.1f} s)." if "kept_render_s" in r else "")
    if "kept_banner_s" in r:
        before = (" (and before the sections' queries run, but where the n-gram evidence is still to be built: "
                  "those that read none of it run while it is built, and the banner waits for them)"
                  if r.get("first_early_banner_s") is not None else "' queries run")
        kept += (f" The banner and the tiles are drawn before the sections{before}: {r['first_banner_s']:.1f} s "
                 f"into the script first, {r['warm_banner_s']:.1f} s warm, {r['kept_banner_s']:.1f} s with the answers "
                 f"kept (goal <= {r['goal_banner_s']:.0f} s).")
    if r.get("first_early_banner_s") is not None:
        kept += (f" On the first render, where the n-gram evidence is still to be built, the banner first says what the "
                 f"exposure index knows - the responses that read another customer's KV, critical and high not yet "
                 f"told apart, the tenants, the protection state and the clock (`early_pairs.sql`) - "
                 f"{r['first_early_banner_s']:.2f} s into the script (goal <= {r['goal_banner_s']:.0f} s), then becomes "
                 f"the whole banner.")
    if "first_page_warmed_render_s" in r:
        kept += (f" A first page load with the defaults - a dashboard just started on this store, a process of its "
                 f"own, nothing kept but the verification cache, the shared tables then kept as by default "
                 f"(medians of {len(r['first_page_renders_s'])} rounds, the three cases in turn in each; goals "
                 f"<= {r['goal_banner_s']:.0f} s and <= {r['goal_s']:.0f} s): loaded after the server's warm-up of the "
                 f"shared tables (`dashboard/serve.py`: requests, the exposure slots and the n-gram evidence built "
                 f"while the server starts"
                 + (f" - then, no page having loaded yet, the page's {r['warm_up_answers']} named queries over the whole "
                    f"store, their answers kept (`answers.py`)" if r.get("warm_up_answers") else "")
                 + f", {r['warm_up_s']:.1f} s here) render "
                 f"**{r['first_page_warmed_render_s']:.1f} s**, the script {r['first_page_warmed_script_s']:.1f} s, "
                 f"the banner {r['first_page_warmed_banner_s']:.2f} s into it; loaded at once, the warm-up still running "
                 f"(it waits for the tables it is building) render {r['first_page_render_s']:.1f} s, the early banner "
                 f"{r['first_page_early_banner_s']:.2f} s and the whole banner {r['first_page_banner_s']:.1f} s into it; "
                 f"with the warm-up off (`kvledger dashboard --no-warm`: the page builds the tables) render "
                 f"{r['first_page_no_warm_render_s']:.1f} s, the early banner {r['first_page_no_warm_early_banner_s']:.2f} s, "
                 f"the whole banner {r['first_page_no_warm_banner_s']:.1f} s.")
    elif "first_page_render_s" in r:
        kept += (f" A first page load with the defaults - a dashboard just started on this store, a process of its "
                 f"own, nothing kept but the verification cache, the shared tables then kept as by default: render "
                 f"{r['first_page_render_s']:.1f} s, the script {r['first_page_script_s']:.1f} s, the early banner "
                 f"{r['first_page_early_banner_s']:.2f} s and the whole banner {r['first_page_banner_s']:.1f} s into it "
                 f"(medians of {len(r['first_page_renders_s'])}; goals <= {r['goal_banner_s']:.0f} s and "
                 f"<= {r['goal_s']:.0f} s).")
    if "live_render_s" in r:
        kept += (f" A live store (a writer open on a copy of it, one flush of new traffic - every table, new "
                 f"incarnations - before each render; `bench/dashboard.py --live`): render {r['live_render_s']:.1f} s, "
                 f"the script itself {r['live_script_s']:.1f} s, the banner {r['live_banner_s']:.1f} s into it "
                 f"(medians of {len(r['live_renders_s'])}; the n-gram evidence from the rows an earlier render kept "
                 f"plus the new segments: `forensics/queries/evidence.py`")
        if "live_rebuilt_render_s" in r:
            kept += (f"; requests with each request's queue time, exposure_slots and the whole store's per-pair "
                     f"exposures grown from the last render's with only the new segments read: "
                     f"`forensics/queries/grown.py`). Interleaved in the same run with those rebuilt every render "
                     f"(KVLEDGER_GROW=0): render "
                     f"{r['live_rebuilt_render_s']:.1f} s, the script {r['live_rebuilt_script_s']:.1f} s, the banner "
                     f"{r['live_rebuilt_banner_s']:.1f} s.")
        else:
            kept += "; the shared tables built every render)."
    results = ROOT / "bench" / "results"
    sparse = [results / "dashboard_sparse.json", *sorted(results.glob("dashboard_sparse_*m.json"))]
    more = "".join("\n\n" + dashboard_table(json.loads(p.read_text())) for p in sparse
                   if p.exists() and not r.get("store", "").startswith("sparse"))
    import time as _t
    on = (f"measured {_t.strftime('%Y-%m-%d', _t.gmtime(r['unix_time']))} on a CPU with {_isa(r['cpu'])}; "
          if "cpu" in r and "unix_time" in r else "")
    return "\n".join([
        f"Dashboard on {(c['read_rows'] + c['write_rows']) / 1e6:.0f} M ledger rows ({on}{how}; "
        f"{c['exposed_copies']} of {c['copies']} replicated copies are the incident), no answers kept on disk "
        f"(KVLEDGER_ANSWER_CACHE=0: the shared tables built every render): first render "
        f"{r['first_render_s']:.1f} s, warm {r['warm_render_s']:.1f} s (goal < {r['goal_s']:.0f} s), "
        f"{r['affected_responses_shown']} affected responses shown"
        + (f"; of which the script itself (the page footer's own timing, without the AppTest harness): first "
           f"{r['first_script_s']:.1f} s (imports included), warm {r['warm_script_s']:.1f} s." if "first_script_s" in r else ".")
        + kept + more,
    ])


def _load(name: str) -> dict | None:
    f = ROOT / "bench" / "results" / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def serve_table(r: dict) -> str:
    c, k, a = r["config"], r["soak"], r["after"]
    return "\n".join([
        f"`kvledger serve` ({c['mode']}, {c['policy']}) on loopback, {c['model']}, on a CPU with {_isa(r.get('cpu'))} "
        f"(`{r['bench']}.json`): {c['tenants']} tenants send "
        f"{c['requests']} requests at once with the official `openai` async client (half streamed), up to "
        f"{c['new_tokens']} new tokens, greedy; vs `LLMEngine.generate` on the same prompts and engine "
        f"configuration, median of {c['rounds']} interleaved rounds"
        + (f" (both: up to {c['max_num_seqs']} sequences and {c['max_num_batched_tokens']} tokens a step, a pool "
           f"every running request fits in)" if "max_num_seqs" in c else "")
        + f". Then a soak of {k['requests']} requests of "
        f"which {k['dropped']} streams are dropped by their client after the first token:",
        "",
        "| measurement | value | goal |",
        "| --- | --- | --- |",
        *([f"| served vs engine tokens/s, the engine as the server runs it ({r['server_torch_threads']} torch "
           f"thread(s)), over the client's wall time of each round (its own ramp included: the rows below) | "
           f"{r['served_tokens_per_s']:.0f} vs {r['engine_same_threads_tokens_per_s']:.0f} "
           f"(**{r['ratio_served_vs_engine_same_threads']:.2f}x**"
           + (f"; per round {', '.join(f'{x:.2f}' for x in r['ratio_same_threads_per_round'])}"
              if "ratio_same_threads_per_round" in r else "") + ") | >= 0.9x |"] if "server_torch_threads" in r else []),
        *([f"| where a served round's time went (each phase's median over the rounds): the "
           f"`openai` client building its {ph['requests']:.0f} requests until the first is sent | "
           f"{ph['client_ramp']:.2f} s | |",
           f"| ... then until the first reaches the engine (connections, HTTP, the client still busy) | "
           f"{ph['to_engine']:.2f} s | |",
           f"| ... the engine's own round in the server (first arrival to last end, from its request spans) vs "
           f"the engine alone at the same threads | {ph['engine']:.2f} vs {r['engine_alone_round_s']:.2f} s "
           f"(**{r['ratio_engine_round_in_server_vs_alone']:.2f}x**) | |",
           f"| ... then until the client has every answer | {ph['after']:.2f} s | |"]
          if (ph := r.get("served_round_phases_s")) else []),
        f"| served vs engine tokens/s, engine alone on both cores (no client beside it) | "
        f"{r['served_tokens_per_s']:.0f} vs {r['engine_tokens_per_s']:.0f} ({r['ratio_served_vs_engine']:.2f}x) | |",
        *([f"| the same, in a run with no `vllm serve` up beside ours (`bench/serve.py --no-vllm`; an idle vLLM "
           f"server still takes CPU) | {al['served_tokens_per_s']:.0f} vs {al['engine_same_threads_tokens_per_s']:.0f} "
           f"(**{al['ratio_served_vs_engine_same_threads']:.2f}x**; per round "
           f"{', '.join(f'{x:.2f}' for x in al['ratio_same_threads_per_round'])}"
           + (f"; the engine's own round in the server at {al['ratio_engine_round_in_server_vs_alone']:.2f}x the engine "
              f"alone's speed, the client's ramp and the first request's way to the engine "
              f"{al['served_round_phases_s']['client_ramp'] + al['served_round_phases_s']['to_engine']:.2f} s a round"
              if "served_round_phases_s" in al else "") + ") | >= 0.9x |"]
          if (al := _load("serve_alone")) and "vs_vllm_serve" in r and al.get("cpu") == r.get("cpu") else []),
        *([f"| CPU per generated token: server (both processes) vs engine alone | "
           f"{r['server_cpu_ms_per_token']:.2f} vs {r['engine_cpu_ms_per_token']:.2f} ms | |"]
          if "server_torch_threads" in r else []),
        *([f"| of the server's CPU per token: the HTTP process's own (HTTP, JSON, SSE, detokenizing) | "
           f"{r['http_process_cpu_ms_per_token']:.3f} ms | |"] if "http_process_cpu_ms_per_token" in r else []),
        *([f"| engine alone beside a process keeping one core busy, 2 vs {r['server_torch_threads']} torch thread(s) | "
           f"{r['engine_beside_a_busy_core_tokens_per_s']['2_threads']:.0f} vs "
           f"{r['engine_beside_a_busy_core_tokens_per_s'][str(r['server_torch_threads']) + '_threads']:.0f} tokens/s | |"]
          if "engine_beside_a_busy_core_tokens_per_s" in r else []),
        f"| the `openai` client's own CPU on the same 2 cores, per second of serving | "
        f"{r.get('client_cpu_share', float('nan')):.2f} s | |",
        *([f"| `kvledger serve` vs `vllm serve` (vLLM-CPU {v['vllm_version']}, fp32, prefix caching off, its own "
           f"thread defaults), same client load, same rounds: tokens/s | {r['served_tokens_per_s']:.0f} vs "
           f"{v['vllm_served_tokens_per_s']:.0f} (**{v['ratio_served_vs_vllm_serve']:.2f}x**; per round "
           f"{', '.join(f'{x:.2f}' for x in v['ratio_per_round'])}) | >= 1.0x |",
           f"| the same rounds: TTFT p50 / p99, kvledger vs vLLM (client side, {v['streamed_requests_each']} streamed "
           f"requests each) | {1e3 * v['kvledger_ttft_p50_s']:.0f} / {1e3 * v['kvledger_ttft_p99_s']:.0f} vs "
           f"{1e3 * v['vllm_ttft_p50_s']:.0f} / {1e3 * v['vllm_ttft_p99_s']:.0f} ms | |"]
          if (v := r.get("vs_vllm_serve")) else []),
        f"| soak TTFT p50 / p99 (client side) | {1e3 * k['ttft_p50_s']:.0f} / {1e3 * k['ttft_p99_s']:.0f} ms | |",
        f"| soak time per output token p50 / p99 | {1e3 * k['tpot_p50_s']:.1f} / {1e3 * k['tpot_p99_s']:.1f} ms | |",
        f"| after: foreign reads in forensics, pool pages used, store verifies, exit code | "
        f"{a['foreign_reads_in_forensics']}, {a['pool_used_pages']:.0f}, {a['store_verifies']}, {a['server_exit_code']} "
        f"| 0, 0, True, 0 |",
    ])


def schema_block(_: dict) -> str:
    return "```sql\n" + (ROOT / "telemetry" / "store" / "schema.sql").read_text().rstrip() + "\n```"


def collect_table(r: dict) -> str:
    o, k, g = r["otlp"], r["kv_events"], r["goals"]
    one = r.get("otlp_single_sender_inline")
    def runs(x: dict, key: str) -> str:
        return f" (runs: {', '.join(f'{v:,}' for v in x[key + '_runs'])})" if key + "_runs" in x else ""
    rows = [f"| OTLP spans/s, {o['senders']} senders, {o['decode_workers']} decoder processes | "
            f"{o['spans_per_s']:,.0f}{runs(o, 'spans_per_s')} | >= {g['spans_per_s']:,} |"]
    if one:
        rows.append(f"| OTLP spans/s, 1 sender, decoded in the receiver's process | {one['spans_per_s']:,.0f}"
                    f"{runs(one, 'spans_per_s')} | |")
    return "\n".join([
        f"`kvledger collect` on loopback, end to end (rows written and linked in the store): {o['spans']:,} vLLM-named "
        f"request spans in OTLP/protobuf requests of 1,000 (after one warm-up request); {k['batches']} KV event "
        "batches of 64 `BlockStored` x 16 distinct block hashes (tagged-map encoding; after one warm-up batch). "
        "Each rate is the median of its runs:",
        "",
        "| measurement | value | goal |",
        "| --- | --- | --- |",
        *rows,
        f"| KV event block hashes/s | {k['block_hashes_per_s']:,.0f}{runs(k, 'block_hashes_per_s')} | "
        f">= {g['block_hashes_per_s']:,} |",
        f"| OTLP posts answered 503 (writer or decoders behind) and retried | {o['throttled_posts']} | |",
        f"| peak RSS of the process (receiver, subscriber, writer, senders) | {r['max_rss_mib']:.0f} MiB | |",
    ])


def peers_collect_table(r: dict) -> str:
    return "\n".join([
        f"`kvledger collect` beside a live vLLM (vllm-cpu 0.32.0, the interop tier's tiny Llama; `bench/peers_collect.py`): "
        f"{r['clients']} `openai` clients drove it for {r['seconds']:.0f} s, {r['max_tokens']} tokens per request, fresh "
        "salted prompts; collect received its OTLP/gRPC spans, its KV events and a scrape of its `/metrics` every "
        "0.5 s on the same two cores, then was stopped and the store counted against what was sent:",
        "",
        "| measurement | value |",
        "| --- | --- |",
        f"| vLLM's own throughput while collected | {r['vllm_tokens_per_s']:,.0f} tokens/s, {r['vllm_requests']:,} requests, "
        f"{r['vllm_errors']} errors |",
        f"| request spans stored (per s) / missing | {r['spans_stored']:,} ({r['spans_per_s']:,.1f}/s) / "
        f"{r['spans_missing']} |",
        f"| KV event batches stored / the publisher's last sequence number + 1 / lost | {r['kv_batches_stored']:,} / "
        f"{r['kv_publisher_last_seq'] + 1:,} / {r['kv_batches_lost']} |",
        f"| KV events stored (per s), block hashes | {r['kv_events_stored']:,} ({r['kv_events_per_s']:,.1f}/s), "
        f"{r['kv_block_hashes_stored']:,} |",
        f"| `/metrics` scrapes stored: up / down (down: before vLLM answered, each an `up` of 0) | "
        f"{r['scrapes_up']:,} / {r['scrapes_down']:,} |",
    ])


def dashboard_replay_table(r: dict) -> str:
    c = r["config"]
    return (f"On the quick start's store (one `kvledger replay glm53`: {c['rows']:,} rows, {c['segments']} segments), "
            f"`bench/dashboard_replay.py`: the banner's data (store opened and verified, the page's queries, the "
            f"protection state and the totals) {r['banner_s']:.2f} s (first {r['first_banner_s']:.2f} s; goal <= "
            f"{r['goal_banner_s']:.0f} s), the whole page {r['page_s']:.2f} s in Streamlit's AppTest, the script itself "
            f"{r['script_s']:.2f} s (first {r['first_page_s']:.2f} s; goal <= {r['goal_page_s']:.0f} s); medians of "
            f"{c['repeats']} warm runs.")


def _tuning(t: dict) -> str:
    return (f"{t['pages_per_split']} pages a split, {t['pages_per_block']} a block, {t['num_warps']} warps"
            + (", tl.dot" if t["dot"] else ", broadcast sums") + (f", {t['num_stages']} stages" if "num_stages" in t else ""))


def gpu_table(r: dict) -> str:
    """bench/gpu_check.sh run twice: the broad sweep (gpu_check.json), then the tl.dot one (gpu_check_dot.json)."""
    broad_f = ROOT / "bench" / "results" / "gpu_check.json"
    broad = json.loads(broad_f.read_text()) if broad_f.exists() else None
    ok = all(c["ok"] for c in r["correctness"]) and (broad is None or all(c["ok"] for c in broad["correctness"]))
    worst = max(c["max_abs_out"] for c in r["correctness"] + (broad["correctness"] if broad else []))
    rows = ["| context | shape | check on ms | check off ms | read check cost | K/V read GB/s |",
            "| --- | --- | --- | --- | --- | --- |"]
    for t in r["timing"]:
        rows.append(f"| {t['context']:,} | {t['shape']} | {t['ms_check_on']:.2f} | {t['ms_check_off']:.2f} | "
                    f"+{100 * t['check_cost']:.0f} % | {t['kv_gb_per_s_check_on']:,.0f} |")
    n = len(r["sweep"]) + (len(broad["sweep"]) if broad else 0)
    default = next(t["tuning"] for t in r["timing"] if t["shape"] == "default")
    ok_sweep = [s for s in r["sweep"] if "error" not in s]
    best_ms = min(s["ms_check_on"] for s in ok_sweep)
    dflt_ms = next(s["ms_check_on"] for s in ok_sweep if s["tuning"] == default)
    split_rows: list[str] = []
    split_f = ROOT / "bench" / "results" / "gpu_check_split.json"
    if split_f.exists():
        sp = json.loads(split_f.read_text())["sweep"]
        pps = sorted({s["pages_per_split"] for s in sp})
        cases = sorted({(s["batch"], s["context"]) for s in sp}, key=lambda c: (-c[0], c[1]))
        split_rows = ["", "The default's pages per split, against its neighbours (`GPU_CHECK_SWEEP=split`; ms a call, "
                      "read check on). From 8 k tokens on at batch 32, 64-page splits are fastest; below, a call "
                      "is bound by its host-side work (allocations, the split-K epilogue: about 0.3 ms) and the "
                      "split barely matters - the same shape timed twice can differ 2x there:", "",
                      "| batch | context | " + " | ".join(f"{p} pages" for p in pps) + " |",
                      "| --- | --- | " + " | ".join("---" for _ in pps) + " |"]
        for b, c in cases:
            ms = {s["pages_per_split"]: s["ms_check_on"] for s in sp if (s["batch"], s["context"]) == (b, c)}
            split_rows.append(f"| {b} | {c:,} | " + " | ".join(f"{ms[p]:.2f}" for p in pps) + " |")
    return "\n".join([
        f"On one {r['device']} (torch {r['torch']}, Triton {r['triton']}), `bench/gpu_check.sh`: the kernel's output, "
        f"attention mass and read check against the torch reference on pools with stale and foreign slots - "
        f"{'all equal' if ok else 'NOT all equal'} (output within {worst:.1e}, fp32) for the plain launch shape and the "
        f"swept ones; then {n} launch shapes timed at 8,192 tokens of context (batch {r['timing'][0]['batch']}, "
        f"{r['timing'][0]['heads_q']} query / {r['timing'][0]['heads_kv']} KV heads of {r['timing'][0]['head_dim']}, "
        f"fp16 K/V); the fastest this run: {_tuning(r['best'])}; the GPU default ('default'), {_tuning(default)}, "
        f"{100 * (dflt_ms / best_ms - 1):.1f} % behind it (pipelining depths of one shape differ by noise). "
        f"'plain' is the shape the kernel had "
        f"before it first ran on a GPU ({_tuning(r['timing'][0]['tuning'])}). Times are the whole call "
        "(kernel, split-K epilogue, output allocations), `triton.testing.do_bench`:", "", *rows, *split_rows])


def prefill_attention_table(r: dict) -> str:
    pool = {"bfloat16_fp32": "bfloat16, widened", "bfloat16_dp": "bfloat16, tiles off"}
    rows = [f"| {label} | {pool.get(dt, dt)} | {c['heads'][0]}:{c['heads'][1]} x {c['heads'][2]} | {c['ms']['kernel']:.2f} ms, "
            f"{c['gflops']['kernel']:.0f} GFLOP/s | {c['ms']['sdpa']:.2f} ms, {c['gflops']['sdpa']:.0f} GFLOP/s | "
            f"**{c['ratio_kernel_vs_sdpa']:.2f}x** |"
            for dt, k in r["kernels"].items() for label, c in k["cases"].items()]
    names = "; ".join(f"{dt}: {k['kernel']}" for dt, k in r["kernels"].items())
    return "\n".join([
        f"Prefill attention alone (`bench/prefill_attention.py`, {_isa(r.get('cpu'))}, {r['threads']} threads, "
        f"medians of {r['repeats']} interleaved calls on the same pages of a 4-layer pool; the native kernel - "
        f"{names} - against SDPA after the engine's page gather"
        f"{' (and, for fp32 products over a bf16 pool, its widening)' if 'bfloat16_fp32' in r['kernels'] else ''}, "
        "with its mask where the chunk continues a "
        "request):", "",
        "| chunk | pool | heads (query:KV x dim) | native kernel | torch SDPA | ratio |",
        "| --- | --- | --- | --- | --- | --- |", *rows])


def decode_attention_table(r: dict) -> str:
    rows = [f"| {label} | {c['layers']} | {c['heads'][0]}:{c['heads'][1]} x {c['heads'][2]} | "
            f"{c['ms_per_step']['amx']:.3f} ms, {c['gb_per_s']['amx']:.0f} GB/s | "
            f"{c['ms_per_step']['vector']:.3f} ms, {c['gb_per_s']['vector']:.0f} GB/s | "
            f"**{c['ratio_amx_vs_vector']:.2f}x** | {c['max_abs_diff']:.0e} |" for label, c in r["cases"].items()]
    return "\n".join([
        f"Decode attention alone (`bench/decode_attention.py`, {_isa(r.get('cpu'))}, {r['threads']} threads, "
        f"medians of {r['repeats']} interleaved steps - one call per layer, every layer - on the same bf16 pages; "
        "GB/s of the K and V bytes read; the largest difference between the two kernels' outputs):", "",
        "| step | layers | heads (query:KV x dim) | AMX kernel | vector kernel (fp32 products) | ratio | max diff |",
        "| --- | --- | --- | --- | --- | --- | --- |", *rows, *_layout_rows(r)])


def decode_prefetch_table(r: dict) -> str:
    """bench/decode_prefetch.py: the decode kernel as built against its builds with a change taken back."""
    rows = [f"| {label} | {c['dtype']} | {c['heads'][0]}:{c['heads'][1]} x {c['heads'][2]}, {c['layers']} layers | "
            f"{c['ms_per_step']['now']:.2f} ms, {c['gb_per_s']['now']:.1f} GB/s | "
            + " | ".join(f"{c['ms_per_step'][k]:.2f} ms (**{c['ratio_now_vs'][k]:.2f}x**)"
                         for k in ("l1_prefetch", "keywise_scores", "one_block_ahead", "before")) + " |"
            for label, c in r["cases"].items()]
    return "\n".join([
        f"Decode attention alone, the kernel as built against its builds with the fifty-fourth session's changes "
        f"taken back (`bench/decode_prefetch.py`, {_isa(r.get('cpu'))}, {r['threads']} thread(s), medians of "
        f"{r['repeats']} interleaved steps - one call per layer, every layer; GB/s of the K and V bytes a step reads; "
        "the ratios: how much longer each build takes than the kernel as built; the outputs agree to "
        f"{max(max(c['max_abs_diff'].values()) for c in r['cases'].values()):.0e}):", "",
        "| step | pool | heads, layers | as built (rows prefetched into L2; one pass: 32 keys ahead, page scores 8 "
        "keys at a time; blocked: 3 blocks ahead) | rows prefetched into L1, one pass 16 keys ahead | scores key by "
        "key | blocked: one block ahead | all three (the kernel before) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows])


def _layout_rows(r: dict) -> list[str]:
    """The AMX kernel on the pool's earlier layouts (bench/decode_attention.py rebuilds them)."""
    cases = {k: c for k, c in r["cases"].items() if "amx_4k_pages_8b_records" in c["ms_per_step"]}
    if not cases:
        return []
    rows = [f"| {label} | {c['ms_per_step']['amx']:.3f} ms | {c['ms_per_step']['amx_4k_pages']:.3f} ms "
            f"(**{c['ratio_vs_4k_pages']:.2f}x**) | {c['ms_per_step']['amx_4k_pages_8b_records']:.3f} ms "
            f"(**{c['ratio_vs_old_layout']:.2f}x**) |" for label, c in cases.items()]
    return ["", "The AMX kernel on the same values in the pool's layouts before the sixteenth session (the "
            "ratios: how much faster the pool as it is now runs the step):", "",
            "| step | pool now: 2 MB pages, records on 64-byte lines | on 4 KB pages | on 4 KB pages, records on 8 bytes |",
            "| --- | --- | --- | --- |", *rows]


def _chain_files(store: dict) -> str:
    return f", {store['chain_files']:,} chain files" if "chain_files" in store else ""


def segments_table(r: dict) -> str:
    """bench/segments.py: the same rows in many small flushes, merged or not by the writer, against a few big ones."""
    c, st, m = r["config"], r["stores"], r["median_s"]
    many, few, merged = st["many"], st["few"], st.get("merged")
    mins = many["flushes"] * c["writer_flush_interval_s"] / 60
    rows = [f"The same rows ({many['read_rows'] / 1e6:.1f} M page_reads rows: {c['copies']} copies of the forensics "
            f"bench's replays) flushed {many['flushes']} times (at the writer's {c['writer_flush_interval_s']:.0f} s "
            f"flush interval, about {mins:.0f} minutes of one engine's writing) by a writer that merges nothing "
            f"({many['files']:,} segment files" + _chain_files(many) + ")"
            + (f" and by one that merges as it writes (the default since the thirty-fifth session: "
               f"{merged['merges']} merges of {merged['compact_fan']} segments, {merged['files']} files left"
               + (f"; its chain files packed {merged['chain_fan']} at a time since the thirty-sixth session: "
                  f"{merged['chain_packs']} packs" if merged.get("chain_fan") else "") + _chain_files(merged) + ")"
               if merged else "")
            + f", and {few['flushes']} times ({few['files']} files); from the shell, medians of "
            f"{c['repeats']} rounds, the stores in turn (`bench/segments.py`, {_isa(r.get('cpu'))}):", ""]
    if merged:
        rows += [f"| command | {many['flushes']} flushes, nothing merged | {many['flushes']} flushes, merged | "
                 f"{few['flushes']} flushes | merged vs nothing merged |", "| --- | --- | --- | --- | --- |"]
    else:
        rows += [f"| command | {many['flushes']} flushes | {few['flushes']} flushes | ratio |", "| --- | --- | --- | --- |"]
    names = {"verify": "`kvledger verify` (no cache: every segment hashed)",
             "first": "`forensics exposures`, nothing kept but the verification cache",
             "later": "the same again (the kept answer)"}
    for k, name in names.items():
        if merged:
            rows.append(f"| {name} | {m['many'][k]:.1f} s | {m['merged'][k]:.1f} s | {m['few'][k]:.1f} s | "
                        f"**{m['many'][k] / m['merged'][k]:.1f}x** |")
        else:
            rows.append(f"| {name} | {m['many'][k]:.1f} s | {m['few'][k]:.1f} s | {r['many_over_few'][k]:.1f}x |")
    if merged and "write_s" in many and "write_s" in merged:
        rows.append(f"| writing the store (the bench's writer, {many['flushes']} flushes back to back) | "
                    f"{many['write_s']:.1f} s | {merged['write_s']:.1f} s | | cost "
                    f"{(merged['write_s'] / many['write_s'] - 1) * 100:+.0f} % |")
    return "\n".join(rows)


def telemetry_steady_text(r: dict) -> str:
    """The telemetry bench run with long turns (``--gens-per-round`` many flush intervals): whether the
    turn's closing flush, which the engine waits for, is what makes the ledger's cost."""
    t, c, a = r["tokens_per_s"], r["config"], r["cpu_accounting"]
    turn = c["gens_per_round"] * c["batch"] * c["new_tokens"] / t["spans_ledger"]
    lo, hi = r["spans_ledger_cost_ci95"]
    short = 8 * c["batch"] * c["new_tokens"] / t["spans_ledger"]      # a turn of the bench's default 8 calls
    than = "less than" if short < r["flush_interval_s"] else "at least"
    return (f"With long turns (`bench/results/{r['bench']}.json`: {c['gens_per_round']} generate calls a turn, "
            f"{turn:.1f} s with the ledger - about {turn / r['flush_interval_s']:.0f} of the writer's own "
            f"{r['flush_interval_s']:g} s flushes before the one the turn ends with - {c['repeats']} rounds): the ledger's "
            f"cost **{100 * r['spans_ledger_cost']:+.1f} %** (95 % interval over rounds {100 * lo:+.1f} to "
            f"{100 * hi:+.1f} %), spans + metrics alone {100 * r['spans_cost']:+.1f} %, the writer "
            f"{a['writer_ms_per_s']:.1f} ms of CPU per second of decoding and the engine thread's hooks "
            f"{a['engine_thread_ms_per_s']:.1f}. A turn of the default 8 calls (about "
            f"{short:.1f} s on this CPU, {than} one flush interval) "
            f"ends with a flush the engine waits for; in long turns that is one flush in "
            f"{turn / r['flush_interval_s'] + 1:.0f}, and the cost is the short turns' within the runs' noise: "
            f"a steady decode pays it too.")


SECTIONS = {"segments": segments_table, "engine": engine_table, "prefill_attention": prefill_attention_table,
            "prefill_attention_avx2": prefill_attention_table, "prefill_attention_zen4": prefill_attention_table,
            "decode_attention": decode_attention_table, "decode_prefetch_zen4": decode_prefetch_table, "decode_prefetch_zen4_1t": decode_prefetch_table, "engine_1t": engine_table, "engine_avx2": engine_table, "engine_avx2_1t": engine_table, "engine_bf16": engine_bf16_table, "engine_bf16_1t": engine_bf16_table, "engine_avx2_bf16": engine_bf16_table, "engine_zen4": engine_table, "engine_zen4_1t": engine_table, "engine_zen4_bf16": engine_bf16_table, "engine_zen4_bf16_1t": engine_bf16_table, "dashboard_replay": dashboard_replay_table, "guards": guards_table, "telemetry": telemetry_table, "telemetry_avx2": telemetry_table, "telemetry_zen4": telemetry_table, "telemetry_zen4_steady": telemetry_steady_text, "forensics": forensics_table,
            "dashboard": dashboard_table, "serve": serve_table, "serve_avx2": serve_table, "serve_zen4": serve_table, "collect": collect_table,
            "peers_collect": peers_collect_table, "index": index_table, "gpu_check_dot": gpu_table}


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name, fn in SECTIONS.items():
        f = ROOT / "bench" / "results" / f"{name}.json"
        if not f.exists():
            continue
        body = fn(json.loads(f.read_text()))
        text = re.sub(rf"(<!-- bench:{name} -->).*?(<!-- /bench:{name} -->)",
                      lambda m: m.group(1) + "\n" + body + "\n" + m.group(2), text, flags=re.S)
    text = re.sub(r"(<!-- schema -->).*?(<!-- /schema -->)",
                  lambda m: m.group(1) + "\n" + schema_block({}) + "\n" + m.group(2), text, flags=re.S)
    text = re.sub(r"(<!-- clickhouse-layout -->).*?(<!-- /clickhouse-layout -->)",
                  lambda m: m.group(1) + "\n" + clickhouse_layout({}) + "\n" + m.group(2), text, flags=re.S)
    readme.write_text(text)


if __name__ == "__main__":
    main()
