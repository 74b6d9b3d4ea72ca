"""The native dense ops (engine/kernels/dense.c) against the torch ops they replace, on the shapes
a step gives them: decode rows (below the threading threshold) and prefill rows (above it), rows
with a stride (slices of a wider buffer), a residual added in place, and what makes them decline."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.models import llama

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or kernels.native() is None,
                                reason=f"native kernels not built here: {kernels.why_not()}")


@pytest.mark.parametrize("T", [1, 8, 200])
@pytest.mark.parametrize("H", [8, 64, 96, 100, 256])     # 8, 100: a sum of squares with a tail past 16 lanes
def test_add_rms_norm_equals_torch_with_and_without_a_residual(T, H):
    torch.manual_seed(T * 7 + H)
    wide = torch.randn(T, H + 32)
    x, w = wide[:, 5:5 + H], torch.randn(H)               # rows with a stride, not contiguous
    torch.testing.assert_close(kernels.add_rms_norm(x, w, 1e-6), llama.rms_norm(x.contiguous(), w, 1e-6))
    res = torch.randn(T, H)
    want_res = res + x
    got = kernels.add_rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(res, want_res)             # the residual stream, added to in place
    torch.testing.assert_close(got, llama.rms_norm(want_res, w, 1e-5))


@pytest.mark.parametrize("T", [1, 8, 70])          # 70: rows in parallel
@pytest.mark.parametrize("H", [8, 100])
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
def test_add_rms_norm_takes_and_gives_bf16_rows_bit_for_bit_as_the_fp32_pass_rounded(T, H, x_dtype, out_dtype):
    """A bf16 product's result in (widened as read), the next bf16 product's input out (rounded once):
    exactly the fp32 kernel's numbers on the widened rows, its result rounded as .to(bf16) rounds."""
    torch.manual_seed(T + H)
    wide = torch.randn(T, H + 8).to(x_dtype)
    x, w = wide[:, 3:3 + H], torch.randn(H)              # strided rows
    want = kernels.add_rms_norm(x.float(), w, 1e-6).to(out_dtype)
    assert torch.equal(kernels.add_rms_norm(x, w, 1e-6, out_dtype=out_dtype), want)
    res = torch.randn(T, H)
    res_want = res.clone()
    want = kernels.add_rms_norm(x.float(), w, 1e-5, residual=res_want).to(out_dtype)
    got = kernels.add_rms_norm(x, w, 1e-5, residual=res, out_dtype=out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want) and torch.equal(res, res_want)
    # the torch fallback (no kernels) gives the same numbers up to rounding order
    torch.testing.assert_close(llama.rms_norm(res_want, w, 1e-5).to(out_dtype), got, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("T, inter", [(1, 64), (8, 512), (130, 1000)])
def test_silu_mul_equals_torch(T, inter):
    gu = torch.randn(T, 2 * inter) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gate) * up)
    # the kernel's inline exponential (vectorized) over the range where it clamps: large |x|, 0, NaN
    edge = torch.tensor([-200., -88.4, -87.2, -30., -1e-3, 0., 1e-3, 30., 87.2, 88.4, 200., float("nan")])
    got = kernels.silu_mul(torch.cat([edge, torch.ones_like(edge)])[None])[0]
    torch.testing.assert_close(got, F.silu(edge), atol=1e-30, rtol=1e-6, equal_nan=True)
    # bf16 rows (a bf16 prefill's MLP): computed in fp32, rounded once - torch's fp32 result, rounded
    b = gu.to(torch.bfloat16)
    g16, u16 = b.float().chunk(2, dim=-1)
    got = kernels.silu_mul(b)
    assert got.dtype == torch.bfloat16 and got.shape == (T, inter)
    torch.testing.assert_close(got.float(), (F.silu(g16) * u16).to(torch.bfloat16).float(), atol=1e-6, rtol=2 ** -8)


@pytest.mark.parametrize("T, Hq, Hkv, D", [(1, 4, 2, 64), (8, 14, 2, 64), (100, 4, 4, 16)])
def test_rope_in_place_equals_torch_and_leaves_v_alone(T, Hq, Hkv, D):
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    positions = torch.randint(0, 4000, (T,))
    f = llama.rope_freqs(positions, D, 10000.0)
    want = llama.rope(qkv.view(T, -1, D)[:, :Hq + Hkv], *llama.rope_full(f, torch.float32))
    v = qkv[:, (Hq + Hkv) * D:].clone()
    assert kernels.rope(qkv, Hq + Hkv, D, f.cos(), f.sin())
    torch.testing.assert_close(qkv.view(T, -1, D)[:, :Hq + Hkv], want)
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v)


@pytest.mark.parametrize("T, Hq, Hkv, D", [(1, 4, 2, 64), (100, 14, 2, 64), (70, 4, 4, 16), (3, 2, 1, 6)])
def test_rope_on_bf16_rows_is_the_fp32_rotation_rounded_once(T, Hq, Hkv, D):
    """kvl_rope_bf16 (a bf16 product's q and k, out of place): bit for bit kvl_rope_f32 on the rows
    widened, then rounded to bf16 as torch rounds - below and above the threading threshold, half
    widths that fill no vector - into a strided out, x and the columns past the heads untouched."""
    torch.manual_seed(T + D)
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D) * 30).to(torch.bfloat16)
    before = qkv.clone()
    f = llama.rope_freqs(torch.randint(0, 4000, (T,)), D, 10000.0)
    wide = qkv.float()
    assert kernels.rope(wide, Hq + Hkv, D, f.cos(), f.sin())
    want = wide[:, :(Hq + Hkv) * D].to(torch.bfloat16)
    buf = torch.full((T, (Hq + Hkv) * D + 8), 7.0, dtype=torch.bfloat16)
    assert kernels.rope_bf16(qkv, Hq + Hkv, D, f.cos(), f.sin(), buf[:, 3:3 + (Hq + Hkv) * D])
    assert torch.equal(buf[:, 3:3 + (Hq + Hkv) * D].view(torch.int16), want.view(torch.int16))
    assert (buf[:, :3] == 7).all() and (buf[:, 3 + (Hq + Hkv) * D:] == 7).all() and torch.equal(qkv, before)
    # what it declines: fp32 rows, an out too narrow
    assert not kernels.rope_bf16(wide, Hq + Hkv, D, f.cos(), f.sin(), buf)
    assert not kernels.rope_bf16(qkv, Hq + Hkv, D, f.cos(), f.sin(), buf[:, :D])


