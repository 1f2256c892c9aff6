"""Model presets (real configuration numbers, written out: nothing is downloaded) and loading.

Each preset is the `config.json` of the published checkpoint, reduced to the fields that decide
the parameter count and the activation shapes. `model_config` turns a preset name or the path
of any Hugging Face `config.json` into a `transformers.PretrainedConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # TinyLlama/TinyLlama-1.1B (the shape of the world-1 GPU run, benchmarks/RESULTS.md §3):
    # 1,100,048,384 parameters
    "tinyllama-1.1b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B: 70,553,706,496 parameters
    "llama-3-70b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2-7B: 7,615,616,512 parameters (q/k/v projections carry biases)
    "qwen2-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.1: 7,241,732,096 parameters
    "mistral-7b": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
}

PRESET_PARAMS = {
    "tinyllama-1.1b": 1_100_048_384,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "qwen2-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
}


def model_config(model: str, *, num_layers: int | None = None) -> Any:
    """A `transformers` config for a preset name or a `config.json` path.

    Args:
        model: a key of `PRESETS`, or the path of a Hugging Face `config.json` (or of the
            folder holding one).
        num_layers: keep only this many decoder layers (None: all of them).

    Raises:
        ValueError: `model` is neither a preset nor an existing file/folder, or `num_layers`
            is not positive.
    """
    from transformers import AutoConfig

    if model in PRESETS:
        fields = dict(PRESETS[model])
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"`model` ({model!r}) must be a preset ({', '.join(sorted(PRESETS))}) or the "
                "path of a Hugging Face config.json"
            )
        fields = json.loads(path.read_text())
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"`num_layers` ({num_layers!r}) must be a positive int or None")
        fields["num_hidden_layers"] = num_layers
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"the config for {model!r} has no `model_type`")
    return AutoConfig.for_model(model_type, **fields)
