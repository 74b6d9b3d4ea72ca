"""Models: a Llama-family decoder loaded from an HF directory, and the hand-wired recall model."""
from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError


DTYPES = ("float32", "bfloat16")      # how a checkpoint's weights and the KV pool are stored (--dtype)
RECALL_DTYPE = "--dtype bfloat16 needs an HF-format checkpoint directory: the recall model is hand-wired in fp32"


def load_model(spec: str, dtype: str = "float32"):
    """``recall`` or a path to an HF-format directory. Returns (model, tokenizer). ``dtype``: how
    the weights and the KV pool are stored (``bfloat16``: half the bytes; arithmetic stays fp32)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if spec == "recall" and dtype != "float32":
        raise ModelLoadError(RECALL_DTYPE)
    if spec == "recall":
        from engine.models.recall import RecallModel
        from engine.models.tokenizer import ByteTokenizer
        return RecallModel(), ByteTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"unknown model {spec!r}: expected 'recall' or a directory with config.json, "
                             "*.safetensors and tokenizer.json")
    from engine.models.llama import LlamaModel
    from engine.models.tokenizer import HFTokenizer
    try:
        import torch
        return LlamaModel.from_pretrained(path, getattr(torch, dtype)), HFTokenizer.from_dir(path)
    except ModelLoadError:
        raise
    except Exception as e:   # noqa: BLE001 - json, safetensors and tokenizers each raise their own kinds
        what = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ModelLoadError(f"cannot load the model in {path}: {type(e).__name__}: {what} (expected an HF-format "
                             "directory: a valid config.json, complete *.safetensors and tokenizer.json)") from None


def load_tokenizer(spec: str):
    """The tokenizer of ``load_model(spec)`` alone (the HTTP process of ``kvledger serve``: no weights)."""
    if spec == "recall":
        from engine.models.tokenizer import ByteTokenizer
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"unknown model {spec!r}: expected 'recall' or a directory with config.json, "
                             "*.safetensors and tokenizer.json")
    from engine.models.tokenizer import HFTokenizer
    try:
        return HFTokenizer.from_dir(path)
    except ModelLoadError:
        raise
    except Exception as e:   # noqa: BLE001 - tokenizers raises its own kinds
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