def test_the_kernels_decline_what_they_do_not_handle_and_torch_runs_it():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert kernels.add_rms_norm(x, w, 1e-6) is None and kernels.silu_mul(x.half()) is None
    assert not kernels.rope(x, 1, 64, torch.ones(4, 32), torch.ones(4, 32))
    # bf16 through the model's helpers: torch's ops, the same numbers as the reference
    torch.testing.assert_close(llama.add_rms_norm(x, w, 1e-6, out_dtype=torch.bfloat16), llama.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(llama.silu_mul(x), F.silu(x[:, :32]) * x[:, 32:])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_model_step_gives_the_same_greedy_tokens_with_the_kernels_off(kind, request, monkeypatch):
    """The whole engine, native kernels on vs off (torch's ops): the same greedy tokens."""
    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from engine.models.llama import LlamaModel
    from engine.request import SamplingParams
    model = LlamaModel.from_pretrained(request.getfixturevalue(f"tiny_{kind}"))
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 77)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    def run() -> list[list[int]]:
        eng = LLMEngine(model, None, EngineConfig(kv_memory_budget=8 << 20, page_size=16, max_num_seqs=4))
        return [r.output_ids for r in eng.generate(prompts, sp)]
    calls = kernels.CALLS
    on = run()
    assert kernels.CALLS > calls                       # the native decode kernel ran
    monkeypatch.setattr(kernels, "_lib", None)
    assert kernels.add_rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is None
    assert run() == on


@pytest.mark.parametrize("native", [True, False])
def test_store_writes_each_new_tokens_k_and_v_into_its_slot_and_nothing_else(native, monkeypatch):
    """KVPool.store through the native scatter and through torch's index_put: the same records,
    every other byte of the buffer (tags, writers, other layers, other slots) untouched."""
    from engine.kv.pool import KVPool
    if not native:
        monkeypatch.setattr(kernels, "_lib", None)
    L, Hkv, D, S = 3, 2, 8, 4
    pool = KVPool(L, Hkv * D, S, 6 * KVPool.page_bytes_for(L, Hkv * D, S))
    before = pool.buf.clone()
    qkv = torch.randn(5, 4 + 2 * Hkv, D)                     # the model's fused q|k|v rows
    k, v = qkv[:, 4:4 + Hkv], qkv[:, 4 + Hkv:]
    pages, offs = torch.tensor([2, 2, 5, 0, 3]), torch.tensor([0, 3, 1, 2, 3])
    pool.store(1, pages, offs, k, v)
    torch.testing.assert_close(pool.k(1)[pages, offs], k.reshape(5, -1), rtol=0, atol=0)
    torch.testing.assert_close(pool.v(1)[pages, offs], v.reshape(5, -1), rtol=0, atol=0)
    pool.k(1)[pages, offs] = before.view(torch.float32).as_strided(pool.k(1).shape, pool.k(1).stride(),
                                                                   pool.k(1).storage_offset())[pages, offs]
    pool.v(1)[pages, offs] = before.view(torch.float32).as_strided(pool.v(1).shape, pool.v(1).stride(),
                                                                   pool.v(1).storage_offset())[pages, offs]
    assert torch.equal(pool.buf, before)                     # those rows were the only bytes written


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 37])   # every remainder of a tile of 4 or 8 rows
@pytest.mark.parametrize("N,K,bias", [(40, 24, True), (256, 64, False), (96, 200, True)])
def test_each_projection_path_equals_f_linear(M, N, K, bias):
    """The few-rows kernel (blocks of 16 columns, N not a multiple of 16 included), oneDNN's
    prepacked path and F.linear give the same product to float rounding, bias included; a few-rows
    input really runs the native kernel (bit for bit its result)."""
    torch.manual_seed(M * 31 + N)
    w, b = torch.randn(N, K), torch.randn(N) if bias else None
    x = torch.randn(M, K)
    want = F.linear(x, w, b)
    lin = llama.Linear(w, b, onednn=llama.packing_available())
    torch.testing.assert_close(lin(x), want, atol=1e-4, rtol=1e-4)
    if llama.few_rows(M, N, K):
        assert torch.equal(lin(x), kernels.linear(x, lin.rows, N, b))
    wide = torch.randn(M, K + 8)[:, 3:3 + K]                 # not contiguous
    torch.testing.assert_close(lin(wide), F.linear(wide, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin(x.view(1, M, K)), want[None], atol=1e-4, rtol=1e-4)    # 3-D
    kept = llama.Linear(w, b, onednn=False)                  # no oneDNN layout: the loaded weight stays
    assert kept.weight is not None and kept.onednn is None
    torch.testing.assert_close(kept(x), want, atol=1e-4, rtol=1e-4)


BIG_N, BIG_K = 2048, 1040          # 2.13 M values: more than llama.FEW_ROWS_WEIGHT (decode path timed)


@pytest.mark.parametrize("faster", ["kernel", "onednn"])
def test_a_big_weight_s_decode_rows_take_the_path_timed_faster_here(monkeypatch, faster):
    """A weight of more than FEW_ROWS_WEIGHT values runs a decode step's rows (up to FEW_ROWS)
    through whichever of the native kernel and oneDNN was timed faster on this CPU for its shape -
    bit for bit that path's product - and more rows through oneDNN; the same product as F.linear
    to float rounding either way."""
    assert llama.packing_available()
    torch.manual_seed(5)
    w, b = torch.randn(BIG_N, BIG_K), torch.randn(BIG_N)
    monkeypatch.setattr(llama, "_DECODE_CHOICE", {(BIG_N, BIG_K, True, torch.get_num_threads(), "timed"): faster == "kernel"})
    lin = llama.Linear(w, b, onednn=True)
    assert lin.decode_kernel is (faster == "kernel") and lin.rows is not None and lin.onednn is not None
    dnn = lambda x: torch.ops.mkldnn._linear_pointwise(x, lin.onednn, b, "none", [], "")  # noqa: E731
    for m in (1, 8, llama.FEW_ROWS, llama.FEW_ROWS + 1):
        x = torch.randn(m, BIG_K)
        path = kernels.linear(x, lin.rows, BIG_N, b) if faster == "kernel" and m <= llama.FEW_ROWS else dnn(x)
        assert torch.equal(lin(x), path)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-3, rtol=1e-4)


