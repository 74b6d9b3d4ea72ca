"""Decode attention alone: the AMX kernel (engine/kernels/paged_decode.c, kvl_paged_decode_bf16_amx)
against the vector kernel it replaces (kvl_paged_decode_bf16: bf16 widened, every product fp32) on the
same bf16 pages, one call per layer over every layer of the pool as a decode step makes them (the
records interleave the layers: a layer's K/V rows are a record apart), interleaved, medians; GB/s of
the K and V bytes a call reads. Then the AMX kernel on the same pages in the pool's layouts before
the sixteenth session: its buffer on 4 KB pages (``KVLEDGER_POOL_HUGEPAGES=0``), and on 4 KB pages
with the records on 8 bytes (an 8-byte page header and a 16-byte tag area: a 64-dim bf16 head's row
then straddles three cache lines, not two) - rebuilt here only, to measure what each choice of
engine/kv/pool.py is worth. Writes bench/results/decode_attention.json.

    .venv/bin/python bench/decode_attention.py [--repeats 9] [--threads 2]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import interleaved, kernel_bench_args, write  # noqa: E402
from engine import kernels  # noqa: E402
from engine.kv import pool as pool_mod  # noqa: E402
from engine.kv.pool import KVPool  # noqa: E402

CASES = [   # (label, layers, query heads, KV heads, head dim, keys of each request)
    ("long: 4 requests of 2-4 k keys", 4, 4, 2, 64, [3000, 2500, 3500, 2100]),
    ("big: 8 requests of 300-700 keys", 8, 14, 2, 64, [600, 400, 650, 320, 500, 700, 350, 450]),
    ("tiny: 8 requests of 30-200 keys", 4, 4, 2, 64, [100, 150, 50, 190, 30, 77, 120, 160]),
]


LAYOUTS = {     # pool variant -> (huge pages, bytes the header, tag area and records are aligned to)
    "amx": (True, pool_mod.ALIGN), "amx_4k_pages": (False, pool_mod.ALIGN), "amx_4k_pages_8b_records": (False, 8)}


def _pool(L: int, kv_dim: int, S: int, pages: int, huge: bool, align: int) -> KVPool:
    """A bf16 pool in one of LAYOUTS (the module's constants set for its construction only)."""
    saved = pool_mod.ALIGN, pool_mod._HDR, pool_mod.TAG_BYTES, os.environ.get("KVLEDGER_POOL_HUGEPAGES")
    pool_mod.ALIGN, pool_mod._HDR, pool_mod.TAG_BYTES = align, max(align, 8), max(align, 16)
    os.environ["KVLEDGER_POOL_HUGEPAGES"] = "1" if huge else "0"
    try:
        return KVPool(L, kv_dim, S, pages * KVPool.page_bytes_for(L, kv_dim, S, torch.bfloat16), dtype=torch.bfloat16)
    finally:
        pool_mod.ALIGN, pool_mod._HDR, pool_mod.TAG_BYTES = saved[:3]
        if saved[3] is None:
            os.environ.pop("KVLEDGER_POOL_HUGEPAGES")
        else:
            os.environ["KVLEDGER_POOL_HUGEPAGES"] = saved[3]


def case(L: int, Hq: int, Hkv: int, D: int, seqs: list[int], repeats: int) -> dict:
    S, B = 16, len(seqs)
    C = max(-(-n // S) for n in seqs)
    g = torch.Generator().manual_seed(0)
    pools = {name: _pool(L, Hkv * D, S, B * C + 2, *how) for name, how in LAYOUTS.items()}
    vals = torch.randn(pools["amx"].num_pages, S, 2 * L * Hkv * D, generator=g).to(torch.bfloat16)
    for pool in pools.values():         # the same K and V values in every layout
        for layer in range(L):
            pool.k(layer).copy_(vals[:, :, layer * Hkv * D:(layer + 1) * Hkv * D])
            pool.v(layer).copy_(vals[:, :, (L + layer) * Hkv * D:(L + layer + 1) * Hkv * D])
    pages = torch.randperm(pools["amx"].num_pages, generator=g)[:B * C].view(B, C)
    q, seq, idx = torch.randn(B, Hq, D, generator=g), torch.tensor(seqs), torch.arange(B)
    outs = {}

    def step(name: str, amx: bool = True):
        pool = pools[name]

        def run():
            kernels.DECODE_AMX = amx
            out, pm = torch.empty(B, Hq, D), torch.empty(B, C)
            for layer in range(L):
                assert kernels.paged_decode(q, idx, pool, layer, pages, seq, Hkv, D ** -0.5, out, pm, idx)
            outs[name if amx else "vector"] = out
        return run

    try:
        before = kernels.AMX_DECODES
        step("amx")()
        if kernels.AMX_DECODES == before:
            sys.exit(f"kvledger: error: the AMX decode kernel does not run here ({kernels.why_not() or 'no AMX tiles'})")
        t = interleaved({"vector": step("amx", False)} | {name: step(name) for name in LAYOUTS}, repeats)
    finally:
        kernels.DECODE_AMX = True
    for name in LAYOUTS:        # the layout changes where the bytes are, not what is computed
        assert torch.equal(outs[name], outs["amx"]), name
    kv_bytes = 2 * sum(seqs) * Hkv * D * 2 * L          # K and V, bf16, every layer
    return {"ms_per_step": {k: v * 1e3 for k, v in t.items()}, "gb_per_s": {k: kv_bytes / v / 1e9 for k, v in t.items()},
            "max_abs_diff": float((outs["amx"] - outs["vector"]).abs().max()), "ratio_amx_vs_vector": t["vector"] / t["amx"],
            "ratio_vs_4k_pages": t["amx_4k_pages"] / t["amx"], "ratio_vs_old_layout": t["amx_4k_pages_8b_records"] / t["amx"]}


def main() -> None:
    args = kernel_bench_args(__doc__, "decode_attention")
    if kernels.native() is None:
        sys.exit(f"kvledger: error: the native kernels do not run here ({kernels.why_not()})")
    res = {"threads": args.threads, "repeats": args.repeats, "cases": {}}
    for label, L, Hq, Hkv, D, seqs in CASES:
        r = res["cases"][label] = {"layers": L, "heads": [Hq, Hkv, D], "keys": seqs} | case(L, Hq, Hkv, D, seqs,
                                                                                          args.repeats)
        print(f"{label}: AMX {r['ms_per_step']['amx']:.3f} ms a step ({r['gb_per_s']['amx']:.0f} GB/s) vs vector "
              f"{r['ms_per_step']['vector']:.3f} ms ({r['gb_per_s']['vector']:.0f}) -> {r['ratio_amx_vs_vector']:.2f}x; "
              f"max |difference| {r['max_abs_diff']:.1e}; the pool's layout: on 4 KB pages "
              f"{r['ms_per_step']['amx_4k_pages']:.3f} ms ({r['ratio_vs_4k_pages']:.2f}x), and 8-byte records "
              f"{r['ms_per_step']['amx_4k_pages_8b_records']:.3f} ms ({r['ratio_vs_old_layout']:.2f}x)", flush=True)
    print(f"wrote {write(args.results, res)}")


if __name__ == "__main__":
    main()
