"""Phi-3 / Phi-4 adapter (``Phi3ForCausalLM``).

Fused ``qkv_proj`` ([q | k | v]) and ``gate_up_proj``
([gate | up]); otherwise the Llama layout. Partial rotary embeddings act within ``head_dim``,
which pruning keeps (written explicitly into the config).
"""

from __future__ import annotations

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec, linear, norm

PHI3 = ArchSpec(
    name="phi3",
    model_types=("phi3",),
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="model.norm",
    layer_params={
        **linear("self_attn.qkv_proj", "qkv", "hidden"),
        **linear("self_attn.o_proj", "hidden", "q"),
        **linear("mlp.gate_up_proj", "ffn2", "hidden"),
        **linear("mlp.down_proj", "hidden", "ffn"),
        **norm("input_layernorm"),
        **norm("post_attention_layernorm"),
    },
    top_params=LLAMA_TOP,
)