def _count_kernel_calls(monkeypatch) -> list[int]:
    """No decode choice made yet in this process; the rows of every native kernel.linear call from now on."""
    monkeypatch.setattr(llama, "_DECODE_CHOICE", {})
    real, calls = kernels.linear, []

    def counting(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)
    monkeypatch.setattr(kernels, "linear", counting)
    return calls


def test_a_big_weight_s_decode_path_is_timed_once_a_shape_and_thread_count(monkeypatch):
    """The timing runs once per (shape, bias, torch threads) in a process - a second weight of the
    shape reuses it, another thread count times again; a small weight is never timed (the static
    rule); where the kernel declines the shape, oneDNN is chosen untimed."""
    calls = _count_kernel_calls(monkeypatch)
    small = llama.Linear(torch.randn(256, 64), None, onednn=True)
    assert small.decode_kernel and calls == []
    first = llama.Linear(torch.randn(BIG_N, BIG_K), None, onednn=True)
    assert calls == [llama.CALIBRATE_ROWS] * (1 + llama.CALIBRATE_CALLS)     # a first call, then the timed ones
    again = llama.Linear(torch.randn(BIG_N, BIG_K), None, onednn=True)
    assert len(calls) == 1 + llama.CALIBRATE_CALLS and again.decode_kernel == first.decode_kernel
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        llama.Linear(torch.randn(BIG_N, BIG_K), None, onednn=True)
        assert len(calls) == 2 * (1 + llama.CALIBRATE_CALLS)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(llama, "_DECODE_CHOICE", {})
    monkeypatch.setattr(kernels, "linear", lambda *a, **kw: None)      # the kernel declines
    assert llama.Linear(torch.randn(BIG_N, BIG_K), None, onednn=True).decode_kernel is False


@pytest.mark.parametrize("pinned", ["kernel", "onednn"])
def test_a_big_weight_s_decode_path_pinned_is_not_timed(monkeypatch, pinned):
    """KVLEDGER_DECODE_KERNEL=kernel or onednn pins a big weight's decode rows to that path, untimed
    (whatever the timing would say; a declining kernel still gives oneDNN) - two processes then give
    the same numbers - and "timed" (or unset) times it; the choices of each are kept apart."""
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setenv("KVLEDGER_DECODE_KERNEL", pinned)
    torch.manual_seed(6)
    w = torch.randn(BIG_N, BIG_K)
    lin = llama.Linear(w, None, onednn=True)
    assert lin.decode_kernel is (pinned == "kernel")
    assert calls == ([llama.CALIBRATE_ROWS] if pinned == "kernel" else [])     # whether it declines, no timing
    x = torch.randn(4, BIG_K)
    calls.clear()
    lin(x)
    assert calls == ([4] if pinned == "kernel" else [])
    monkeypatch.setenv("KVLEDGER_DECODE_KERNEL", "timed")
    llama.Linear(w, None, onednn=True)
    assert len(calls) == (pinned == "kernel") + 1 + llama.CALIBRATE_CALLS and len(llama._DECODE_CHOICE) == 2
    if pinned == "kernel":
        monkeypatch.setenv("KVLEDGER_DECODE_KERNEL", "kernel")
        monkeypatch.setattr(llama, "_DECODE_CHOICE", {})
        monkeypatch.setattr(kernels, "linear", lambda *a, **kw: None)      # the kernel declines: oneDNN anyway
        assert llama.Linear(w, None, onednn=True).decode_kernel is False


