"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU; Qwen2 qkv bias)
loading an HF-format directory. Attention goes through the paged pool via ``StepContext``."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from engine import kernels
from engine.config import decode_path
from engine.errors import ModelLoadError
from engine.attention import bf16_prefill_widened
from engine.step import StepContext


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    model_type: str
    eos_token_id: int | None

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        mt = d.get("model_type", "llama")
        if mt not in ("llama", "qwen2", "mistral"):
            raise ModelLoadError(f"model_type {mt!r} is not a Llama-family decoder (llama, qwen2, mistral)")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        if (rope.get("rope_type", "default") != "default") or (scaling and scaling.get("rope_type", "default") != "default"):
            raise ModelLoadError("only default RoPE is supported; this checkpoint uses rope scaling")
        try:
            heads = d["num_attention_heads"]
            eos = d.get("eos_token_id")
            return cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"], num_heads=heads,
                num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                qkv_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
                max_position_embeddings=d.get("max_position_embeddings", 2048), model_type=mt,
                eos_token_id=eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:        # the fused op: the same numbers, fewer passes
        return F.rms_norm(x, w.shape, w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rms_norm(x) * w; with ``residual`` (fp32): residual += x (in place), then rms_norm(residual) * w -
    one native pass (engine/kernels) where it runs, else torch's ops. x fp32 or bf16 (a bf16 product's
    result); the result in ``out_dtype`` (bf16: the next product's input where it runs in bf16)."""
    out = kernels.add_rms_norm(x, w, eps, residual, out_dtype)
    if out is not None:
        return out
    if residual is not None:
        residual += x
        x = residual
    return rms_norm(x, w, eps).to(out_dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up], in their type (fp32, or bf16 computed in fp32)."""
    out = kernels.silu_mul(gate_up)
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        if gate_up.dtype == torch.bfloat16:      # as the kernel: in fp32, rounded once
            return (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
        out = F.silu(gate) * up
    return out


_INV_FREQ: dict[tuple[int, float], torch.Tensor] = {}


def rope_freqs(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The rotation angle of each (position, frequency), [T, D/2]: computed once per step (the
    inverse frequencies once per model shape)."""
    inv = _INV_FREQ.get((head_dim, theta))
    if inv is None:
        inv = _INV_FREQ[(head_dim, theta)] = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                                              / head_dim))
    return positions.float()[:, None] * inv[None, :]


def rope_full(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, D] in the rotate-half layout (torch's rope below)."""
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :].to(dtype), emb.sin()[:, None, :].to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin for each position, [T, 1, D]: computed once per step, used by every layer."""
    return rope_full(rope_freqs(positions, head_dim, theta), dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF-convention RoPE (rotate_half pairs (i, i + D/2)). x: [T, H, D]."""
    D = x.shape[-1]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


PACK_ROWS = 32      # the row count oneDNN's weight layout is chosen for (vLLM-CPU's choice too)
# a bf16 weight's products of up to this many rows run in the native kernel (widening the weight as it
# loads it: at 64 rows of the big shape's gate_up 31 ms against 63 for an fp32 copy through F.linear);
# more rows get the fp32 copy and F.linear (512 rows: 170 ms against the kernel's 254)
BF16_KERNEL_ROWS = 64
BF16_GEMM_CALLS = 0     # products run in bf16 (tests tell that path ran)
# with bf16 products (bf16_gemm) a weight of fewer values keeps the native kernel for decode rows: at 8
# rows oneDNN's bf16 product is faster on the big shape's weights (896 x 896 and up: 33 against 53 us on
# an AMX CPU, 2-4x on an AVX512-BF16 one) and slower on the tiny model's (1024 x 256: 26 against 21 us,
# 512 x 256: 26 against 13 - measured 2026-12-05 with the kernel's broadcast fixed; 2^18 before it, where
# 1024 x 256 was about even; tiny bf16 1.13x engine alone from moving its gate_up to the kernel)
BF16_ONEDNN_MIN_WEIGHT = 1 << 19


