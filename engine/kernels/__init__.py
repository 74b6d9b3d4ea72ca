"""Native CPU kernels, compiled on first use with the machine's C compiler and loaded with ctypes.

``paged_decode`` (paged_decode.c) is decode attention read straight out of the pool's page records:
torch's path gathers every page of every request into a contiguous copy per KV head and layer
(``index_select``, 17 % of a tiny model's step in bench/engine.py's profile) and runs a dozen small
ops around it; the kernel is one call per layer, no copy. The torch path stays the reference and the
fallback: no compiler, a failed build, ``KVLEDGER_NATIVE=0``, a pool that is neither fp32 nor bf16
on the CPU. A bf16 pool or weight (``--dtype bfloat16``: half the bytes) is widened to fp32 as the
kernels load it; every product and sum is fp32, and new K/V rows are rounded to bf16 as torch's
``.to(torch.bfloat16)`` rounds them. A bf16 pool's decode runs on AMX tiles where the CPU has them
(``kvl_paged_decode_bf16_amx``: queries and probabilities split into bf16 hi + lo, so the products
keep fp32 accuracy; 1.1-1.8x the vector kernel a step, bench/decode_attention.py); else, or for a shape
the tiles do not take (pages not a multiple of 16 slots, head_dim not a multiple of 32 or above 256,
more than 8 query heads a KV head), the vector one.
``paged_prefill`` (paged_prefill.c) is a prefill chunk's attention: a bf16 pool's in bf16 products (as
SDPA's bf16 path) on AMX tiles where the CPU has them, else on AVX512-BF16's VDPBF16PS where it has
that (an AMD EPYC of the Zen 4 kind), an fp32 pool's on AVX-512 FMAs (fp32 products:
1.3-2.1x SDPA, bench/prefill_attention.py) or, on a CPU without AVX-512, AVX2's (1.1-2.5x SDPA on an
AMD EPYC); K/V read from the records, no gather into the engine's
tensors, no mask tensor. Where it declines torch's SDPA runs.
``add_rms_norm``, ``silu_mul`` and ``rope`` (dense.c) are a decoder layer's small ops, one pass each
where torch runs three to six ops with a dispatch each; None from them means "run torch's".
``read_check`` (dense.c) is the read check of engine/attention.py in one pass (numpy's dozen
array operations cost ~200 us a step on the tiny model); ``kvl_fold_reads`` (read_runs.c) is the page
ledger's read-run fold (telemetry/ledger.py ``ReadRuns``) on the store writer's thread, ``kvl_index_reads`` the
exposure index's holdings and failing cells of a fold. ``tag_key_state`` and ``tag_chain`` (tags.c) are a
prompt's content-tag chain (engine/tags.py), keyed BLAKE2b in C. ``linear`` (dense.c) is a projection of a few rows (a decode step's), on a weight laid out by
``pack_rows`` at load: oneDNN's per-call cost is most of such a call's time.

The shared object is cached under ``$KVLEDGER_CACHE`` (default ``~/.cache/kvledger``), keyed by
the source, the flags and the CPU's feature flags (``-march=native``); it is built into a temporary
name and renamed into place, so concurrent first uses (test workers) never load a half-written file.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

_SRCS = [Path(__file__).with_name(n) for n in ("paged_decode.c", "paged_prefill.c", "dense.c", "linear_amx.c",
                                                "read_runs.c", "tags.c")]
_HDRS = [Path(__file__).with_name(n) for n in ("vexp.h", "amx.h", "bf16.h")]     # included: part of the build's cache key
# gnu11, not c11: ISO mode turns off floating-point contraction, i.e. every FMA
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_lib: ctypes.CDLL | None = None
_why_not: str | None = None     # why the native path is off (None: not tried yet, or on)
_tried = False
CALLS = 0                       # successful native calls (tests tell the kernel ran)
AMX_DECODES = 0                 # bf16 decode calls the AMX kernel answered (paged_decode.c)
PREFILL_TILES = True            # a bf16 prefill's products on AMX tiles where they run, else VDPBF16PS (tests switch it off)
DECODE_AMX = True               # try it first (tests and benches switch it off to compare with the vector kernel)
# the stored element types the kernels read (pool K/V, packed weights): each kernel's variant by name
STORED = {torch.float32: "_f32", torch.bfloat16: "_bf16"}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels built (once: kept under the cache by a hash of the sources, flags and CPU) and
    loaded. ``defines``: extra -D flags, for benches that time a kernel's compile-time variants side by
    side (bench/decode_prefetch.py); the engine loads the build without them."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc) on PATH")
    flags = [*_FLAGS, *(f"-D{d}" for d in defines)]
    src = b"".join(p.read_bytes() for p in _SRCS + _HDRS)
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_flags().encode() + platform.machine().encode())
    cache = Path(os.environ.get("KVLEDGER_CACHE") or Path.home() / ".cache" / "kvledger") / "kernels"
    so = cache / f"paged_decode-{key.hexdigest()[:16]}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, *map(str, _SRCS), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise OSError(f"{cc} failed: {r.stderr.strip()[:300]}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    i64, p = ctypes.c_int64, ctypes.c_void_p
    f32 = ctypes.c_float
    decode = [p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, f32, p, i64, p, p, p, i64, ctypes.c_int]
    store = [p, p, p, i64, i64, i64, i64, i64, i64, p, i64, p, i64, i64, p, p, p, i64, i64, ctypes.c_int]
    lin = [p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int]
    for name, args in (("kvl_paged_decode_f32", decode), ("kvl_paged_decode_bf16", decode),
                       ("kvl_paged_decode_bf16_amx", decode),
                       ("kvl_add_rms_norm_f32", [p, i64, p, i64, p, p, i64, i64, i64, f32, ctypes.c_int]),
                       ("kvl_add_rms_norm_mixed", [p, i64, p, i64, p, p, i64, i64, i64, f32, ctypes.c_int,
                                                   ctypes.c_int, ctypes.c_int]),
                       ("kvl_silu_mul_f32", [p, i64, p, i64, i64, i64, ctypes.c_int]),
                       ("kvl_silu_mul_bf16", [p, i64, p, i64, i64, i64, ctypes.c_int]),
                       ("kvl_rope_f32", [p, i64, i64, i64, p, p, i64, ctypes.c_int]),
                       ("kvl_rope_bf16", [p, i64, i64, i64, p, p, i64, p, i64, ctypes.c_int]),
                       ("kvl_store_kv_f32", store), ("kvl_store_kv_bf16", store), ("kvl_store_kv_b16", store),
                       ("kvl_linear_f32", lin), ("kvl_linear_bf16", lin)):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    for name in ("kvl_paged_prefill_bf16", "kvl_paged_prefill_bf16q", "kvl_paged_prefill_bf16_dp",
                 "kvl_paged_prefill_bf16q_dp", "kvl_paged_prefill_f32", "kvl_paged_prefill_f32b"):
        getattr(lib, name).argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, i64, i64, i64, i64, i64, f32, p, i64,
                                       ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.kvl_prefill_tiles.argtypes = []
    lib.kvl_prefill_tiles.restype = ctypes.c_int
    lib.kvl_linear_bf16_amx.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int]
    lib.kvl_linear_bf16_amx.restype = ctypes.c_int
    lib.kvl_read_check.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64, i64, i64, p, p, p, p, p]
    lib.kvl_read_check.restype = i64
    lib.kvl_fold_reads.argtypes = [i64, p, p, p, p, p, p, p, p, p, p, p, p, p, i64, i64, i64, p, p, p, p, p, p, p, i64]
    lib.kvl_fold_reads.restype = i64
    lib.kvl_index_reads.argtypes = [i64, p, p, p, p, p, p, p, p, p, i64]
    lib.kvl_index_reads.restype = i64
    lib.kvl_blake2b_key_state.argtypes = [ctypes.c_char_p, i64, i64, p]
    lib.kvl_blake2b_key_state.restype = ctypes.c_int
    lib.kvl_tag_chain.argtypes = [p, i64, p, i64, p]
    lib.kvl_tag_chain.restype = None
    return lib


def native() -> ctypes.CDLL | None:
    """The loaded kernels, or None (``why_not()`` says why)."""
    global _lib, _why_not, _tried
    if not _tried:
        _tried = True
        if os.environ.get("KVLEDGER_NATIVE", "1") == "0":
            _why_not = "KVLEDGER_NATIVE=0"
        else:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                _why_not = f"native kernels unavailable ({e}); the torch path runs"
    return _lib


def tag_key_state(key: bytes, digest_size: int = 8) -> np.ndarray | None:
    """The keyed BLAKE2b state after ``key``'s block (8 uint64 words; tags.c), or None: no kernels,
    or a key hashlib would refuse too (the Python path runs and says so)."""
    lib = native()
    if lib is None:
        return None
    st = np.empty(8, dtype=np.uint64)
    if lib.kvl_blake2b_key_state(key, len(key), digest_size, st.ctypes.data) != 0:
        return None
    return st


def tag_chain(state: np.ndarray, prev: int, tokens: np.ndarray, out: torch.Tensor) -> None:
    """out[i] = the tag of tokens[i] (int32, contiguous) chained after prev; out an int64 tensor
    of len(tokens), contiguous (a chain's own storage)."""
    lib = native()
    assert lib is not None and tokens.dtype == np.int32 and tokens.flags.c_contiguous and out.is_contiguous()
    assert out.dtype == torch.int64 and out.numel() == len(tokens)
    lib.kvl_tag_chain(state.ctypes.data, prev, tokens.ctypes.data, len(tokens), out.data_ptr())


def why_not() -> str | None:
    native()
    return _why_not


def prefill_tiles() -> bool:
    """Whether a bf16 prefill in bf16 products runs on AMX tiles here (built for them, and the OS
    grants the tile state); where not, it runs on AVX512-BF16's dot products, or nowhere."""
    lib = native()
    return lib is not None and lib.kvl_prefill_tiles() == 1


def paged_decode(q: torch.Tensor, toks: torch.Tensor, pool, layer: int, pages: torch.Tensor, seq_lens: torch.Tensor,
                 num_kv_heads: int, scale: float, out: torch.Tensor, page_mass: torch.Tensor,
                 rows: torch.Tensor) -> bool:
    """Decode attention of the requests whose query tokens are ``toks`` (rows of q and out, [T, Hq, D]),
    over ``pages`` [Bd, Cd] up to ``seq_lens`` [Bd]; page mass written into page_mass[rows, :Cd].
    False (nothing written) when the native path cannot run this call."""
    lib = native()
    if (lib is None or pool.dtype not in STORED or not pool.buf.is_cpu or q.dtype != torch.float32
            or q.stride(2) != 1 or q.stride(1) != q.shape[2] or not out.is_contiguous()
            or page_mass.dtype != torch.float32 or page_mass.stride(1) != 1):
        return False
    T, Hq, D = q.shape
    Bd, Cd = pages.shape
    k, v = pool.k(layer), pool.v(layer)          # [P, S, kv_dim] strided views into the records
    pages, seq_lens = pages.contiguous(), seq_lens.contiguous()
    toks, rows = toks.contiguous(), rows.contiguous()
    part = torch.empty(Bd * num_kv_heads * max(Cd, 1), dtype=torch.float32)
    args = (q.data_ptr(), q.stride(0), toks.data_ptr(), k.untyped_storage().data_ptr(), pages.data_ptr(),
            seq_lens.data_ptr(), Bd, Cd, pool.page_size, Hq, num_kv_heads, D, k.stride(0), k.stride(1),
            k.storage_offset(), v.storage_offset(), scale, out.data_ptr(), out.stride(0), part.data_ptr(),
            page_mass.data_ptr(), rows.data_ptr(), page_mass.stride(0), torch.get_num_threads())
    global AMX_DECODES
    rc = -1
    if pool.dtype == torch.bfloat16 and DECODE_AMX:     # AMX tiles where they run (-1: not here, not this shape)
        rc = lib.kvl_paged_decode_bf16_amx(*args)
        AMX_DECODES += rc == 0
    if rc == -1:
        rc = getattr(lib, "kvl_paged_decode" + STORED[pool.dtype])(*args)
    if rc != 0:
        return False
    global CALLS
    CALLS += 1
    return True


def paged_prefill(q: torch.Tensor, pool, layer: int, pages: torch.Tensor, n: int, num_kv_heads: int,
                  scale: float, out: torch.Tensor, bf16_products: bool = True) -> bool:
    """Attention of one prefill chunk (paged_prefill.c): q [ql, Hq, D] fp32 (the chunk's rows: any row
    stride, heads adjacent; with a bf16 pool also bf16 - queries rounded already, as the kernel rounds
    them), its queries at positions n - ql .. n - 1 of a request whose n keys are on ``pages``; out [ql, Hq, D] fp32 likewise. A bf16 pool's in bf16 products (as
    SDPA's bf16 path) on AMX tiles, or AVX512-BF16's dot products where there are no tiles (or with
    PREFILL_TILES off) - or, with ``bf16_products`` False and fp32 q, on vector FMAs in fp32 over its
    values widened (SDPA's fp32 path after the gather: a CPU without bf16 products); an fp32 pool's on
    vector FMAs (every product in fp32). False (nothing written) when the native path cannot run this call."""
    lib = native()
    bf16q = q.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16     # rounded already (rope_bf16)
    widen = pool.dtype == torch.bfloat16 and not bf16_products
    if (lib is None or pool.dtype not in STORED or not pool.buf.is_cpu or (q.dtype != torch.float32 and not bf16q)
            or (widen and bf16q)
            or out.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != q.shape[2]
            or out.stride(2) != 1 or out.stride(1) != out.shape[2] or pages.dtype != torch.long):
        return False
    ql, Hq, D = q.shape
    k = pool.k(layer)
    pages = pages.contiguous()
    name = "kvl_paged_prefill" + ("_bf16q" if bf16q else "_f32b" if widen else STORED[pool.dtype])
    if pool.dtype == torch.bfloat16 and not widen and not PREFILL_TILES:
        name += "_dp"
    rc = getattr(lib, name)(
        q.data_ptr(), q.stride(0), ql, n, k.untyped_storage().data_ptr(), pages.data_ptr(), pool.page_size, Hq,
        num_kv_heads, D, k.stride(0), k.stride(1), k.storage_offset(), pool.v(layer).storage_offset(), scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc != 0:
        return False
    global CALLS
    CALLS += 1
    return True


def _rows_ok(*ts: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """fp32 (``dtype``) CPU tensors of 2-D rows, each row contiguous (any row stride). (Called several
    times a layer: written with the cheapest attribute reads, ``is_cpu`` not ``device.type``.)"""
    for t in ts:
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride()[1] != 1:
            return False
    return True


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """rms_norm(x) * w, or with ``residual``: residual += x in place, then rms_norm(residual) * w
    (x, residual [T, H]; residual fp32). x fp32 or bf16 (a bf16 product's result, widened as it is
    read); the result fp32 or ``out_dtype`` bf16 (rounded once, as a bf16 product rounds its input).
    None: not run (torch's ops are the caller's)."""
    lib = native()
    xb, ob = x.dtype == torch.bfloat16, out_dtype == torch.bfloat16
    if (lib is None or not (_rows_ok(x) or (xb and x.is_cpu and x.dim() == 2 and x.stride()[1] == 1))
            or (residual is not None and not _rows_ok(residual)) or out_dtype not in STORED
            or w.dtype != torch.float32 or not w.is_cpu or w.dim() != 1 or not w.is_contiguous()):
        return None
    T, H = x.shape
    out = torch.empty(T, H, dtype=out_dtype)
    args = (x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), w.data_ptr(), out.data_ptr(), H, T, H, eps,
            torch.get_num_threads())
    if xb or ob:
        lib.kvl_add_rms_norm_mixed(*args, int(xb), int(ob))
    else:
        lib.kvl_add_rms_norm_f32(*args)
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of rows [gate | up] ([T, 2I] -> [T, I]), fp32 or bf16 rows (the result in
    the same type; bf16: computed in fp32, rounded once); None: not run."""
    lib = native()
    bf16 = gu.dtype == torch.bfloat16
    if lib is None or not (_rows_ok(gu) or (bf16 and gu.is_cpu and gu.dim() == 2 and gu.stride(1) == 1)):
        return None
    T, I2 = gu.shape
    out = torch.empty(T, I2 // 2, dtype=gu.dtype)
    getattr(lib, "kvl_silu_mul" + STORED[gu.dtype])(gu.data_ptr(), gu.stride(0), out.data_ptr(), I2 // 2, T, I2 // 2,
                                                   torch.get_num_threads())
    return out


def rope(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate-half RoPE in place on the first ``heads`` heads of each row of x ([T, >= heads * D]),
    cos and sin [T, D / 2]. False: not run."""
    lib = native()
    if lib is None or not _rows_ok(x, cos, sin) or not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    lib.kvl_rope_f32(x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), x.shape[0],
                     torch.get_num_threads())
    return True


def rope_bf16(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor) -> bool:
    """``rope``'s rotation of the first ``heads`` heads of bf16 rows x ([T, >= heads * D]) into bf16
    rows out ([T, >= heads * D]), x untouched: fp32 arithmetic, each result rounded to bf16 once -
    bit for bit ``rope`` on x widened, then rounded. False: not run."""
    lib = native()
    if (lib is None or not _rows_ok(cos, sin) or not (cos.is_contiguous() and sin.is_contiguous())
            or not _rows_ok(x, out, dtype=torch.bfloat16) or out.shape[0] != x.shape[0]
            or min(x.shape[1], out.shape[1]) < heads * head_dim):
        return False
    lib.kvl_rope_bf16(x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), x.shape[0],
                      out.data_ptr(), out.stride(0), torch.get_num_threads())
    return True


