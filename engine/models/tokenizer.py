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

    def content_mask(self):
        """Per token id: does its text hold a letter or a digit? (Whitespace, punctuation and
        special tokens are no one's data: an n-gram of them is never evidence.)"""
        import numpy as np
        n = self._tok.get_vocab_size()
        texts = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
        return np.fromiter((any(ch.isalnum() for ch in t) for t in texts), dtype=bool, count=n)


class ByteTokenizer:
    """The recall model's: one token per UTF-8 byte."""
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def content_mask(self):
        """Letters and digits (ASCII) and every byte of a multi-byte UTF-8 character (as HFTokenizer's)."""
        import numpy as np
        return np.fromiter((chr(b).isalnum() or b >= 0x80 for b in range(256)), dtype=bool, count=256)
