"""GPT-2: Conv1D weights stored transposed (``[in, out]``) and a fused ``c_attn`` (``[q | k | v]``).

Learned position embeddings and LayerNorms with biases. The attention width is ``n_embd``, so
heads and hidden size are pruned together.

With ``scale_attn_by_inverse_layer_idx`` each layer divides its attention scores by
``layer_idx + 1``, which depth pruning renumbers. `_rescale` multiplies a kept layer's query
weights and bias by ``(new_idx + 1) / (old_idx + 1)``, so it keeps the attention scale it had.
"""

from __future__ import annotations

from typing import Any

import torch

from prune_distill.arch._spec import ArchSpec, Axis, Resize, norm, norms

_NORMS = ("ln_1", "ln_2")


def _conv1d(name: str, out: Axis, inp: Axis) -> dict[str, tuple[Axis, ...]]:
    """Axes of a transformers `Conv1D` (weight stored ``[in, out]``, bias ``[out]``)."""
    return {f"{name}.weight": (inp, out), f"{name}.bias": (out,)}


def _rescale(state: dict[str, torch.Tensor], resize: Resize) -> None:
    if not getattr(resize.new_config, "scale_attn_by_inverse_layer_idx", False):
        return
    width = resize.new.heads * resize.new.head_dim
    with torch.no_grad():
        for new, old in enumerate(resize.kept_layers):
            if new == old:
                continue
            factor = (new + 1) / (old + 1)
            state[f"transformer.h.{new}.attn.c_attn.weight"][:, :width] *= factor
            state[f"transformer.h.{new}.attn.c_attn.bias"][:width] *= factor


def _check(config: Any) -> None:
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with `add_cross_attention=True` is not supported")


GPT2 = ArchSpec(
    name="gpt2",
    model_types=("gpt2",),
    layers="transformer.h",
    attn_out="attn.c_proj",
    mlp_out="mlp.c_proj",
    layer_norms=_NORMS,
    final_norm="transformer.ln_f",
    layer_params={
        **_conv1d("attn.c_attn", "qkv", "hidden"),
        **_conv1d("attn.c_proj", "hidden", "q"),
        **_conv1d("mlp.c_fc", "ffn", "hidden"),
        **_conv1d("mlp.c_proj", "hidden", "ffn"),
        **norms(_NORMS, bias=True),
    },
    top_params={
        "transformer.wte.weight": (None, "hidden"),
        "transformer.wpe.weight": (None, "hidden"),
        **norm("transformer.ln_f", bias=True),
        "lm_head.weight": (None, "hidden"),
    },
    hidden_field="n_embd",
    ffn_field="n_inner",
    heads_field="n_head",
    kv_field=None,
    layers_field="n_layer",
    head_dim_field=None,
    layer_lists=(),
    rescale=_rescale,
    check=_check,
)
