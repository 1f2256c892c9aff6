# The Triton interpreter on CPU-only machines is chosen by leanlm-testing's pytest plugin.

from collections.abc import Callable
from typing import Any

import pytest
import torch

from prune_distill import PruneTarget

VOCAB = 128


# Tiny configs with odd but legal shapes: GQA ratios 1-4, head_dim set explicitly and different
# from hidden / heads, tied and untied embeddings, non-trivial family-specific scales.
_LLAMA_LIKE: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 6,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 10,
        "sliding_window": 8,
    },
    "qwen2": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 10,
    },
    "qwen3": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "tie_word_embeddings": True,
    },
    "gemma2": {
        "hidden_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 14,
        "intermediate_size": 80,
        "query_pre_attn_scalar": 16,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "intermediate_size": 80,
        "query_pre_attn_scalar": 20,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 4.0,
        "tie_word_embeddings": False,
    },
    "phi3": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 10,
        "intermediate_size": 72,
        "partial_rotary_factor": 0.6,
    },
    "olmo2": {
        "hidden_size": 48,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 10,
    },
    "granite": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 12,
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.5,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
}


# A width + depth target every test architecture accepts (GPT-2 / GPT-NeoX: hidden = heads x
# head_dim; the config validators want hidden_size divisible by the heads), all to 2 layers:
# (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads or None).
_TARGET_SIZES: dict[str, tuple[int, int, int, int | None]] = {
    "llama": (40, 50, 4, None),
    "mistral": (40, 50, 4, 1),
    "qwen2": (36, 64, 3, None),
    "qwen3": (40, 72, 4, None),
    "gemma2": (36, 56, 2, None),
    "gemma3": (48, 56, 2, 1),
    "phi3": (40, 50, 4, None),
    "olmo2": (40, 64, 4, None),
    "granite": (48, 64, 2, None),
    "gpt_neox": (36, 50, 3, None),
    "gpt2": (48, 64, 3, None),
}
TARGETS: dict[str, PruneTarget] = {
    arch: PruneTarget(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=2,
    )
    for arch, (hidden, ffn, heads, kv_heads) in _TARGET_SIZES.items()
}


def _classes(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
    }[arch]


def build(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny randomly initialised causal LM of `arch`, in eval mode."""
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
    elif arch == "gpt_neox":
        kwargs = {
            **common,
            "hidden_size": 48,
            "num_attention_heads": 4,
            "intermediate_size": 80,
            "num_hidden_layers": 3,
            "max_position_embeddings": 64,
            "partial_rotary_factor": 0.5,
            "use_parallel_residual": True,
        }
    else:
        kwargs = {
            **common,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "max_position_embeddings": 64,
            **_LLAMA_LIKE[arch],
        }
        if arch == "qwen2":
            kwargs["pad_token_id"] = None
    kwargs.update(overrides)
    config_cls, cls = _classes(arch)
    config = config_cls(**kwargs)
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


def _cloned_state(model: Any) -> dict[str, torch.Tensor]:
    """A copy of `model.state_dict()` (every tensor cloned)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def _pattern_batches(
    n: int, seed: int, *, batch_size: int, seq_len: int, vocab: int = VOCAB
) -> list[dict[str, torch.Tensor]]:
    """Learnable sequences: arithmetic progressions mod vocab with a per-sequence stride."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        out.append({"input_ids": (start + stride * torch.arange(seq_len)) % vocab})
    return out


def _capture_activations(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Independently capture the tensors each importance score is defined on (test-side hooks).

    One `model(**batch)` under `no_grad` of a Llama-like model; per decoder layer, in order:
    "o_in" / "down_in" (inputs of `o_proj` / `down_proj`), "norms" (outputs of both norms),
    "layer_in" / "layer_out" (the layer's input and output); "final" (the final norm's output)
    and "logits".
    """
    keys = ("o_in", "down_in", "norms", "final", "layer_in", "layer_out")
    got: dict[str, Any] = {key: [] for key in keys}
    hs = []
    for layer in model.model.layers:
        hs.append(
            layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: got["o_in"].append(a[0]))
        )
        hs.append(
            layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: got["down_in"].append(a[0]))
        )
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            hs.append(norm.register_forward_hook(lambda m, a, o: got["norms"].append(o)))
        hs.append(
            layer.register_forward_hook(
                lambda m, a, o: got["layer_in"].append(a[0]) or got["layer_out"].append(o)
            )
        )
    hs.append(model.model.norm.register_forward_hook(lambda m, a, o: got["final"].append(o)))
    with torch.no_grad():
        got["logits"] = model(**batch).logits
    for h in hs:
        h.remove()
    return got


ARCHS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "granite",
    "gpt_neox",
    "gpt2",
]
RMS_ARCHS = [a for a in ARCHS if a not in ("gpt2", "gpt_neox")]


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def make() -> Callable[..., Any]:
    return build


@pytest.fixture(scope="session")
def data() -> Callable[..., list[dict]]:
    return batches


@pytest.fixture(scope="session")
def targets() -> dict[str, PruneTarget]:
    """A width + depth target per family."""
    return TARGETS


@pytest.fixture(scope="session")
def cloned_state() -> Callable[[Any], dict[str, torch.Tensor]]:
    """`cloned_state(model)`: a copy of the model's state dict, to check it is left alone."""
    return _cloned_state


@pytest.fixture(scope="session")
def capture() -> Callable[..., dict[str, Any]]:
    """`capture(model, batch)`: the activations importance scores are defined on (see there)."""
    return _capture_activations


@pytest.fixture(scope="session")
def patterns() -> Callable[..., list[dict[str, torch.Tensor]]]:
    """`patterns(n, seed, batch_size=, seq_len=)`: `n` batches of learnable sequences."""
    return _pattern_batches
