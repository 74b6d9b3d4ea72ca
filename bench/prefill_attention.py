"""Prefill attention alone: the native kernels (engine/kernels/paged_prefill.c - AMX tiles for a bf16
pool, AVX-512 or AVX2 FMAs for an fp32 one, and for a bf16 one's values widened where the products are
fp32) against torch's SDPA on the same pages, as the engine would call
each (SDPA after its page gather - and its widening to fp32; with its mask where the chunk continues a request), interleaved,
medians; GFLOP/s of the causal products (2 * Hq * D * keys read). The pool has the long bench
model's 4 layers (a key's record holds every layer's K and V). A bf16 pool's kernel in bf16
products runs on AMX tiles where the CPU has them - and then also with the tiles off, on AVX512-BF16's
dot products, as a CPU without tiles runs it (``bfloat16_dp``). Writes
bench/results/prefill_attention.json (prefill_attention_avx2.json on a CPU without AVX-512;
``--results NAME``: NAME.json, another kind of CPU's figures beside these).

    .venv/bin/python bench/prefill_attention.py [--repeats 9] [--threads 2] [--results NAME]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import cpu, interleaved, kernel_bench_args, write  # noqa: E402
from engine import kernels  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402

CASES = [   # (label, query heads, KV heads, head dim, keys n, query rows ql): rows at positions n - ql .. n - 1
    ("long: a 3000-token prompt", 4, 2, 64, 3000, 3000),
    ("long: 1000 rows continuing 2000", 4, 2, 64, 3000, 1000),
    ("big: a 600-token prompt", 14, 2, 64, 600, 600),
    ("tiny: a 150-token prompt", 4, 2, 64, 150, 150),
]


def case(Hq: int, Hkv: int, D: int, n: int, ql: int, repeats: int, dtype: torch.dtype, bf16_products: bool,
         tiles: bool = True) -> dict:
    S, L = 16, 4
    P = (n + S - 1) // S
    g = torch.Generator().manual_seed(0)
    pool = KVPool(L, Hkv * D, S, (P + 2) * KVPool.page_bytes_for(L, Hkv * D, S, dtype), dtype=dtype)
    pages = torch.randperm(pool.num_pages, generator=g)[:P]
    slot = torch.arange(n)
    pool.store(1, pages[slot // S], slot % S, torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g))
    q = torch.randn(ql, Hq, D, generator=g)
    out = torch.empty(ql, Hq, D)
    mask = None if ql == n else torch.arange(P * S)[None, :] <= torch.arange(n - ql, n)[:, None]

    def sdpa():
        k = pool.k(1).index_select(0, pages).view(P * S, Hkv, D)
        v = pool.v(1).index_select(0, pages).view(P * S, Hkv, D)
        if mask is None:
            k, v = k[:ql], v[:ql]
        if not bf16_products:       # fp32 products: the stored values widened (an fp32 pool's: as they are)
            k, v = k.float(), v.float()
        o = F.scaled_dot_product_attention(q.to(k.dtype).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                           scale=D ** -0.5, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    def kernel():
        kernels.PREFILL_TILES = tiles
        try:
            assert kernels.paged_prefill(q, pool, 1, pages, n, Hkv, D ** -0.5, out, bf16_products=bf16_products)
        finally:
            kernels.PREFILL_TILES = True

    sdpa(), kernel()
    t = interleaved({"sdpa": sdpa, "kernel": kernel}, repeats)
    flops = 2 * Hq * D * (n * n - (n - ql) ** 2)     # Q K^T and P V over the keys each row reads
    return {"ms": {k: v * 1e3 for k, v in t.items()}, "gflops": {k: flops / v / 1e9 for k, v in t.items()},
            "ratio_kernel_vs_sdpa": t["sdpa"] / t["kernel"]}


def runs(dtype: torch.dtype, bf16_products: bool, tiles: bool) -> bool:
    """Whether the native prefill kernel for a pool of this type runs on this machine (``tiles``
    False: a bf16 product's with the tiles off - only where there are tiles to turn off)."""
    if not tiles and not kernels.prefill_tiles():
        return False
    pool = KVPool(1, 32, 4, 4 * KVPool.page_bytes_for(1, 32, 4, dtype), dtype=dtype)
    kernels.PREFILL_TILES = tiles
    try:
        return kernels.paged_prefill(torch.zeros(1, 1, 32), pool, 0, torch.tensor([0]), 1, 1, 1.0,
                                     torch.empty(1, 1, 32), bf16_products=bf16_products)
    finally:
        kernels.PREFILL_TILES = True


AVX512 = "avx512f" in cpu().get("isa", [])
VEC = "AVX-512" if AVX512 else "AVX2"
KERNELS = {   # the JSON's name: (the pool's type, bf16 products, tiles where they run, what runs)
    "bfloat16": (torch.bfloat16, True, True, "AMX tiles (bf16 products)" if kernels.prefill_tiles()
                 else "AVX512-BF16 dot products (bf16 products)"),
    "bfloat16_dp": (torch.bfloat16, True, False, "AVX512-BF16 dot products, the tiles off (bf16 products)"),
    "float32": (torch.float32, False, True, f"{VEC} FMAs (fp32 products)"),
    "bfloat16_fp32": (torch.bfloat16, False, True, f"{VEC} FMAs over a bf16 pool's values widened (fp32 products)"),
}


def main() -> None:
    # a CPU without AVX-512 (an AMD EPYC with AVX2) runs the AVX2 build: its figures kept apart by default
    args = kernel_bench_args(__doc__, "prefill_attention" if AVX512 else "prefill_attention_avx2")
    here = [name for name, (dt, bp, tiles, _) in KERNELS.items() if runs(dt, bp, tiles)]
    if not here:
        sys.exit(f"kvledger: error: no native prefill kernel runs here ({kernels.why_not() or 'no AMX tiles, no AVX-512 or AVX2 with FMA'})")
    res = {"threads": args.threads, "repeats": args.repeats, "kernels": {}}
    for name in here:
        dt, bf16_products, tiles, what = KERNELS[name]
        cases = res["kernels"][name] = {"kernel": what, "cases": {}}
        for label, Hq, Hkv, D, n, ql in CASES:
            r = cases["cases"][label] = ({"heads": [Hq, Hkv, D], "keys": n, "rows": ql}
                                         | case(Hq, Hkv, D, n, ql, args.repeats, dt, bf16_products, tiles))
            print(f"{name} {label}: kernel {r['ms']['kernel']:.2f} ms ({r['gflops']['kernel']:.0f} GFLOP/s) vs SDPA "
                  f"{r['ms']['sdpa']:.2f} ms ({r['gflops']['sdpa']:.0f}) -> {r['ratio_kernel_vs_sdpa']:.2f}x", flush=True)
    print(f"wrote {write(args.results, res)}")


if __name__ == "__main__":
    main()
