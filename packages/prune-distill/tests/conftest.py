import os

# The Triton interpreter must be chosen before any kernel module is imported (CPU runs only).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from typing import Any

import pytest
import torch

VOCAB = 128


def build(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny randomly initialised causal LM of `arch`, in eval mode."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
    if arch == "gpt2":
        kwargs: dict[str, Any] = {
            **common,
            "n_embd": 64,
            "n_head": 4,
            "n_layer": 3,
            "n_positions": 64,
            "n_inner": 96,
        }
        kwargs.update(overrides)
        config: Any = tf.GPT2Config(**kwargs)
        cls: Any = tf.GPT2LMHeadModel
    else:
        kwargs = {
            **common,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
        }
        if arch == "llama":
            kwargs["tie_word_embeddings"] = True
        if arch == "mistral":
            kwargs["sliding_window"] = 8
        kwargs.update(overrides)
        config, cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[arch]
        config = config(**kwargs)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random, non-trivial norms and biases so slicing bugs show up
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.normal_(1.0 if "weight" in name else 0.0, 0.2)
    return model


def batches(n: int = 2, batch_size: int = 2, seq_len: int = 12, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)}
        for _ in range(n)
    ]


ARCHS = ["llama", "mistral", "qwen2", "gpt2"]


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def make() -> Callable[..., Any]:
    return build


@pytest.fixture(scope="session")
def data() -> Callable[..., list[dict]]:
    return batches