def _kv_rows(t: torch.Tensor, n: int, width: int) -> int | None:
    """The row stride of a step's K or V rows for the pool ([n, width], or [n, H, D] with adjacent
    heads; each row contiguous), or None."""
    if t.dim() == 3:
        return t.stride(0) if t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.shape[1] * t.shape[2] == width \
            and t.shape[0] == n else None
    return t.stride(0) if t.dim() == 2 and t.stride(1) == 1 and t.shape == (n, width) else None


def store_kv(pool, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             tags: torch.Tensor | None, writers: torch.Tensor | None) -> bool:
    """``KVPool.store`` in one native call (dense.c kvl_store_kv_*): the layer's K and V rows into
    their slots (fp32, rounded into a bf16 pool, or bf16 rows into a bf16 pool), with ``tags`` and
    ``writers`` the tag plane, at layer 0 the slots' write counters. False: not run (nothing
    written; the caller's path)."""
    lib = native()
    n = pages.shape[0]
    if lib is None or not 0 <= layer < pool.num_layers or (tags is None) != (writers is None) or pages.dim() != 1 \
            or offsets.dim() != 1 \
            or not pool.buf.is_cpu or pool.dtype not in STORED or k.dtype != v.dtype or not k.is_cpu \
            or not v.is_cpu or pages.dtype != torch.long or offsets.dtype != torch.long or offsets.shape[0] != n:
        return False
    b16 = k.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    if not (b16 or k.dtype == torch.float32):
        return False
    ks, vs = _kv_rows(k, n, pool.kv_dim), _kv_rows(v, n, pool.kv_dim)
    if ks is None or vs is None:
        return False
    if layer == 0 and not (pool.write_seq.is_contiguous() and pool.write_seq.is_cpu):
        return False
    if tags is not None:
        if tags.dtype != torch.long or writers.dtype != torch.long or tags.shape != (n,) or writers.shape != (n,):
            return False
        tags, writers = tags.contiguous(), writers.contiguous()
    pages, offsets = pages.contiguous(), offsets.contiguous()
    e = pool.esize
    return 0 == getattr(lib, "kvl_store_kv" + ("_b16" if b16 else STORED[pool.dtype]))(
        pool.buf.data_ptr(), pages.data_ptr(), offsets.data_ptr(), n, pool.page_bytes, pool.HDR, pool.rec_bytes,
        pool.TAG_BYTES + layer * pool.kv_dim * e, pool.TAG_BYTES + (pool.num_layers + layer) * pool.kv_dim * e,
        k.data_ptr(), ks, v.data_ptr(), vs, pool.kv_dim, None if tags is None else tags.data_ptr(),
        None if tags is None else writers.data_ptr(), pool.write_seq.data_ptr() if layer == 0 else None,
        pool.num_pages, pool.page_size, torch.get_num_threads())


