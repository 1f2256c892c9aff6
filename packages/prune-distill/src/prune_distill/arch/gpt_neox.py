"""GPT-NeoX / Pythia: LayerNorms with biases and a fused per-head ``query_key_value``.

``query_key_value`` is laid out ``[q_h | k_h | v_h]`` for every head h; the residual is parallel
or sequential; partial rotary embeddings act within ``head_dim``. The config derives
``head_dim = hidden_size / heads``, so heads and hidden size are pruned together.
"""

from __future__ import annotations

from prune_distill.arch._spec import ArchSpec, linear, norm, norms

_NORMS = ("input_layernorm", "post_attention_layernorm")

GPT_NEOX = ArchSpec(
    name="gpt_neox",
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    attn_out="attention.dense",
    mlp_out="mlp.dense_4h_to_h",
    layer_norms=_NORMS,
    final_norm="gpt_neox.final_layer_norm",
    layer_params={
        **linear("attention.query_key_value", "qkv_heads", "hidden"),
        **linear("attention.dense", "hidden", "q"),
        **linear("mlp.dense_h_to_4h", "ffn", "hidden"),
        **linear("mlp.dense_4h_to_h", "hidden", "ffn"),
        **norms(_NORMS, bias=True),
    },
    top_params={
        "gpt_neox.embed_in.weight": (None, "hidden"),
        **norm("gpt_neox.final_layer_norm", bias=True),
        **linear("lm_head", None, "hidden"),
    },
    kv_field=None,
    head_dim_field=None,
    layer_lists=(),
)
