"""GPT-NeoX / Pythia: the GPT-2-style spec with `nn.Linear` weights and a per-head fused q/k/v.

``query_key_value`` is laid out ``[q_h | k_h | v_h]`` for every head h; the residual is parallel
or sequential; partial rotary embeddings act within ``head_dim``. The config derives
``head_dim = hidden_size / heads``, so heads and hidden size are pruned together.
"""

from __future__ import annotations

from prune_distill.arch._spec import linear
from prune_distill.arch.gpt2 import gpt_style

GPT_NEOX = gpt_style(
    "gpt_neox",
    layers="gpt_neox.layers",
    attn=("attention.query_key_value", "attention.dense"),
    mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="gpt_neox.final_layer_norm",
    top_params={"gpt_neox.embed_in.weight": (None, "hidden"), **linear("lm_head", None, "hidden")},
    qkv="qkv_heads",
)
