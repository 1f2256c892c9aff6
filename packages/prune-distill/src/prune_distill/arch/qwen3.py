"""Qwen3: the Llama layout plus per-head q/k RMSNorms.

``q_norm`` / ``k_norm`` normalise each head over its own ``head_dim`` channels with one weight
vector shared by all heads, so pruning heads or hidden channels leaves them as they are.
"""

from __future__ import annotations

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec, norm
from prune_distill.arch.llama import LLAMA_LAYER

QWEN3 = ArchSpec(
    name="qwen3",
    model_types=("qwen3",),
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="model.norm",
    layer_params={
        **LLAMA_LAYER,
        **norm("self_attn.q_norm", None),
        **norm("self_attn.k_norm", None),
    },
    top_params=LLAMA_TOP,
)
