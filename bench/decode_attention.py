"""Decode attention alone: the AMX kernel (engine/kernels/paged_decode.c, kvl_paged_decode_bf16_amx)
against the vector kernel it replaces (kvl_paged_decode_bf16: bf16 widened, every product fp32) on the
same bf16 pages, one call per layer over every layer of the pool as a decode step makes them (the
records interleave the layers: a layer's K/V rows are a record apart), interleaved, medians; GB/s of
the K and V bytes a call reads. Writes bench/results/decode_attention.json.

    .venv/bin/python bench/decode_attention.py [--repeats 9] [--threads 2]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import interleaved, kernel_bench_args, write  # noqa: E402
from engine import kernels  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402

CASES = [   # (label, layers, query heads, KV heads, head dim, keys of each request)
    ("long: 4 requests of 2-4 k keys", 4, 4, 2, 64, [3000, 2500, 3500, 2100]),
    ("big: 8 requests of 300-700 keys", 8, 14, 2, 64, [600, 400, 650, 320, 500, 700, 350, 450]),
    ("tiny: 8 requests of 30-200 keys", 4, 4, 2, 64, [100, 150, 50, 190, 30, 77, 120, 160]),
]


def case(L: int, Hq: int, Hkv: int, D: int, seqs: list[int], repeats: int) -> dict:
    S, B = 16, len(seqs)
    C = max(-(-n // S) for n in seqs)
    g = torch.Generator().manual_seed(0)
    pool = KVPool(L, Hkv * D, S, (B * C + 2) * KVPool.page_bytes_for(L, Hkv * D, S, torch.bfloat16),
                  dtype=torch.bfloat16)
    pool.buf.view(torch.bfloat16)[:] = torch.randn(pool.buf.numel() // pool.esize, generator=g)
    pages = torch.randperm(pool.num_pages, generator=g)[:B * C].view(B, C)
    q, seq, idx = torch.randn(B, Hq, D, generator=g), torch.tensor(seqs), torch.arange(B)
    outs = {}

    def step(amx: bool):
        def run():
            kernels.DECODE_AMX = amx
            out, pm = torch.empty(B, Hq, D), torch.empty(B, C)
            for layer in range(L):
                assert kernels.paged_decode(q, idx, pool, layer, pages, seq, Hkv, D ** -0.5, out, pm, idx)
            outs[amx] = out
        return run

    try:
        before = kernels.AMX_DECODES
        step(True)()
        if kernels.AMX_DECODES == before:
            sys.exit(f"kvledger: error: the AMX decode kernel does not run here ({kernels.why_not() or 'no AMX tiles'})")
        t = interleaved({"vector": step(False), "amx": step(True)}, repeats)
    finally:
        kernels.DECODE_AMX = True
    kv_bytes = 2 * sum(seqs) * Hkv * D * 2 * L          # K and V, bf16, every layer
    return {"ms_per_step": {k: v * 1e3 for k, v in t.items()}, "gb_per_s": {k: kv_bytes / v / 1e9 for k, v in t.items()},
            "max_abs_diff": float((outs[True] - outs[False]).abs().max()), "ratio_amx_vs_vector": t["vector"] / t["amx"]}


def main() -> None:
    args = kernel_bench_args(__doc__)
    if kernels.native() is None:
        sys.exit(f"kvledger: error: the native kernels do not run here ({kernels.why_not()})")
    res = {"threads": args.threads, "repeats": args.repeats, "cases": {}}
    for label, L, Hq, Hkv, D, seqs in CASES:
        r = res["cases"][label] = {"layers": L, "heads": [Hq, Hkv, D], "keys": seqs} | case(L, Hq, Hkv, D, seqs,
                                                                                          args.repeats)
        print(f"{label}: AMX {r['ms_per_step']['amx']:.3f} ms a step ({r['gb_per_s']['amx']:.0f} GB/s) vs vector "
              f"{r['ms_per_step']['vector']:.3f} ms ({r['gb_per_s']['vector']:.0f}) -> {r['ratio_amx_vs_vector']:.2f}x; "
              f"max |difference| {r['max_abs_diff']:.1e}", flush=True)
    print(f"wrote {write('decode_attention', res)}")


if __name__ == "__main__":
    main()