def test_every_projection_is_laid_out_once_for_each_path_and_the_loaded_copy_dropped(tiny_qwen2, monkeypatch):
    """Each of a layer's four projections and the lm_head carry the few-rows layout and (with oneDNN)
    its prepacked one, and no third copy; with the native kernels switched off after load the oneDNN
    path answers every size; KVLEDGER_ONEDNN=0 keeps the loaded weight for F.linear."""
    from engine.models.llama import LlamaModel, packing_available
    model = LlamaModel.from_pretrained(tiny_qwen2)
    L = model.cfg.num_layers
    lins = [*model.qkv, *model.o, *model.gate_up, *model.down, model.lm_head]
    assert len(lins) == 4 * L + 1 and all(lin.rows is not None for lin in lins)
    H = model.cfg.hidden_size
    if packing_available():
        assert all(lin.onednn is not None and lin.weight is None for lin in lins)
        x = torch.randn(3, H)
        few = model.qkv[0](x)
        monkeypatch.setattr(kernels, "_lib", None)             # the kernel gone: oneDNN takes even 3 rows
        torch.testing.assert_close(model.qkv[0](x), few, atol=1e-4, rtol=1e-4)
        monkeypatch.undo()
    monkeypatch.setenv("KVLEDGER_ONEDNN", "0")
    plain = LlamaModel.from_pretrained(tiny_qwen2)
    assert all(lin.onednn is None and lin.weight is not None for lin in [*plain.qkv, plain.lm_head])
    for x in (torch.randn(1, H), torch.randn(37, H)):        # the few-rows kernel and F.linear, same product
        torch.testing.assert_close(plain.qkv[0](x), F.linear(x, plain.qkv[0].weight, plain.qkv[0].bias),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("onednn_takes_bf16", [True, False])
@pytest.mark.parametrize("N", [72, 2080])
@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 5, 8, 64, 65, 200])
def test_a_bf16_weight_stays_bf16_and_its_products_run_where_stated(M, gemm, N, onednn_takes_bf16, monkeypatch):
    """--dtype bfloat16: the weight stays bf16. On a CPU without bf16 instructions (gemm "fp32") the
    products are fp32: up to BF16_KERNEL_ROWS rows on the widened values in the native kernel (bit for
    bit its result), beyond on an fp32 copy through F.linear - the packed copy the only one kept. On
    one with them (gemm "bf16": llama.bf16_gemm) products run in bf16 through oneDNN on the weight
    prepacked in bf16 (x rounded to bf16, one bf16 rounding of the result), every row count - except a
    small weight's decode rows (N 72: fewer than BF16_ONEDNN_MIN_WEIGHT values), which keep the
    native kernel. Bias included, 3-D and strided inputs too."""
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "1" if gemm == "bf16" else "0")
    if not onednn_takes_bf16:           # as on an AVX2-only CPU (oneDNN refuses a bf16 weight there)
        monkeypatch.setattr(llama, "_ONEDNN_BF16", False)
    torch.manual_seed(M)
    K = 256
    w, b = torch.randn(N, K).to(torch.bfloat16), torch.randn(N)
    x = torch.randn(M, K)
    # (oneDNN takes a bf16 weight only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT: elsewhere,
    # or under ONEDNN_MAX_CPU_ISA=AVX2, bf16 products forced on run through F.linear)
    onednn = llama.packing_available() and llama.onednn_bf16()
    lin = llama.Linear(w, b, onednn=llama.packing_available())
    small = N * K < llama.BF16_ONEDNN_MIN_WEIGHT
    assert small == (N == 72)
    if gemm == "fp32" or not onednn:
        assert lin.onednn is None
    else:
        assert lin.onednn is not None and lin.onednn.dtype == torch.bfloat16
    if gemm == "fp32" or small:
        assert lin.rows.dtype == torch.bfloat16
        assert lin.rows.numel() == -(-N // kernels.ROW_BLOCK) * kernels.ROW_BLOCK * K      # the packed copy, bf16
    else:
        assert lin.rows is None                     # every row count in bf16: no packed rows kept
    assert (lin.weight is None) == (gemm == "fp32" or onednn)       # one bf16 layout kept, not two
    bf16_products = gemm == "bf16" and (M > llama.BF16_KERNEL_ROWS or not small)

    def want(x):
        if bf16_products:       # x rounded to bf16, fp32 accumulation, the result rounded to bf16 once
            return F.linear(x.to(torch.bfloat16).float(), w.float(), b.to(torch.bfloat16).float())
        return F.linear(x, w.float(), b)
    tol = dict(atol=1e-3, rtol=2 ** -7) if bf16_products else dict(atol=1e-4, rtol=1e-4)
    calls = llama.BF16_GEMM_CALLS
    torch.testing.assert_close(lin(x), want(x), **tol)
    assert (llama.BF16_GEMM_CALLS > calls) == bf16_products
    assert lin(x).dtype == torch.float32
    if bf16_products:                      # within bf16's precision of the fp32 product
        torch.testing.assert_close(lin(x), F.linear(x, w.float(), b), atol=0.3, rtol=2e-2)
        assert lin(x, keep_bf16=True).dtype == torch.bfloat16
        assert torch.equal(lin(x, keep_bf16=True).float(), lin(x))
        assert torch.equal(lin(x.to(torch.bfloat16)), lin(x))     # a bf16 x is taken as it is
    elif M <= llama.BF16_KERNEL_ROWS:
        assert torch.equal(lin(x), kernels.linear(x, lin.rows, N, b))
        assert lin(x, keep_bf16=True).dtype == torch.float32       # fp32 products: nothing to keep
    wide = torch.randn(M, K + 8)[:, 3:3 + K]
    torch.testing.assert_close(lin(wide), want(wide), **tol)
    torch.testing.assert_close(lin(x.view(1, M, K)), want(x)[None], **tol)
    # widened once for several calls (LlamaModel.mlp's chunks) where every F.linear call would widen it:
    # the weight's values, and the same product bit for bit
    once = lin.wide(M)
    assert (once is not None) == (gemm == "fp32" and lin.weight is None and M > llama.BF16_KERNEL_ROWS)
    if once is not None:
        assert torch.equal(once, w.float())
        assert torch.equal(lin(x, wide=once), lin(x)) and torch.equal(lin(wide, wide=once), lin(wide))


@pytest.mark.amx
@pytest.mark.parametrize("N, K", [(1216, 896), (1192, 448), (600, 896)])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_decode_rows_on_amx_tiles_give_onednn_s_bf16_product_bit_for_bit(N, K, M, monkeypatch):
    """linear_amx.c (a big bf16 weight's decode rows with bf16 products): x rounded to bf16, fp32
    sums, the bias added, one rounding - bit for bit what oneDNN's bf16 product on its packed weight
    gives, and within bf16 rounding of the fp32 product; column counts that fill no 16-column block or
    4-block task, strided rows of x; what it declines (17 rows, fp32 x, K not a multiple of 32); and a
    Linear takes it for up to TILE_ROWS decode rows, the same numbers as with it turned off."""
    monkeypatch.setenv("KVLEDGER_BF16_GEMM", "1")
    torch.manual_seed(N + M)
    w, b = (torch.randn(N, K) * 0.05).to(torch.bfloat16), torch.randn(N).to(torch.bfloat16)
    packed = kernels.pack_tiles(w)
    if packed is None:
        pytest.skip("no AMX tiles on this CPU (or the OS refuses them): decode rows stay with oneDNN")
    wide = torch.randn(M, K + 40).to(torch.bfloat16)
    x = wide[:, 7:7 + K]                                    # rows with a stride
    got = kernels.linear_tiles(x, packed, N, b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2 ** -7)
    if llama.onednn_bf16():
        ref = torch.ops.mkldnn._linear_pointwise(x.contiguous(), torch.ops.mkldnn._reorder_linear_weight(
            w, llama.PACK_ROWS), b, "none", [], "")
        assert torch.equal(got, ref)
    assert kernels.linear_tiles(torch.zeros(17, K, dtype=torch.bfloat16), packed, N, b) is None
    assert kernels.linear_tiles(x.float(), packed, N, b) is None
    assert kernels.pack_tiles(w[:, :K - 16]) is None
    # through a Linear: decode rows on the tiles (no oneDNN call), as with them turned off
    assert N * K >= llama.BF16_ONEDNN_MIN_WEIGHT
    lin = llama.Linear(w, b.float(), onednn=llama.packing_available())
    assert lin.tiles is not None
    monkeypatch.setenv("KVLEDGER_DECODE_TILES", "0")
    off = llama.Linear(w, b.float(), onednn=llama.packing_available())
    assert off.tiles is None
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    assert torch.equal(lin(x), off(x)) and seen == [M]                   # only the one turned off: oneDNN
    assert torch.equal(lin(x, keep_bf16=True), got) and seen == [M]
    seen.clear()
    lin(torch.randn(M + 16, K))                                         # more rows: oneDNN's
    assert seen == [M + 16]


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_pool_stores_k_and_v_rounded_as_torch_rounds_them(native, monkeypatch):
    """A bf16 pool: the native store rounds each new value to nearest even exactly as torch's
    .to(torch.bfloat16) does (ties, the largest finite values, infinities, -0, subnormals; a NaN
    stays a NaN), into its slot and nothing else."""
    from engine.kv.pool import KVPool
    if not native:
        monkeypatch.setattr(kernels, "_lib", None)
    L, Hkv, D, S = 2, 2, 8, 4
    pool = KVPool(L, Hkv * D, S, 6 * KVPool.page_bytes_for(L, Hkv * D, S, torch.bfloat16), dtype=torch.bfloat16)
    k, v = torch.randn(4, Hkv, D), torch.randn(4, Hkv, D)
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38, -3.3895e38, float("inf"),
                            float("-inf"), float("nan"), -0.0, 1e-40, 2 ** -8, 65504.5, 0.1, -7.7, 1e20, 5e-39])
    k[0] = special.view(Hkv, D)
    pages, offs = torch.tensor([2, 5, 0, 3]), torch.tensor([0, 1, 3, 3])
    assert kernels.store_kv(pool, 0, pages, offs, k, v, None, None) is native     # which path writes (layer 0)
    before = pool.buf.clone()
    pool.store(1, pages, offs, k, v)
    for got, src in ((pool.k(1)[pages, offs], k), (pool.v(1)[pages, offs], v)):
        want = src.reshape(4, -1).to(torch.bfloat16)
        nan = torch.isnan(want)     # (torch's own NaN bits differ between its vector and scalar paths)
        assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == (src is k)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    after = pool.buf.clone()
    rows16 = [t[pages, offs].view(-1, Hkv, D).clone() for t in (pool.k(1), pool.v(1))]
    for t in (pool.k(1), pool.v(1)):     # put the old bytes back: nothing else was written
        t[pages, offs] = before.view(torch.bfloat16).as_strided(t.shape, t.stride(), t.storage_offset())[pages, offs]
    assert torch.equal(pool.buf, before) and not torch.equal(after, before)
    # bf16 rows in (a bf16 product's K and V, rounded already): copied as they are, the same bytes
    pool.store(1, pages, offs, *rows16)
    assert torch.equal(pool.buf, after)


