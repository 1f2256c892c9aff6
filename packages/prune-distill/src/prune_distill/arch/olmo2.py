"""OLMo 2 adapter.

Post-norms only (after attention and after the MLP), q/k RMSNorms over the *whole*
projection (``num_heads * head_dim`` and ``num_key_value_heads * head_dim`` channels).

The q/k norms are sliced with their heads. Their RMS is then taken over fewer channels, so
pruning live heads rescales the remaining ones, like hidden-channel pruning does for every norm
(Minitron accepts this and distillation repairs it); no compensation is applied.
"""

from __future__ import annotations

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec, gated_mlp, llama_attention, norm

OLMO2 = ArchSpec(
    name="olmo2",
    model_types=("olmo2",),
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    final_norm="model.norm",
    layer_params={
        **llama_attention(),
        **gated_mlp(),
        **norm("self_attn.q_norm", "q"),
        **norm("self_attn.k_norm", "kv"),
        **norm("post_attention_layernorm"),
        **norm("post_feedforward_layernorm"),
    },
    top_params=LLAMA_TOP,
)