def bf16_gemm() -> bool:
    """Whether a bf16 weight's prefill-sized products (more than BF16_KERNEL_ROWS rows) run in bf16
    through oneDNN - activations rounded to bf16, fp32 accumulation, bf16 results, as vLLM-CPU and
    transformers run bf16 - rather than on an fp32 copy of the weight: where the CPU has bf16
    dot-product instructions (AVX512-BF16 or AMX), on which that product is about twice as fast as
    fp32's (on an AVX2-only CPU torch's bf16 product is several times slower than fp32's).
    ``KVLEDGER_BF16_GEMM=1`` / ``0`` forces it on / off (tests run both paths on any CPU)."""
    import os
    env = os.environ.get("KVLEDGER_BF16_GEMM")
    if env in ("0", "1"):
        return env == "1"
    cpu = getattr(torch, "cpu", None)
    return bool(cpu is not None and (getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                                     or getattr(cpu, "_is_amx_tile_supported", lambda: False)()))


_ONEDNN_BF16: bool | None = None


def onednn_bf16() -> bool:
    """Whether torch's oneDNN takes a bf16 weight prepacked (it needs avx512bw/vl/dq or
    avx_ne_convert: on an AVX2-only CPU - or ``ONEDNN_MAX_CPU_ISA=AVX2`` - it refuses, and bf16
    products forced on there (``KVLEDGER_BF16_GEMM=1``) run through F.linear). Tried once."""
    global _ONEDNN_BF16
    if _ONEDNN_BF16 is None:
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_ROWS)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=torch.bfloat16), w, None, "none", [], "")
            _ONEDNN_BF16 = True
        except (RuntimeError, AttributeError):
            _ONEDNN_BF16 = False
    return _ONEDNN_BF16


def decode_tiles() -> bool:
    """Whether a big bf16 weight with bf16 products also keeps a copy packed as AMX tiles for decode
    rows (engine/kernels/linear_amx.c; ``KVLEDGER_DECODE_TILES=0`` turns it off: one copy of each such
    weight, oneDNN's, and decode rows through oneDNN)."""
    import os
    return os.environ.get("KVLEDGER_DECODE_TILES", "1") != "0"


