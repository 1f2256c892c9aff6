"""The model: a transformers `LlamaForCausalLM` built from a `ModelConfig` (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanlm.config import ModelConfig


def llama_config(
    config: ModelConfig, *, vocab_size: int, bos_id: int, eos_id: int, pad_id: int
) -> LlamaConfig:
    """The `LlamaConfig` for `config` with the tokenizer's vocabulary and special ids."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=False,
    )


def build_model(config: ModelConfig, *, tokenizer: object, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama (fp32) whose vocabulary matches `tokenizer`.

    Initialisation is seeded by `seed` alone, so every process builds identical weights.
    """
    cfg = llama_config(
        config,
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        bos_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def weights_stats(model_dir: Path) -> dict[str, int]:
    """Size and counts of the weights a model folder stores (`model*.safetensors`).

    Returns `weights_bytes` (on disk), `stored_params` (elements; a tied embedding is stored
    once) and `nonzero_params` (elements that are not exactly zero, what a sparse format keeps).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("model*.safetensors"))  # not masks etc.
    stats = {"weights_bytes": sum(f.stat().st_size for f in files)}
    numel = nonzero = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = f.get_tensor(key)
                numel += tensor.numel()
                nonzero += int(torch.count_nonzero(tensor))
    stats.update(stored_params=numel, nonzero_params=nonzero)
    return stats


def load_model(path: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """`AutoModelForCausalLM.from_pretrained(path)` in its checkpoint's dtype, or in `dtype`.

    transformers builds the model on the meta device and fills it shard by shard from the
    safetensors files, casting each tensor as it arrives, so the process never holds two
    copies of the weights. With `dtype=None` the weights keep the checkpoint's dtype (the
    config's `dtype`, else that of the stored weights): a bf16 checkpoint loads as bf16.
    Stages that train pass `TRAIN_DTYPE` (see there).
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")


TRAIN_DTYPE = torch.float32
"""The dtype a model that trains is loaded in: every engine (`leanlm.train.engines`) keeps fp32
parameters (masters) and `RunConfig.mixed_precision` runs the forward under autocast, so a bf16
checkpoint that trains is upcast; models that only run forward passes (a teacher, the model the
`prune` stage scores) keep the checkpoint's dtype."""


def load_teacher(path: str | Path, *, dtype: torch.dtype | None = None) -> Any:
    """A frozen teacher: `load_model` (checkpoint dtype), eval mode, no gradients."""
    return load_model(path, dtype=dtype).eval().requires_grad_(False)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations.

    transformers' `activation_checkpointing_enable` on the outermost `PreTrainedModel` in
    `model` (`model` itself, or the student inside `StudentWithHiddenLoss`), with the
    non-reentrant `torch.utils.checkpoint`, which composes with autocast, FSDP2's and
    shard-zero's hooks and `no_sync`. Only training forwards (`model.training`) checkpoint;
    the layers run without autocast's weight cache (`uncache_layers`).

    Raises:
        TypeError: `model` holds no transformers model.
    """
    from transformers import PreTrainedModel

    from leanlm.train.autocast import uncache_layers

    for module in model.modules():  # outermost first
        if isinstance(module, PreTrainedModel):
            module.activation_checkpointing_enable({"use_reentrant": False})
            uncache_layers(module)
            return
    raise TypeError(
        f"`activation_checkpointing` needs a transformers model; got {type(model).__name__}"
    )
