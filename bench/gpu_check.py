"""GPU check of the Triton paged-decode kernel (run by bench/gpu_check.sh on a CUDA machine).

1. correctness: kernel on the GPU vs the torch reference on a CPU copy of the same pool, on pools
   holding stale (generation) and foreign (content tag) slots: output, page mass, read check.
2. a sweep of launch shapes (engine.triton_attention.Tuning: pages per loop block, pages per
   split, warps, tl.dot on tensor cores) at one context, each checked against the plain shape
   and timed with the read check on and off; the fastest (check on) is "best".
3. timing (triton.testing.do_bench) of the plain shape, the best one and the engine's GPU default
   (engine.triton_attention.GPU_DEFAULT), check on and off
   (CHECK=False: a plain paged decode, same code without the tag/generation loads), at several
   context lengths; bytes of K/V read per second.
GPU_CHECK_SWEEP=dot: a finer sweep of tl.dot shapes in step 2. GPU_CHECK_SWEEP=split: instead of
steps 2-3, the GPU default with 8-64 pages per split, per batch size and context.
Writes JSON to $OUT/gpu_check.json (and bench/results/; gpu_check_dot.json, gpu_check_split.json).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import triton_attention as ta  # noqa: E402
from engine.attention import BatchLayout, paged_attention  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402


def make(B, C, S, hkv, D, dtype, device, seed=0, corrupt=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, hkv * D, S, (B * C + 1) * KVPool.page_bytes_for(1, hkv * D, S, dtype), dtype=dtype, device=device)
    el = pool.buf.view(dtype)
    if device == "cpu":
        el.copy_(torch.randn(el.numel(), generator=g).to(dtype))
    else:                                    # large timing pools: fill on the device
        torch.manual_seed(seed)
        el.normal_()
    P = pool.num_pages
    bt = torch.randperm(P, generator=g)[: B * C].view(B, C)
    seq = torch.randint(1, C * S + 1, (B,), generator=g)
    seq[0] = C * S
    gens = pool.generation[bt.to(device)].cpu().clone()
    tags = pool.tags[bt.to(device)].reshape(B, C * S).cpu().clone()
    for i in range(corrupt):
        b, pos = i % B, int(torch.randint(0, int(seq[i % B]), (1,), generator=g))
        if i % 2:
            gens[b, pos // S] += 1
        else:
            tags[b, pos] ^= 0x5A5A
    lay = BatchLayout.build(bt, seq, torch.ones(B, dtype=torch.long), gens, tags)
    return pool, lay


def to(lay: BatchLayout, device) -> BatchLayout:
    return lay._replace(block_tables=lay.block_tables.to(device), seq_lens=lay.seq_lens.to(device),
                        expected_gen=lay.expected_gen.to(device), expected_tags=lay.expected_tags.to(device))


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "correctness": [], "sweep": [], "timing": []}
    plain = ta.Tuning()
    shapes = [(3, 5, 16, 2, 2, 64), (8, 40, 16, 4, 4, 128), (2, 70, 16, 8, 8, 128)]
    for tn in (plain, ta.Tuning(32, 4, 4, False), ta.Tuning(32, 4, 4, True)):
        for (B, C, S, hkv, g, D) in shapes:
            pool, lay = make(B, C, S, hkv, D, torch.float32, dev, corrupt=6)
            cpu = KVPool(1, hkv * D, S, pool.memory_bytes, dtype=torch.float32)
            cpu.buf.copy_(pool.buf.cpu())
            q = torch.randn(B, hkv * g, D)
            ref = paged_attention(q, cpu, 0, lay, hkv, D, D ** -0.5, True)
            got = ta.paged_decode(q.to(dev), pool, 0, to(lay, dev), hkv, D, D ** -0.5, True, tn)
            row = {"shape": [B, C, S, hkv, g, D], "tuning": tn._asdict(),
                   "max_abs_out": float((got.out.cpu() - ref.out.reshape(B, -1)).abs().max()),
                   "max_abs_mass": float((got.page_mass.cpu() - ref.page_mass).abs().max()),
                   "check_equal": bool(torch.equal(got.check.bad_mask.cpu(), ref.check.bad_mask)
                                       and torch.equal(got.check.bad_slots.cpu(), ref.check.bad_slots))}
            row["ok"] = row["max_abs_out"] < 1e-4 and row["max_abs_mass"] < 1e-4 and row["check_equal"]
            res["correctness"].append(row)
            print("correctness", row, flush=True)
    B, S, hkv, g, D = 32, 16, 8, 4, 128
    Hq = hkv * g

    def timed(ctx, tn, batch=B):
        C = ctx // S
        pool, lay = make(batch, C, S, hkv, D, torch.float16, dev)
        lay = to(lay._replace(seq_lens=torch.full((batch,), ctx)), dev)
        q = torch.randn(batch, Hq, D, device=dev)
        return pool, lay, q

    res["sweep_kind"] = os.environ.get("GPU_CHECK_SWEEP", "shapes")
    if res["sweep_kind"] == "split":
        return split_sweep(res, timed, B, hkv, D, do_bench)
    # the sweep, at one context: fp16 K/V; each shape's output against the plain shape's
    ctx = 8192
    pool, lay, q = timed(ctx, plain)
    base = ta.paged_decode(q, pool, 0, lay, hkv, D, D ** -0.5, True, plain)
    kv_bytes = 2 * B * ctx * hkv * D * 2
    sweep = [ta.Tuning(pps, pb, warps, dot) for pps in (8, 32) for pb in (1, 4, 8) for warps in (4, 8)
             for dot in (False, True) if pb <= pps]
    if os.environ.get("GPU_CHECK_SWEEP") == "dot":       # the second, finer sweep: tl.dot shapes only
        sweep = [ta.Tuning(pps, pb, warps, True, stages) for pps in (16, 32, 64) for pb in (1, 2)
                 for warps in (2, 4) for stages in (1, 2, 3, 4)]
    for tn in sweep:
        try:
            got = ta.paged_decode(q, pool, 0, lay, hkv, D, D ** -0.5, True, tn)
            diff = float((got.out - base.out).abs().max())
            same_check = bool(torch.equal(got.check.bad_mask, base.check.bad_mask))
            row = {"tuning": tn._asdict(), "context": ctx, "max_abs_vs_plain": diff, "check_equal": same_check,
                   **check_on_off(q, pool, lay, hkv, D, tn, kv_bytes, do_bench)}
        except Exception as e:          # a shape that does not compile is a finding, not a crash
            row = {"tuning": tn._asdict(), "context": ctx, "error": repr(e)[:300]}
        res["sweep"].append(row)
        print("sweep", row, flush=True)
    good = [r for r in res["sweep"] if "error" not in r and r["max_abs_vs_plain"] < 2e-2 and r["check_equal"]]
    best = ta.Tuning(**min(good, key=lambda r: r["ms_check_on"])["tuning"]) if good else plain
    res["best"] = best._asdict()
    del pool, lay, q, base
    for ctx in (2048, 8192, 32768):
        pool, lay, q = timed(ctx, plain)
        kv_bytes = 2 * B * ctx * hkv * D * 2
        for name, tn in (("plain", plain), ("best", best), ("default", ta.GPU_DEFAULT)):
            row = {"shape": name, "tuning": tn._asdict(), "batch": B, "context": ctx, "heads_q": Hq,
                   "heads_kv": hkv, "head_dim": D, "dtype": "float16",
                   **check_on_off(q, pool, lay, hkv, D, tn, kv_bytes, do_bench)}
            res["timing"].append(row)
            print("timing", row, flush=True)
        del pool, lay, q
        torch.cuda.empty_cache()
    return write(res)


def check_on_off(q, pool, lay, hkv: int, D: int, tn, kv_bytes: int, do_bench) -> dict:
    """One launch shape timed with the read check on and off (a plain paged decode)."""
    on = do_bench(lambda: ta.paged_decode(q, pool, 0, lay, hkv, D, D ** -0.5, True, tn))
    off = do_bench(lambda: ta.paged_decode(q, pool, 0, lay, hkv, D, D ** -0.5, False, tn))
    return {"ms_check_on": on, "ms_check_off": off, "check_cost": on / off - 1,
            "kv_gb_per_s_check_on": kv_bytes / on / 1e6}


def write(res: dict) -> int:
    res["unix_time"] = int(time.time())
    text = json.dumps(res, indent=2) + "\n"
    name = {"dot": "gpu_check_dot.json", "split": "gpu_check_split.json"}.get(res["sweep_kind"], "gpu_check.json")
    for d in (os.environ.get("OUT"), str(Path(__file__).parent / "results")):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
    return 0 if all(r["ok"] for r in res["correctness"]) else 1


def split_sweep(res: dict, timed, B: int, hkv: int, D: int, do_bench) -> int:
    """GPU_CHECK_SWEEP=split: the GPU default with 8-64 pages per split, per batch size and context."""
    for batch, ctx in ((32, 2048), (32, 8192), (32, 32768), (4, 2048), (4, 8192), (4, 32768), (1, 32768)):
        pool, lay, q = timed(ctx, None, batch)
        kv_bytes = 2 * batch * ctx * hkv * D * 2
        for pps in (8, 16, 32, 64):
            tn = ta.GPU_DEFAULT._replace(pages_per_split=pps)
            row = {"batch": batch, "context": ctx, "pages_per_split": pps,
                   **check_on_off(q, pool, lay, hkv, D, tn, kv_bytes, do_bench)}
            res["sweep"].append(row)
            print("split", row, flush=True)
        del pool, lay, q
        torch.cuda.empty_cache()
    return write(res)


if __name__ == "__main__":
    sys.exit(main())
