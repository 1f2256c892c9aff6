"""OLMo 2: the Llama-style spec with post-norms only and whole-projection q/k norms.

The norms come after attention and after the MLP. ``q_norm`` / ``k_norm`` span the whole
projection (``heads * head_dim`` and ``kv_heads * head_dim`` channels) and are sliced with their
heads; their RMS is then taken over fewer channels, like every norm after hidden-channel pruning
(Minitron accepts this and distillation repairs it), so no compensation is applied.
"""

from __future__ import annotations

from prune_distill.arch.llama import llama_style

OLMO2 = llama_style(
    "olmo2",
    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    qk_norm="projection",
)
