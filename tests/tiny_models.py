"""Tiny HF checkpoints built locally by transformers (no download); used by tests and bench."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tokenizer(path: Path, vocab_size: int) -> None:
    """A real BPE tokenizer.json trained on Python's own documentation corpus."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(topics.values())[:40], trainer)
    tok.save(str(path / "tokenizer.json"))


def build_tiny(kind: str, path: Path, tie: bool = False, hidden: int = 64, layers: int = 2, *,
               heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, vocab: int = 512,
               max_positions: int = 512) -> Path:
    """A randomly initialised HF checkpoint of the given shape (plus a 512-token BPE tokenizer)."""
    import transformers
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions,
                  initializer_range=0.2, tie_word_embeddings=tie, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(1234 if kind == "llama" else 4321)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():    # make the qkv biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path, 512)
    return path
