"""Tokenizers: HF ``tokenizers`` for model directories, bytes for the recall model (no torch here:
the HTTP process of ``kvledger serve`` tokenizes without loading it)."""
from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError


class HFTokenizer:
    def __init__(self, tok, eos_token_id: int | None):
        self._tok = tok
        self.eos_token_id = eos_token_id

    @classmethod
    def from_dir(cls, path: Path) -> "HFTokenizer":
        from tokenizers import Tokenizer
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        import json
        eos = None
        cfg = Path(path) / "config.json"
        if cfg.is_file():
            eos = json.loads(cfg.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
        return cls(Tokenizer.from_file(str(f)), eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class ByteTokenizer:
    """The recall model's: one token per UTF-8 byte."""
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")
