"""The decode kernel's memory reads (engine/kernels/paged_decode.c), its builds side by side: the
kernel as built (``now``: K and V rows prefetched into L2 - prefetcht1 - and the one-pass path's
page scores 8 keys at a time, the blocked path's rows 3 blocks ahead), and rebuilt here only with
the fifty-fourth session's changes taken back one at a time (``-D`` flags of the same sources):
``l1_prefetch`` (rows prefetched into L1 - prefetcht0 - and the one-pass path 16 keys ahead, as
before), ``keywise_scores`` (a page's scores key by key, as before), ``one_block_ahead`` (the blocked
path - several query heads a KV head, or bf16 - prefetching one block of 8 keys ahead, as before) and
``before`` (all three). One call per layer over every layer of a pool, as a decode
step makes them (a layer's K/V rows are a record apart: records hold every layer), interleaved,
medians; GB/s of the K and V bytes a step reads; the largest difference from ``now``'s outputs.
The cases are the engine bench's decode shapes (bench/engine.py): `long`'s 12 K keys of 4 layers do
not fit in the caches, `tiny`'s do. Writes bench/results/decode_prefetch.json.

    .venv/bin/python bench/decode_prefetch.py [--repeats 15] [--threads 2]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import interleaved, kernel_bench_args, write  # noqa: E402
from engine import kernels  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402

CASES = [   # (label, dtype, layers, query heads, KV heads, head dim, keys of each request)
    ("long fp32: 4 requests of 2.6-3.7 k keys", torch.float32, 4, 4, 2, 64, [2764, 2639, 3733, 3296]),
    ("long bf16", torch.bfloat16, 4, 4, 2, 64, [2764, 2639, 3733, 3296]),
    ("big fp32: 8 requests of 320-700 keys", torch.float32, 8, 14, 2, 64, [600, 400, 650, 320, 500, 700, 350, 450]),
    ("tiny fp32: 8 requests of 30-200 keys", torch.float32, 4, 4, 2, 64, [100, 150, 50, 190, 30, 77, 120, 160]),
    ("tiny bf16", torch.bfloat16, 4, 4, 2, 64, [100, 150, 50, 190, 30, 77, 120, 160]),
]

BUILDS = {"now": (), "l1_prefetch": ("KVL_PF_LOCALITY=3", "KVL_PFF=16"), "keywise_scores": ("KVL_SCORES_KEYWISE",),
          "one_block_ahead": ("KVL_BPF=1",), "before": ("KVL_PF_LOCALITY=3", "KVL_PFF=16", "KVL_SCORES_KEYWISE", "KVL_BPF=1")}


def case(libs: dict, dtype: torch.dtype, L: int, Hq: int, Hkv: int, D: int, seqs: list[int], repeats: int) -> dict:
    S, B = 16, len(seqs)
    C = max(-(-n // S) for n in seqs)
    g = torch.Generator().manual_seed(0)
    P = B * C + 2
    pool = KVPool(L, Hkv * D, S, P * KVPool.page_bytes_for(L, Hkv * D, S, dtype), dtype=dtype)
    for layer in range(L):
        pool.k(layer).copy_(torch.randn(P, S, Hkv * D, generator=g))
        pool.v(layer).copy_(torch.randn(P, S, Hkv * D, generator=g))
    pages = torch.randperm(P, generator=g)[:B * C].view(B, C)       # a request's pages out of order, as allocated
    q, seq, idx = torch.randn(B, Hq, D, generator=g), torch.tensor(seqs), torch.arange(B)
    outs = {}

    def step(name: str):
        def run():
            kernels._lib = libs[name]
            out, pm = torch.empty(B, Hq, D), torch.empty(B, C)
            for layer in range(L):
                assert kernels.paged_decode(q, idx, pool, layer, pages, seq, Hkv, D ** -0.5, out, pm, idx)
            outs[name] = out
        return run

    saved = kernels._lib
    try:
        t = interleaved({name: step(name) for name in libs}, repeats)
    finally:
        kernels._lib = saved
    kv_bytes = 2 * sum(seqs) * Hkv * D * pool.esize * L          # K and V, every layer
    return {"ms_per_step": {k: v * 1e3 for k, v in t.items()}, "gb_per_s": {k: kv_bytes / v / 1e9 for k, v in t.items()},
            "ratio_now_vs": {k: v / t["now"] for k, v in t.items() if k != "now"},
            "max_abs_diff": {k: float((o - outs["now"]).abs().max()) for k, o in outs.items() if k != "now"}}


def main() -> None:
    args = kernel_bench_args(__doc__, "decode_prefetch")
    if kernels.native() is None:
        sys.exit(f"kvledger: error: the native kernels do not run here ({kernels.why_not()})")
    libs = {name: kernels._lib if not defines else kernels._build(defines) for name, defines in BUILDS.items()}
    kernels.DECODE_AMX = False          # the vector kernels (the AMX one has its own bench: decode_attention.py)
    res = {"threads": args.threads, "repeats": args.repeats, "builds": {k: list(v) for k, v in BUILDS.items()},
           "cases": {}}
    for label, dtype, L, Hq, Hkv, D, seqs in CASES:
        r = res["cases"][label] = {"dtype": str(dtype).removeprefix("torch."), "layers": L, "heads": [Hq, Hkv, D],
                                   "keys": seqs} | case(libs, dtype, L, Hq, Hkv, D, seqs, args.repeats)
        ms = r["ms_per_step"]
        print(f"{label}: now {ms['now']:.3f} ms a step ({r['gb_per_s']['now']:.1f} GB/s); "
              + ", ".join(f"{k} {ms[k]:.3f} ms ({x:.2f}x)" for k, x in r["ratio_now_vs"].items())
              + f"; max |difference| {max(r['max_abs_diff'].values()):.1e}", flush=True)
    print(f"wrote {write(args.results, res)}")


if __name__ == "__main__":
    main()
