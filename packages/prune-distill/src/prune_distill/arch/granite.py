"""Granite adapter.

The Llama layout with ``embedding_multiplier``, ``residual_multiplier``,
``attention_multiplier`` (the attention scale) and ``logits_scaling``. All four are config
constants that do not depend on a pruned size, so they are kept as they are.
"""

from __future__ import annotations

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec
from prune_distill.arch.llama import LLAMA_LAYER

GRANITE = ArchSpec(
    name="granite",
    model_types=("granite",),
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="model.norm",
    layer_params=LLAMA_LAYER,
    top_params=LLAMA_TOP,
)