def packing_available() -> bool:
    """Whether weights are prepacked for oneDNN (torch built with it; ``KVLEDGER_ONEDNN=0`` turns it off)."""
    import os
    return (os.environ.get("KVLEDGER_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


FEW_ROWS = 16            # decode rows the native kernel may take (from 16 rows up oneDNN's blocking wins)
FEW_ROWS_WEIGHT = 1 << 21   # weights of up to this many values always take them through it


def few_rows(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] x [k, n] product goes to the native few-rows kernel rather than oneDNN by
    the static rule: at decode sizes on a small weight oneDNN's per-call cost is most of the call
    (bench/engine.py's ``decode_projections``: the tiny model's projections at 8 rows took ~0.5-0.7x
    oneDNN's time through the kernel on every CPU measured). A bigger weight's decode rows are
    decided by timing both on this CPU (``kernel_decodes_faster``): its memory traffic sets both, and
    which is faster depends on the CPU and the thread count."""
    return m <= FEW_ROWS and n * k <= FEW_ROWS_WEIGHT


_DECODE_CHOICE: dict[tuple[int, int, bool, int, str], bool] = {}     # (n, k, bias, threads, path) -> kernel
CALIBRATE_ROWS, CALIBRATE_CALLS = 8, 9


def kernel_decodes_faster(rows: torch.Tensor, onednn: torch.Tensor, n: int, k: int,
                          bias: torch.Tensor | None) -> bool:
    """Whether the native kernel runs a decode step's rows of a weight of more than FEW_ROWS_WEIGHT
    values faster than oneDNN's prepacked product, timed once per shape and torch thread count in
    this process (CALIBRATE_CALLS interleaved calls of CALIBRATE_ROWS rows each, medians; the big
    shape's load at one thread 0.2-0.3 s longer). The static rule had oneDNN take all of them
    (measured where it was set, an AVX-512 CPU at 2 threads: 0.95-1.0x), but bench/engine.py's
    ``decode_projections`` found the kernel 1.1-1.3x faster on them on an AVX2-only CPU at 1 and 2
    threads and 1.05-1.23x on the AVX-512 one at 2 - and oneDNN 1.24x and 1.37x faster on two of
    them there at 1 thread. The two give the same product to float rounding. ``KVLEDGER_DECODE_KERNEL``
    = ``kernel`` or ``onednn`` pins the path, untimed (``engine.config.decode_path``)."""
    path = decode_path()
    key = (n, k, bias is not None, torch.get_num_threads(), path)
    if key not in _DECODE_CHOICE:
        x = torch.randn(CALIBRATE_ROWS, k)
        if path == "onednn" or kernels.linear(x, rows, n, bias) is None:    # pinned, or the kernel declines
            _DECODE_CHOICE[key] = False
            return False
        if path == "kernel":
            _DECODE_CHOICE[key] = True
            return True
        torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
        med = interleaved_medians({"kernel": lambda: kernels.linear(x, rows, n, bias),
                                   "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")},
                                  CALIBRATE_CALLS)
        _DECODE_CHOICE[key] = med["kernel"] < med["onednn"]
    return _DECODE_CHOICE[key]


def interleaved_medians(fns: dict, calls: int) -> dict[str, float]:
    """Each of ``fns`` (name -> a call) run ``calls`` times, in turn call by call; the median seconds
    of each (bench/engine.py's decode projections too)."""
    import statistics
    t: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in t.items()}


class Linear:
    """One projection x @ w.T + b with its weight laid out at load for what runs it: a few rows (a
    decode step) through the native kernel (engine.kernels.linear), more through oneDNN with the
    weight prepacked (vLLM-CPU does the same), else F.linear. With both layouts present the weight
    as loaded is dropped (it would be a third copy); each path falls back to the next. A bf16 weight
    (``--dtype bfloat16``) stays bf16 - half the bytes each decode step reads. Where the CPU
    multiplies bf16 natively (``bf16_gemm``: ``bf16mm``) its products run in bf16 through oneDNN on
    the weight prepacked in bf16 (activations rounded to bf16, fp32 accumulation: what vLLM-CPU
    does), every row count, except a small weight's decode rows (the native kernel, fp32 arithmetic
    on the widened weight: oneDNN's per-call cost is most of such a call). Elsewhere the arithmetic
    is fp32: a decode step's rows in the native kernel, more rows on an fp32 copy through F.linear."""
    __slots__ = ("weight", "bias", "bias16", "onednn", "rows", "n", "k", "bf16mm", "fp32_rows", "tiles", "decode_kernel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, onednn: bool = False):
        self.n, self.k = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        fp32 = weight.dtype == torch.float32
        self.bf16mm = weight.dtype == torch.bfloat16 and bf16_gemm()
        self.bias16 = self.bias.to(torch.bfloat16) if self.bf16mm and self.bias is not None else None
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
                       if onednn and (fp32 or (self.bf16mm and onednn_bf16())) else None)
        # with bf16 products: up to how many rows the arithmetic stays fp32 (a small weight's decode
        # rows, native kernel or not: the same numbers either way); beyond, products run in bf16
        small = self.n * self.k < BF16_ONEDNN_MIN_WEIGHT
        self.fp32_rows = BF16_KERNEL_ROWS if small else 0
        # fp32 or bf16 packed rows for the native kernel (None: the kernels are off, or a bf16
        # weight's every product runs in bf16)
        self.rows = None if self.bf16mm and not small else kernels.pack_rows(weight)
        # with bf16 products on a big weight: decode rows (up to kernels.TILE_ROWS) on AMX tiles over a
        # copy packed as tiles (kernels.pack_tiles: oneDNN's numbers bit for bit, 1.1-1.3x its speed at
        # 1-16 rows where it is alone and more in a step - see decode_tiles); None: oneDNN takes them
        self.tiles = kernels.pack_tiles(weight) if self.bf16mm and not small and decode_tiles() else None
        # an fp32 weight's decode rows (up to FEW_ROWS) through the native kernel: by the static rule, or
        # for a big weight where both layouts are kept, whichever is faster here (timed once a shape)
        self.decode_kernel = self.rows is not None and fp32 and (
            few_rows(1, self.n, self.k) or self.onednn is not None
            and kernel_decodes_faster(self.rows, self.onednn, self.n, self.k, self.bias))
        # the loaded weight is dropped where the layouts cover every path: oneDNN's fp32 one; a bf16
        # weight's packed rows (more rows widen them) or, with bf16 products, oneDNN's bf16 one plus
        # the packed rows for fp32 decode rows where those run fp32
        covered = (self.onednn is not None if fp32 else
                   self.onednn is not None and (self.rows is not None or not small) if self.bf16mm else
                   self.rows is not None)
        self.weight = None if covered else weight.contiguous()

    def input_dtype(self, m: int) -> torch.dtype:
        """The type this product takes ``m`` rows in: bf16 where they run in bf16 (``bf16mm``), else
        fp32 - what the op before it (a norm) may hand over directly, no conversion op between."""
        return torch.bfloat16 if self.bf16mm and m > self.fp32_rows else torch.float32

    def wide(self, m: int) -> torch.Tensor | None:
        """The weight widened to fp32 [n, k] where a product of ``m`` rows widens it on every call (a bf16
        weight with fp32 products, more rows than the native kernel takes, no fp32 layout kept: a CPU
        without bf16 products); None elsewhere. A caller with several such calls in a row
        (``LlamaModel.mlp``'s chunks) widens once and hands it to each (``__call__``'s ``wide``)."""
        if (self.weight is not None or self.bf16mm or self.rows is None or self.rows.dtype != torch.bfloat16
                or m <= BF16_KERNEL_ROWS or (self.onednn is not None and self.onednn.dtype == torch.float32)):
            return None
        return self._widened()

    def _widened(self) -> torch.Tensor:
        nb, k, r = self.rows.shape                # packed rows [blocks, k, R]: one pass, widening as it copies
        w = torch.empty(nb, r, k, dtype=torch.float32)
        w.copy_(self.rows.transpose(1, 2))
        return w.view(nb * r, k)[:self.n]

    def __call__(self, x: torch.Tensor, keep_bf16: bool = False, wide: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T + b in fp32; ``keep_bf16``: where the product runs in bf16 (``bf16mm``) its bf16
        result as it is (the next bf16 product takes it as it is: no widening and rounding back in
        between). A bf16 x is taken by that path as it is, else widened. ``wide``: ``self.wide(m)``
        made once by the caller for several calls of that many rows (the same numbers)."""
        if x.dim() != 2 or not x.is_contiguous():
            lead = x.shape[:-1]
            return self(x.reshape(-1, self.k).contiguous(), keep_bf16, wide).view(*lead, self.n)
        rows, m = self.rows, x.shape[0]
        if self.bf16mm and m > self.fp32_rows:
            global BF16_GEMM_CALLS
            BF16_GEMM_CALLS += 1
            xb = x.to(torch.bfloat16)
            out = (kernels.linear_tiles(xb, self.tiles, self.n, self.bias16)
                   if self.tiles is not None and m <= kernels.TILE_ROWS else None)
            if out is not None:
                return out if keep_bf16 else out.float()
            out = (torch.ops.mkldnn._linear_pointwise(xb, self.onednn, self.bias16, "none", [], "")
                   if self.onednn is not None else F.linear(xb, self.weight, self.bias16))
            return out if keep_bf16 else out.float()
        if x.dtype != torch.float32:
            x = x.float()
        if rows is not None and (m <= FEW_ROWS and self.decode_kernel if rows.dtype == torch.float32
                                 else m <= BF16_KERNEL_ROWS):
            out = kernels.linear(x, rows, self.n, self.bias)
            if out is not None:
                return out
        if self.onednn is not None and self.onednn.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        w = self.weight if self.weight is not None else wide if wide is not None else self._widened()
        return F.linear(x, w.to(x.dtype), self.bias)


STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}     # --dtype's choices
MLP_ROWS = 512      # rows of a step's MLP at a time (LlamaModel.mlp)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.w = weights
        # the stored weights' type, and the KV pool's (engine.llm): bf16 or fp32; activations are fp32
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.num_layers = cfg.num_layers
        self.kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.eos_token_id = cfg.eos_token_id
        self.name = cfg.model_type
        # where bf16 products run in bf16 (bf16_gemm), so does a prefill's attention, on the bf16 pool's
        # K/V as stored (engine.attention.paged_attention: the native kernel on AMX tiles or AVX512-BF16)
        # - but where the native kernels attend a bf16 pool's chunks only over its values widened (no
        # bf16 kernel in this build), they do that, in fp32 (faster than torch's bf16 SDPA after a
        # gather); elsewhere attention is fp32
        self.prefill_dtype = (torch.bfloat16 if self.dtype == torch.bfloat16 and bf16_gemm()
                              and not bf16_prefill_widened(cfg.head_dim) else None)
        # q/k/v and gate/up as one matmul each (fewer, larger GEMMs); every projection's weight moves
        # out of ``weights`` into its Linear (laid out there, the loaded copy dropped where unneeded)
        onednn = packing_available()
        self.qkv, self.o, self.gate_up, self.down = [], [], [], []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.qkv.append(Linear(torch.cat([weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                                   torch.cat([weights.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                                   if cfg.qkv_bias else None, onednn))
            self.o.append(Linear(weights.pop(p + "self_attn.o_proj.weight"), None, onednn))
            self.gate_up.append(Linear(torch.cat([weights.pop(p + "mlp.gate_proj.weight"),
                                                  weights.pop(p + "mlp.up_proj.weight")]), None, onednn))
            self.down.append(Linear(weights.pop(p + "mlp.down_proj.weight"), None, onednn))
        self.lm_head = Linear(weights.pop("lm_head.weight"), None, onednn)

    @staticmethod
    def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
        H, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        s = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = (c.vocab_size, H)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            s |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (qd, H), p + "self_attn.k_proj.weight": (kvd, H),
                  p + "self_attn.v_proj.weight": (kvd, H), p + "self_attn.o_proj.weight": (H, qd),
                  p + "mlp.gate_proj.weight": (c.intermediate_size, H), p + "mlp.up_proj.weight": (c.intermediate_size, H),
                  p + "mlp.down_proj.weight": (H, c.intermediate_size)}
            if c.qkv_bias:
                s |= {p + "self_attn.q_proj.bias": (qd,), p + "self_attn.k_proj.bias": (kvd,),
                      p + "self_attn.v_proj.bias": (kvd,)}
        return s

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "LlamaModel":
        """``dtype``: how the weights are stored (and the KV pool, engine.llm): fp32, or bf16 - half
        the memory and half the bytes a decode step reads, every product and sum still fp32. In bf16
        the projections and the embedding stay bf16; the norm weights and biases (vectors) are rounded
        to bf16 and kept as fp32."""
        if dtype not in STORAGE_DTYPES.values():
            raise ModelLoadError(f"weights can be stored as {', '.join(STORAGE_DTYPES)}, not {dtype}")
        from safetensors import safe_open
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path}: no config.json")
        cfg = LlamaConfig.from_hf(json.loads(cfg_file.read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors weights")
        want = cls.expected_shapes(cfg)
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if name in want:
                        t = fh.get_tensor(name)
                        if tuple(t.shape) != want[name]:
                            raise ModelLoadError(f"{f.name}: tensor {name} has shape {tuple(t.shape)}, "
                                                 f"config.json implies {want[name]}")
                        weights[name] = t.to(dtype) if t.dim() == 2 else t.to(dtype).float()
        missing = [n for n in want if n not in weights]
        if missing:
            raise ModelLoadError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[0]}")
        if cfg.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(cfg, weights)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP, down(silu(gate) * up), on rows h; where gate_up's product runs in bf16 it stays
        bf16 up to down's (keep_bf16). A step of more than MLP_ROWS rows (a long prefill chunk) runs it
        MLP_ROWS rows at a time: the [rows, 2 x intermediate] activations then stay in cache between
        the three ops (at 4096 rows of the big shape they are 74 MB, streamed out and back in)."""
        gu, dn = self.gate_up[i], self.down[i]
        if h.shape[0] <= MLP_ROWS:
            return dn(silu_mul(gu(h, keep_bf16=True)), keep_bf16=True)
        wg, wd = gu.wide(MLP_ROWS), dn.wide(MLP_ROWS)      # a weight every chunk would widen again: once
        return torch.cat([dn(silu_mul(gu(h[r:r + MLP_ROWS], keep_bf16=True, wide=wg)), keep_bf16=True, wide=wd)
                          for r in range(0, h.shape[0], MLP_ROWS)])

    def attend_bf16(self, i: int, h: torch.Tensor, ctx: StepContext, half: tuple) -> torch.Tensor | None:
        """Layer i's attention with its q, k and v kept in bf16 where its qkv product runs in bf16
        (``ctx.bf16_queries``): q and k rotated out of place and rounded once (kernels.rope_bf16) -
        the numbers the fp32 path's widening, rotation and rounding (by the pool for K, by the prefill
        kernel for q) give - and the rows whose q the attention needs unrounded (decode rows) rotated
        in fp32 from the product as it was. None: the native RoPE cannot run (the caller's fp32 path)."""
        c = self.cfg
        Hq, Hkv, D, T = c.num_heads, c.num_kv_heads, c.head_dim, h.shape[0]
        qkv = self.qkv[i](h, keep_bf16=True)
        rot = torch.empty((T, (Hq + Hkv) * D), dtype=torch.bfloat16)
        if not kernels.rope_bf16(qkv, Hq + Hkv, D, *half, rot):
            return None

        def q_exact(rows: torch.Tensor) -> torch.Tensor:
            x = qkv.index_select(0, rows)[:, :Hq * D].float()
            cos, sin = (t.index_select(0, rows) for t in half)
            if not kernels.rope(x, Hq, D, cos, sin):
                x = rope(x.view(-1, Hq, D), *(torch.cat([t, t], -1)[:, None] for t in (cos, sin))).view(len(rows), -1)
            return x.view(len(rows), Hq, D)
        q, k = rot[:, :Hq * D].view(T, Hq, D), rot[:, Hq * D:].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        return ctx.attend(i, q, k, v, Hkv, D, D ** -0.5, q_exact=q_exact)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                logits_rows: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        T, eps, D = input_ids.shape[0], c.rms_norm_eps, c.head_dim
        x = F.embedding(input_ids, w["model.embed_tokens.weight"])   # the residual stream (added to in place)
        if x.dtype != torch.float32:                                  # bf16 weights: fp32 activations
            x = x.float()
        freqs = rope_freqs(positions, D, c.rope_theta)
        half, full = (freqs.cos(), freqs.sin()), None                 # [T, D/2]: the native rope's; torch's below
        Hq, Hkv = c.num_heads, c.num_kv_heads
        # where a product runs in bf16 its input comes out of the norm before it in bf16, and o's and
        # down's bf16 results go into the next norm as they are (keep_bf16): no conversion op between
        h = add_rms_norm(x, w["model.layers.0.input_layernorm.weight"], eps, out_dtype=self.qkv[0].input_dtype(T))
        bf16_qkv = ctx.bf16_queries
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = (self.attend_bf16(i, h, ctx, half) if bf16_qkv and self.qkv[i].input_dtype(T) == torch.bfloat16
                 else None)
            if a is None:
                qkv = self.qkv[i](h)
                if not kernels.rope(qkv, Hq + Hkv, D, *half):             # q and k rotated in one pass
                    full = full or rope_full(freqs, x.dtype)
                    qkv[:, :(Hq + Hkv) * D] = rope(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), *full).view(T, -1)
                qkv = qkv.view(T, Hq + 2 * Hkv, D)
                q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
                a = ctx.attend(i, q, k, v, Hkv, D, D ** -0.5)
            h = add_rms_norm(self.o[i](a, keep_bf16=True), w[p + "post_attention_layernorm.weight"], eps, residual=x,
                             out_dtype=self.gate_up[i].input_dtype(T))
            down = self.mlp(i, h)
            if i + 1 < c.num_layers:
                h = add_rms_norm(down, w[f"model.layers.{i + 1}.input_layernorm.weight"], eps, residual=x,
                                 out_dtype=self.qkv[i + 1].input_dtype(T))
            else:
                x += down
        x = x[logits_rows]
        x = add_rms_norm(x, w["model.norm.weight"], eps, out_dtype=self.lm_head.input_dtype(x.shape[0]))
        return self.lm_head(x).float()
