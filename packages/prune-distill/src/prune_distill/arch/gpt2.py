"""The GPT-2-style spec (`gpt_style`), and GPT-2 itself.

`gpt_style` is the layout GPT-2 and GPT-NeoX share: multi-head attention through one fused
q/k/v projection and an output projection, a two-layer MLP, LayerNorms with biases, and a config
that derives ``head_dim = hidden / heads`` (so heads and hidden size are pruned together, and no
per-layer config list). A family passes its module names and what else differs.

GPT-2: Conv1D weights stored transposed (``[in, out]``) and a fused ``c_attn`` (``[q | k | v]``);
learned position embeddings. With ``scale_attn_by_inverse_layer_idx`` each layer divides its
attention scores by ``layer_idx + 1``, which depth pruning renumbers. `_rescale` multiplies a kept
layer's query weights and bias by ``(new_idx + 1) / (old_idx + 1)``, so it keeps the attention
scale it had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from prune_distill.arch._spec import ArchSpec, Axis, ParamAxes, Resize, linear, norm, norms

Weights = Callable[[str, Axis, Axis], dict[str, tuple[Axis, ...]]]
"""Axes of one projection from its name, output axis and input axis (`linear` or `conv1d`)."""


def conv1d(name: str, out: Axis, inp: Axis) -> dict[str, tuple[Axis, ...]]:
    """Axes of a transformers `Conv1D` (weight stored ``[in, out]``, bias ``[out]``)."""
    return {f"{name}.weight": (inp, out), f"{name}.bias": (out,)}


def gpt_style(
    name: str,
    *,
    layers: str,
    attn: tuple[str, str],
    mlp: tuple[str, str],
    layer_norms: tuple[str, ...],
    final_norm: str,
    top_params: ParamAxes,
    qkv: Axis = "qkv",
    weights: Weights = linear,
    **fields: Any,
) -> ArchSpec:
    """The `ArchSpec` of a GPT-2-style family with these module names.

    Args:
        name: the family name and its only ``model_type``.
        layers: dotted path of the decoder-layer `ModuleList`.
        attn: the fused q/k/v projection and the attention output projection (in a layer).
        mlp: the MLP input and output projections (in a layer).
        layer_norms: the per-layer LayerNorms (with biases) over the hidden width.
        final_norm: the LayerNorm (with bias) after the last layer.
        top_params: the embeddings' and LM head's parameters (the final norm's are added).
        qkv: the fused projection's output axis, ``"qkv"`` or ``"qkv_heads"`` (`Axis`).
        weights: the projections' axes: `linear`, or `conv1d` for weights stored ``[in, out]``.
        **fields: any other `ArchSpec` field (config field names, ``rescale``, ``check``, ...).
    """
    qkv_proj, attn_out = attn
    mlp_in, mlp_out = mlp
    spec = ArchSpec(
        name=name,
        model_types=(name,),
        layers=layers,
        attn_out=attn_out,
        mlp_out=mlp_out,
        layer_norms=layer_norms,
        final_norm=final_norm,
        layer_params={
            **weights(qkv_proj, qkv, "hidden"),
            **weights(attn_out, "hidden", "q"),
            **weights(mlp_in, "ffn", "hidden"),
            **weights(mlp_out, "hidden", "ffn"),
            **norms(layer_norms, bias=True),
        },
        top_params={**top_params, **norm(final_norm, bias=True)},
        kv_field=None,
        head_dim_field=None,
        layer_lists=(),
    )
    return dataclasses.replace(spec, **fields)


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


GPT2 = gpt_style(
    "gpt2",
    layers="transformer.h",
    attn=("attn.c_attn", "attn.c_proj"),
    mlp=("mlp.c_fc", "mlp.c_proj"),
    layer_norms=("ln_1", "ln_2"),
    final_norm="transformer.ln_f",
    top_params={
        "transformer.wte.weight": (None, "hidden"),
        "transformer.wpe.weight": (None, "hidden"),
        "lm_head.weight": (None, "hidden"),
    },
    weights=conv1d,
    hidden_field="n_embd",
    ffn_field="n_inner",
    heads_field="n_head",
    layers_field="n_layer",
    rescale=_rescale,
    check=_check,
)