def _bf16_prefill_runs() -> bool:
    from engine.kv.pool import KVPool
    pool = KVPool(1, 32, 4, 4 * KVPool.page_bytes_for(1, 32, 4, torch.bfloat16), dtype=torch.bfloat16)
    return kernels.paged_prefill(torch.zeros(1, 1, 32), pool, 0, torch.tensor([0]), 1, 1, 1.0, torch.empty(1, 1, 32))


@pytest.mark.parametrize("on", [pytest.param("tiles", marks=pytest.mark.amx),
                                pytest.param("dp", marks=pytest.mark.avx512_bf16)])
@pytest.mark.parametrize("Hq, Hkv, D, S, n, ql, spread", [
    (4, 2, 64, 16, 100, 100, 1.0),       # a whole prompt: square causal, a partial last query and key block
    (4, 2, 64, 16, 300, 13, 1.0),        # a continuing chunk: lower-right causal, 13 rows
    (14, 2, 64, 16, 200, 200, 1.0),      # Qwen2's 7 query heads a KV head
    (2, 2, 32, 8, 50, 50, 1.0),          # head_dim 32: half a 64-dim tile group
    (4, 1, 128, 16, 130, 70, 1.0),       # head_dim 128: two tile groups
    (8, 2, 96, 4, 65, 2, 1.0),           # 96: one and a half groups; keys just past one 64-key block
    (4, 2, 64, 16, 1, 1, 1.0),           # a one-token prompt
    (4, 2, 64, 16, 150, 150, 40.0),      # scores spread over hundreds: probabilities below 2^-126 flushed to 0
])
def test_prefill_attention_in_bf16_products_equals_attention_over_the_bf16_pages(Hq, Hkv, D, S, n, ql, spread,
                                                                                 on, monkeypatch):
    """paged_prefill.c in bf16 products - on AMX tiles (``tiles``) or AVX512-BF16's dot products
    (``dp``: a CPU without tiles, or the tiles switched off) - against fp32 attention over the same
    bf16 K/V and bf16-rounded queries, the chunk's rows at positions n - ql .. n - 1 (lower-right
    causal), read from pages out of order: within what rounding the probabilities to bf16 for the
    P V product allows (torch's bf16 SDPA is measured against the same reference and must not be
    closer)."""
    from engine.kv.pool import KVPool
    if on == "tiles" and not kernels.prefill_tiles():
        pytest.skip("no AMX tiles on this CPU (or the OS refuses them)")
    monkeypatch.setattr(kernels, "PREFILL_TILES", on == "tiles")
    if not _bf16_prefill_runs():
        pytest.skip("no bf16 dot products on this CPU: the torch path runs")
    g = torch.Generator().manual_seed(n * 7 + ql)
    P = (n + S - 1) // S
    pool = KVPool(2, Hkv * D, S, (P + 5) * KVPool.page_bytes_for(2, Hkv * D, S, torch.bfloat16), dtype=torch.bfloat16)
    pages = torch.randperm(pool.num_pages, generator=g)[:P]
    slot = torch.arange(n)
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    pool.store(1, pages[slot // S], slot % S, k, v)
    q = torch.randn(ql, Hq, D, generator=g) * spread
    buf = torch.full((ql + 3, Hq * D + 8), float("nan"))       # a strided view: rows wider than the heads
    out = buf[1:ql + 1, :Hq * D].unflatten(1, (Hq, D))
    calls = kernels.CALLS
    assert kernels.paged_prefill(q, pool, 1, pages, n, Hkv, D ** -0.5, out) and kernels.CALLS == calls + 1
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[ql + 1:]).all() and torch.isnan(buf[1:ql + 1, Hq * D:]).all()
    kb = pool.k(1)[pages].reshape(-1, Hkv, D)[:n].float().transpose(0, 1)[None]
    vb = pool.v(1)[pages].reshape(-1, Hkv, D)[:n].float().transpose(0, 1)[None]
    mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
    qr = q.to(torch.bfloat16).float().transpose(0, 1)[None]
    want = F.scaled_dot_product_attention(qr, kb, vb, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    sdpa_bf16 = F.scaled_dot_product_attention(qr.bfloat16(), kb.bfloat16(), vb.bfloat16(), attn_mask=mask,
                                               scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1).float()
    err = (out - want).abs().max().item()
    assert err <= max(1e-5, (sdpa_bf16 - want).abs().max().item()) and err < 1e-2
    # bf16 queries (a bf16 product's, rotated and rounded by rope_bf16): the same bits out
    out16 = torch.empty_like(out)
    assert kernels.paged_prefill(q.to(torch.bfloat16), pool, 1, pages, n, Hkv, D ** -0.5, out16)
    assert torch.equal(out16, out)


@pytest.mark.parametrize("Hq, Hkv, D, S, n, ql, spread", [
    (4, 2, 64, 16, 100, 100, 1.0),       # a whole prompt: square causal, partial query and key blocks
    (4, 2, 64, 16, 300, 13, 1.0),        # a continuing chunk: lower-right causal, 13 rows
    (4, 2, 64, 16, 1100, 1000, 1.0),     # many 64-key blocks, the costliest query blocks first
    (14, 2, 64, 16, 200, 200, 1.0),      # Qwen2's 7 query heads a KV head
    (2, 2, 32, 8, 50, 50, 1.0),          # head_dim 32: one register block of head dims (AVX-512: two vectors)
    (4, 1, 128, 16, 130, 70, 1.0),       # head_dim 128
    (8, 2, 96, 4, 65, 2, 1.0),           # 96: not a multiple of 64; keys just past one 64-key block
    (2, 1, 256, 16, 90, 90, 1.0),        # 256, the largest
    (3, 3, 16, 16, 40, 40, 1.0),         # 16: one vector (AVX-512) of head dims
    (4, 2, 64, 16, 1, 1, 1.0),           # a one-token prompt
    (4, 2, 64, 16, 150, 150, 40.0),      # scores spread over hundreds: most probabilities 0
])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool_widened"])
def test_prefill_attention_of_an_fp32_pool_equals_fp32_attention(Hq, Hkv, D, S, n, ql, spread, stored):
    """paged_prefill.c's fp32 kernel (vector FMAs, K/V packed out of the records) against attention in
    float64 over the same pages, read out of order, the unused slots of the last page NaN (never read):
    within fp32 rounding - no farther than torch's own fp32 SDPA from it (x4, at least 2e-6) -
    nothing outside the chunk's rows written. A bf16 pool's records with fp32 products (a CPU without
    bf16 products: ``bf16_products=False``) the same, over the stored values widened."""
    from engine.kv.pool import KVPool
    g = torch.Generator().manual_seed(n * 11 + ql + D)
    P = (n + S - 1) // S
    pool = KVPool(3, Hkv * D, S, (P + 5) * KVPool.page_bytes_for(3, Hkv * D, S, stored), dtype=stored)
    pages = torch.randperm(pool.num_pages, generator=g)[:P]
    slot = torch.arange(n)
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    pool.store(1, pages[slot // S], slot % S, k, v)
    k, v = k.to(stored).float(), v.to(stored).float()          # the values as stored
    if n % S:
        pool.k(1)[pages[-1], n % S:] = float("nan")
        pool.v(1)[pages[-1], n % S:] = float("nan")
    q = torch.randn(ql, Hq, D, generator=g) * spread
    buf = torch.full((ql + 3, Hq * D + 8), float("nan"))       # a strided view: rows wider than the heads
    out = buf[1:ql + 1, :Hq * D].unflatten(1, (Hq, D))
    calls = kernels.CALLS
    if not kernels.paged_prefill(q, pool, 1, pages, n, Hkv, D ** -0.5, out, bf16_products=False):
        pytest.skip(f"the fp32 prefill kernel does not run here ({kernels.why_not() or 'neither AVX-512 nor AVX2 with FMA in the build, or head_dim not taken'})")
    assert kernels.CALLS == calls + 1
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[ql + 1:]).all() and torch.isnan(buf[1:ql + 1, Hq * D:]).all()
    mask = torch.arange(n)[None, :] <= torch.arange(n - ql, n)[:, None]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    want = F.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(), attn_mask=mask, scale=D ** -0.5,
                                          enable_gqa=True)[0].transpose(0, 1)
    sdpa = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    err = (out.double() - want).abs().max().item()
    assert err <= max(2e-6, 4 * (sdpa.double() - want).abs().max().item()), err


def test_prefill_attention_declines_what_it_does_not_take_and_writes_nothing():
    from engine.kv.pool import KVPool
    fp32 = KVPool(1, 40, 4, 4 * KVPool.page_bytes_for(1, 40, 4))
    bf16 = KVPool(1, 48, 4, 4 * KVPool.page_bytes_for(1, 48, 4, torch.bfloat16), dtype=torch.bfloat16)
    bf16_20 = KVPool(1, 20, 4, 4 * KVPool.page_bytes_for(1, 20, 4, torch.bfloat16), dtype=torch.bfloat16)
    # head_dim 20 (not a multiple of a vector), in fp32 and widened from bf16; 48 on AMX tiles (not of 32)
    for pool, D, bf16_products in ((fp32, 20, True), (bf16_20, 20, False), (bf16, 48, True)):
        out = torch.full((2, 1, D), 7.0)
        assert not kernels.paged_prefill(torch.randn(2, 1, D), pool, 0, torch.tensor([0]), 2, 1, 1.0, out,
                                         bf16_products=bf16_products)
        assert bool((out == 7.0).all())
    # bf16 queries (rounded for bf16 products) are not taken for fp32 products
    out = torch.full((2, 1, 48), 7.0)
    assert not kernels.paged_prefill(torch.randn(2, 1, 48).bfloat16(), bf16, 0, torch.tensor([0]), 2, 1, 1.0, out,
                                     bf16_products=False)
    assert bool((out == 7.0).all())


@pytest.mark.amx
def test_prefill_attention_leaves_the_threads_tiles_to_torch_as_it_found_them():
    """torch's bf16 SDPA and oneDNN's bf16 products configure AMX tiles per thread too: run before and
    after the kernel on the same threads they give the same numbers (the kernel puts the thread's tile
    configuration back; a palette torch thinks is set but is not would fault or compute garbage)."""
    from engine.kv.pool import KVPool
    if not _bf16_prefill_runs():
        pytest.skip("no bf16 products on this CPU: neither AMX tiles nor AVX512-BF16")
    q, k, v = (torch.randn(1, 4, 300, 64).bfloat16() for _ in range(3))
    a, b = torch.randn(64, 512).bfloat16(), torch.randn(512, 256).bfloat16()
    before = (F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b)
    tiny = torch.tensor([1e-39, 2e-40])             # subnormal: the kernel flushes them on its threads only
    pool = KVPool(1, 128, 16, 24 * KVPool.page_bytes_for(1, 128, 16, torch.bfloat16), dtype=torch.bfloat16)
    for _ in range(3):
        assert kernels.paged_prefill(torch.randn(300, 4, 64), pool, 0, torch.arange(19), 300, 2, 0.125,
                                     torch.empty(300, 4, 64))
        after = (F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b)
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert bool(((tiny * 1.0) == tiny).all()) and float((tiny + 0.0)[0]) > 0       # MXCSR put back


def _decode(pool, layer, q, pages, seq, Hkv, amx: bool, monkeypatch):
    """One native decode call over ``pages`` [B, C] up to ``seq`` [B]: (out, page mass, whether the
    AMX kernel answered)."""
    monkeypatch.setattr(kernels, "DECODE_AMX", amx)
    B, C = pages.shape
    out, pm = torch.full_like(q, float("nan")), torch.full((B + 1, C), float("nan"))
    before = kernels.AMX_DECODES
    assert kernels.paged_decode(q, torch.arange(B), pool, layer, pages, seq, Hkv, q.shape[2] ** -0.5, out, pm,
                                torch.arange(1, B + 1))
    return out, pm[1:], kernels.AMX_DECODES - before == 1


@pytest.mark.amx
@pytest.mark.parametrize("Hq, Hkv, D, S, seq", [
    (4, 2, 64, 16, [3000, 2500, 17, 1]),     # the long workload's shape; a partial tile; one key
    (14, 2, 64, 16, [600, 333, 512]),        # Qwen2's 7 query heads a KV head
    (4, 2, 32, 32, [100, 64, 31]),           # head_dim 32 (one chunk); pages of 32 slots (two tiles)
    (8, 1, 128, 16, [130, 47]),              # 128: two passes over the keys, 64 dims each
    (8, 1, 256, 16, [40]),                   # 256 (DMAX): 8 query heads on one KV head, 2G = 16 tile rows
    (6, 2, 96, 16, [70, 16]),                # 96: a pass of 64 dims and one of 32
])
def test_decode_attention_on_amx_tiles_equals_the_fp32_vector_kernel(Hq, Hkv, D, S, seq, monkeypatch):
    """paged_decode.c's AMX kernel (bf16 products, queries and probabilities split into bf16 hi + lo)
    against its vector kernel (every product in fp32) on the same bf16 pages, read out of order, the
    unused slots of each last page holding NaN: the same outputs and page mass within fp32-level
    error (1e-5), nothing outside the requests' rows written."""
    from engine.kv.pool import KVPool
    g = torch.Generator().manual_seed(sum(seq) + D)
    C = max(-(-n // S) for n in seq)
    pool = KVPool(3, Hkv * D, S, (len(seq) * C + 4) * KVPool.page_bytes_for(3, Hkv * D, S, torch.bfloat16),
                  dtype=torch.bfloat16)
    pool.buf.view(torch.bfloat16)[:] = torch.randn(pool.buf.numel() // pool.esize, generator=g)
    pages = torch.randperm(pool.num_pages, generator=g)[:len(seq) * C].view(len(seq), C)
    for b, n in enumerate(seq):          # whatever a page's unused slots hold is never read
        if n % S:
            pool.k(1)[pages[b, n // S], n % S:] = float("nan")
            pool.v(1)[pages[b, n // S], n % S:] = float("nan")
    q = torch.randn(len(seq), Hq, D, generator=g) * 2
    seq = torch.tensor(seq)
    vec_out, vec_pm, amx = _decode(pool, 1, q, pages, seq, Hkv, False, monkeypatch)
    assert not amx
    out, pm, amx = _decode(pool, 1, q, pages, seq, Hkv, True, monkeypatch)
    if not amx:
        pytest.skip("no AMX tiles on this CPU (or the OS refuses them): the vector kernel runs")
    torch.testing.assert_close(out, vec_out, atol=1e-5, rtol=1e-4)
    measured = torch.arange(C)[None, :] * S < seq[:, None]
    torch.testing.assert_close(pm[measured], vec_pm[measured], atol=1e-6, rtol=1e-4)
    assert torch.isfinite(pm[measured]).all() and torch.equal(pm[~measured], vec_pm[~measured])


def test_decode_attention_declines_to_the_vector_kernel_what_the_tiles_do_not_take(monkeypatch):
    """Pages of 8 slots (a tile is 16 of one page), head_dim 48, 16 query heads on one KV head: the
    AMX kernel writes nothing and the vector kernel answers (the same call succeeds)."""
    from engine.kv.pool import KVPool
    for Hq, Hkv, D, S in ((4, 2, 64, 8), (2, 1, 48, 16), (16, 1, 64, 16)):
        pool = KVPool(1, Hkv * D, S, 6 * KVPool.page_bytes_for(1, Hkv * D, S, torch.bfloat16), dtype=torch.bfloat16)
        pool.buf.view(torch.bfloat16)[:] = torch.randn(pool.buf.numel() // pool.esize)
        q = torch.randn(1, Hq, D)
        out, pm, amx = _decode(pool, 0, q, torch.tensor([[0, 1]]), torch.tensor([S + 3]), Hkv, True, monkeypatch)
        assert not amx and torch.isfinite(out).all() and torch.isfinite(pm).all()
        assert torch.equal(out, _decode(pool, 0, q, torch.tensor([[0, 1]]), torch.tensor([S + 3]), Hkv, False,
                                        monkeypatch)[0])


@pytest.mark.amx
def test_decode_attention_leaves_the_threads_tiles_to_torch_as_it_found_them(monkeypatch):
    """As the prefill kernel: torch's bf16 SDPA and products before and after it on the same threads
    give the same numbers, and the caller's subnormals are not flushed."""
    from engine.kv.pool import KVPool
    q, k, v = (torch.randn(1, 4, 300, 64).bfloat16() for _ in range(3))
    a, b = torch.randn(64, 512).bfloat16(), torch.randn(512, 256).bfloat16()
    before = (F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b)
    tiny = torch.tensor([1e-39, 2e-40])
    pool = KVPool(1, 128, 16, 24 * KVPool.page_bytes_for(1, 128, 16, torch.bfloat16), dtype=torch.bfloat16)
    pool.buf.view(torch.bfloat16)[:] = torch.randn(pool.buf.numel() // pool.esize)
    for _ in range(3):
        _, _, amx = _decode(pool, 0, torch.randn(4, 4, 64), torch.arange(20).view(4, 5), torch.tensor([80, 3, 50, 77]),
                            2, True, monkeypatch)
        if not amx:
            pytest.skip("no AMX tiles on this CPU (or the OS refuses them)")
        after = (F.scaled_dot_product_attention(q, k, v, is_causal=True), a @ b)
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert bool(((tiny * 1.0) == tiny).all()) and float((tiny + 0.0)[0]) > 0


def _python_chain(key: bytes, tokens, prev: int) -> list[int]:
    """The chain's definition, one keyed BLAKE2b per token through hashlib (engine/tags.py's own path)."""
    import hashlib
    import struct
    out = []
    for t in tokens:
        prev = int.from_bytes(hashlib.blake2b(struct.pack("<qi", prev, t), key=key, digest_size=8).digest(),
                              "little", signed=True)
        out.append(prev)
    return out


@pytest.mark.parametrize("keylen", [1, 8, 32, 63, 64])
def test_a_prompt_s_tag_chain_hashed_in_c_is_hashlib_s_tag_for_tag(keylen):
    """tags.c against hashlib: every tag of random prompts (tokens over the whole int32 range, 0, -1,
    the limits), from the seed and from a chain already grown, with keys of every length hashlib takes."""
    from engine.tags import TagChain
    g = torch.Generator().manual_seed(keylen)
    key = bytes(torch.randint(0, 256, (keylen,), generator=g).tolist())
    for n in (8, 9, 300):
        toks = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), generator=g).tolist()
        toks[:4] = [0, -1, 2 ** 31 - 1, -2 ** 31]
        c = TagChain(key)
        c.extend(toks)
        assert c._state is not None and c._state is not False      # the C path ran
        assert c.tags.tolist() == _python_chain(key, toks, c._seed)
        more = torch.randint(0, 150_000, (n,), generator=g).tolist()
        c.extend(more)                                     # grown past its first storage, after the last tag
        c.extend([5])                                      # a decode step's token (Python)
        steps = torch.randint(0, 150_000, (130,), generator=g).tolist()
        for t in steps:                                    # decode steps, past the storage's next growth
            c.append(t)
        want = _python_chain(key, toks + more + [5] + steps, c._seed)
        assert c.tags.tolist() == want and c.array().tolist() == want and c._last == want[-1]


def test_a_tag_chain_falls_back_to_python_where_c_cannot_hash():
    """A token outside int32 is hashlib's to refuse (struct.error, as before tags.c); too few tokens
    to pay for a call, and a key hashlib refuses, never reach C."""
    import struct
    from engine.tags import TagChain
    c = TagChain(b"k" * 32)
    with pytest.raises(struct.error):
        c.extend([1] * 10 + [2 ** 31])
    c = TagChain(b"k" * 32)
    c.extend(list(range(TagChain.NATIVE_FROM - 1)))
    assert c._state is False and c.tags.tolist() == _python_chain(b"k" * 32, range(TagChain.NATIVE_FROM - 1), c._seed)
    assert kernels.tag_key_state(b"") is None and kernels.tag_key_state(b"x" * 65) is None


@pytest.mark.parametrize("pool_dtype, row_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_a_layer_s_kv_stored_in_one_native_call_writes_the_bytes_torch_s_path_writes(pool_dtype, row_dtype):
    """KVPool.store through kvl_store_kv against torch's index_puts, two pools byte for byte: every
    layer's K and V (rows sliced out of a wider qkv, [n, H, D] views, as the engine hands them), the tag
    plane and write counters at layer 0, a bf16 pool rounding fp32 rows as .to(bfloat16) does; an fp32
    pool given bf16 rows is torch's; a slot outside the pool writes nothing natively and torch raises."""
    from engine.kv.pool import KVPool
    L, Hkv, D, S, n = 3, 2, 64, 16, 37
    pools = [KVPool(L, Hkv * D, S, 20 * KVPool.page_bytes_for(L, Hkv * D, S, pool_dtype), dtype=pool_dtype)
             for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(20 * S, generator=g)[:n]
    pages, offs = slots // S, slots % S
    tags, writers = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=g), torch.randint(0, 1 << 40, (n,), generator=g)
    for layer in range(L):
        qkv = torch.randn(n, 6 * Hkv * D, generator=g).to(row_dtype)
        k, v = qkv[:, 2 * Hkv * D:3 * Hkv * D].view(n, Hkv, D), qkv[:, 4 * Hkv * D:5 * Hkv * D]
        t, w = (tags, writers) if layer == 0 else (None, None)
        native_ran = kernels.store_kv(pools[0], layer, pages, offs, k, v, t, w)
        assert native_ran == (row_dtype == torch.float32 or pool_dtype == torch.bfloat16)
        if not native_ran:
            pools[0].store(layer, pages, offs, k, v, t, w)
        lib, kernels._lib = kernels._lib, None           # the torch path
        try:
            pools[1].store(layer, pages, offs, k, v, t, w)
        finally:
            kernels._lib = lib
    assert torch.equal(pools[0].buf, pools[1].buf) and torch.equal(pools[0].write_seq, pools[1].write_seq)
    assert pools[0].write_seq.sum() == n and torch.equal(pools[0].tags[pages, offs], tags)
    bad = pages.clone()
    bad[-1] = pools[0].num_pages                          # past the pool
    before = pools[0].buf.clone()
    assert not kernels.store_kv(pools[0], 1, bad, offs, k, v, None, None) and torch.equal(pools[0].buf, before)
    with pytest.raises(IndexError):
        pools[0].store(1, bad, offs, k, v)
