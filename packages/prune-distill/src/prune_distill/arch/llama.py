"""Llama layout: Llama, Mistral, Qwen2 (pre-norm, separate q/k/v/o, gated MLP, optional biases)."""

from __future__ import annotations

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec, gated_mlp, llama_attention, norm

LLAMA_LAYER = {
    **llama_attention(),
    **gated_mlp(),
    **norm("input_layernorm"),
    **norm("post_attention_layernorm"),
}

LLAMA = ArchSpec(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="model.norm",
    layer_params=LLAMA_LAYER,
    top_params=LLAMA_TOP,
    layer_lists=("layer_types", "no_rope_layers"),
)