ROW_BLOCK = 16      # output columns per packed block (NB in dense.c)


def pack_rows(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] (fp32 or bf16, kept so) laid out for ``linear``: blocks of ROW_BLOCK output columns,
    each [K, ROW_BLOCK] contiguous, zero-padded past N. None where the native kernels do not run."""
    if native() is None or w.dtype not in STORED or w.device.type != "cpu" or w.dim() != 2:
        return None
    N, K = w.shape
    blocks = -(-N // ROW_BLOCK)
    padded = torch.zeros(blocks * ROW_BLOCK, K, dtype=w.dtype)
    padded[:N] = w
    return padded.view(blocks, ROW_BLOCK, K).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ w.T + bias for x [M, K] (rows contiguous, fp32) and w packed by ``pack_rows`` ([N, K],
    N = n; fp32 or bf16). None: not run (the caller's other path runs)."""
    lib = _lib
    if lib is None or x.stride(-1) != 1 or x.dtype != torch.float32:
        return None
    M, K = x.shape
    out = torch.empty(M, n)
    getattr(lib, "kvl_linear" + STORED[packed.dtype])(
        x.data_ptr(), x.stride(0), M, K, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
        out.data_ptr(), n, torch.get_num_threads())
    return out


TILE_ROWS = 16     # rows linear_tiles takes at most (an AMX tile's)


