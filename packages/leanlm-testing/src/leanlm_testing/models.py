"""Tiny Hugging Face causal LMs built from config objects: no download, fast on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def tiny_llama_config(**overrides: Any) -> Any:
    """A `LlamaConfig` with GQA (4 query heads, 2 KV heads), 2 layers, hidden 64, vocab 256."""
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def llama3_8b_config(layers: int = 32) -> Any:
    """The Llama-3-8B architecture (no weights; untied embeddings), with `layers` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def tinyllama_1b_config() -> Any:
    """The TinyLlama-1.1B shapes (no weights; `LlamaConfig`'s other defaults): 22 layers of 2048."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    )


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """A freshly initialised `LlamaForCausalLM` from `tiny_llama_config(**overrides)`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


_LLAMA_NAMES = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
}
"""`LlamaShape` field -> the `LlamaConfig` field it sets."""


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """The sizes of a Llama decoder under short names (a benchmark config's model part)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    """Query heads per layer."""
    kv_heads: int
    ffn: int
    """Width of the MLP (`intermediate_size`)."""

    def model(self, seed: int = 0, **overrides: Any) -> Any:
        """`tiny_llama(seed)` of this shape (eval mode); `overrides`: other `LlamaConfig` fields."""
        sizes = {name: getattr(self, field) for field, name in _LLAMA_NAMES.items()}
        return tiny_llama(seed, **sizes, **overrides)


def random_batches(
    vocab_size: int, *, batches: int = 2, batch_size: int = 2, seq_len: int = 16, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """`batches` dicts of random `input_ids` (batch_size, seq_len), as a DataLoader would yield."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)}
        for _ in range(batches)
    ]
