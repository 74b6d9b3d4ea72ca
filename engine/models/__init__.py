"""Models: a Llama-family decoder loaded from an HF directory, and the hand-wired recall model."""
from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError


def load_model(spec: str):
    """``recall`` or a path to an HF-format directory. Returns (model, tokenizer)."""
    if spec == "recall":
        from engine.models.recall import RecallModel, ByteTokenizer
        return RecallModel(), ByteTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"unknown model {spec!r}: expected 'recall' or a directory with config.json, "
                             "*.safetensors and tokenizer.json")
    from engine.models.llama import LlamaModel
    from engine.models.tokenizer import HFTokenizer
    return LlamaModel.from_pretrained(path), HFTokenizer.from_dir(path)