def pack_tiles(w: torch.Tensor) -> torch.Tensor | None:
    """A bf16 w [N, K] laid out for ``linear_tiles`` (linear_amx.c): blocks of 16 output columns, each
    [K / 2][16][2] - TDPBF16PS's B operand - zero-padded past N. None where that kernel cannot take it
    (no native kernels, not bf16, K not a multiple of 32, no AMX tiles in this build or process)."""
    if native() is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] % 32:
        return None
    N, K = w.shape
    blocks = -(-N // 16)
    padded = torch.zeros(blocks * 16, K, dtype=w.dtype)
    padded[:N] = w
    packed = padded.view(blocks, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()
    probe = torch.zeros(1, K, dtype=torch.bfloat16)
    return packed if linear_tiles(probe, packed, 1, None) is not None else None


def linear_tiles(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ w.T + bias on AMX tiles for x [M <= TILE_ROWS, K] bf16 (rows contiguous) and w packed by
    ``pack_tiles`` (n columns), bias bf16: fp32 sums, the result bf16 [M, n] rounded once - oneDNN's
    bf16 product's numbers. None: not run (the caller's oneDNN path runs)."""
    lib = _lib
    M, K = x.shape
    if (lib is None or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or not 0 < M <= TILE_ROWS
            or packed.shape[1] * 2 != K):
        return None
    out = torch.empty(M, n, dtype=torch.bfloat16)
    rc = lib.kvl_linear_bf16_amx(x.data_ptr(), x.stride(0), M, K, packed.data_ptr(), n,
                                 None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out if rc == 0 else None


def read_check(pool, block_tables: torch.Tensor, seq_lens: torch.Tensor, expected_gen: torch.Tensor,
               expected_tags: torch.Tensor) -> tuple | None:
    """The read check's fields (bad_slots, slots_read, found_writers, found_gen, bad_mask, failed
    slot count) for a CPU pool, or None (not run: the caller's numpy path runs)."""
    lib = native()
    gen, tags, writers = pool.generation, pool.tags, pool.writers
    B, C = block_tables.shape
    S = pool.page_size
    if lib is None or not gen.is_cpu or S > 63 or tags.stride() != writers.stride():
        return None
    bt, seq = block_tables.contiguous(), seq_lens.contiguous()
    eg, et = expected_gen.contiguous(), expected_tags.contiguous()
    i64 = torch.int64
    if bt.dtype != i64 or seq.dtype != i64 or eg.dtype != i64 or et.dtype != i64:
        return None
    BC = B * C
    out = np.empty((4 + S) * BC, np.int64)           # one buffer, numpy views (torch's cost 3-8 us each)
    at = out.ctypes.data
    base = gen.storage_offset()
    failed = lib.kvl_read_check(gen.untyped_storage().data_ptr() + 8 * base, gen.stride(0), tags.stride(1),
                                tags.storage_offset() - base, writers.storage_offset() - base, bt.data_ptr(),
                                seq.data_ptr(), eg.data_ptr(), et.data_ptr(), B, C, S, at, at + 8 * BC,
                                at + 16 * BC, at + 24 * BC, at + 32 * BC)
    t, v = torch.from_numpy, out[:4 * BC].reshape(4, B, C)
    bad, slots, found_gen, mask, found_writers = t(v[0]), t(v[1]), t(v[2]), t(v[3]), t(out[4 * BC:].reshape(B, C, S))
    return bad, slots, found_writers, found_gen, mask, failed
