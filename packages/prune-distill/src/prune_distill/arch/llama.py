"""The Llama-style spec, and Llama / Mistral / Qwen2 themselves.

`llama_style` is the layout most decoder families share: ``model.layers``, separate
q/k/v/o and gate/up/down projections (biases optional), bias-free pre-norms, ``model.norm``,
``model.embed_tokens`` and ``lm_head`` (tied or not). A family passes only what differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from prune_distill.arch._spec import ArchSpec, Axis, linear, norm, norms

QKNorm = Literal["head_dim", "projection"]
"""Where q/k norms normalise: over each head's ``head_dim`` with one weight shared by every head
(never sliced), or over the whole projection (sliced with the heads)."""

LLAMA_TOP: dict[str, tuple[Axis, ...]] = {
    "model.embed_tokens.weight": (None, "hidden"),
    "model.norm.weight": ("hidden",),
    **linear("lm_head", None, "hidden"),
}


def llama_style(
    name: str,
    model_types: tuple[str, ...] | None = None,
    *,
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    qk_norm: QKNorm | None = None,
    fused_qkv: bool = False,
    fused_gate_up: bool = False,
    **fields: Any,
) -> ArchSpec:
    """The `ArchSpec` of a Llama-style family that differs only as the arguments say.

    Args:
        name: the family name; also its only ``model_type`` unless `model_types` is given.
        model_types: the ``config.model_type`` values it handles.
        layer_norms: the per-layer norms over the hidden width (their order is the hooks' order).
        qk_norm: ``self_attn.q_norm`` / ``k_norm`` and what they normalise over (`QKNorm`).
        fused_qkv: one ``self_attn.qkv_proj`` (``[q | k | v]``) instead of q/k/v.
        fused_gate_up: one ``mlp.gate_up_proj`` (``[gate | up]``) instead of gate/up.
        **fields: any other `ArchSpec` field (``rescale``, ``buffers``, ``layer_lists``, ...).
    """
    if fused_qkv:
        qkv = linear("self_attn.qkv_proj", "qkv", "hidden")
    else:
        qkv = {
            **linear("self_attn.q_proj", "q", "hidden"),
            **linear("self_attn.k_proj", "kv", "hidden"),
            **linear("self_attn.v_proj", "kv", "hidden"),
        }
    if fused_gate_up:
        gate_up = linear("mlp.gate_up_proj", "ffn2", "hidden")
    else:
        gate_up = {
            **linear("mlp.gate_proj", "ffn", "hidden"),
            **linear("mlp.up_proj", "ffn", "hidden"),
        }
    qk: dict[str, tuple[Axis, ...]] = {}
    if qk_norm is not None:
        whole = qk_norm == "projection"
        qk = {
            **norm("self_attn.q_norm", "q" if whole else None),
            **norm("self_attn.k_norm", "kv" if whole else None),
        }
    spec = ArchSpec(
        name=name,
        model_types=model_types or (name,),
        layers="model.layers",
        attn_out="self_attn.o_proj",
        mlp_out="mlp.down_proj",
        layer_norms=layer_norms,
        final_norm="model.norm",
        layer_params={
            **qkv,
            **linear("self_attn.o_proj", "hidden", "q"),
            **qk,
            **gate_up,
            **linear("mlp.down_proj", "hidden", "ffn"),
            **norms(layer_norms),
        },
        top_params=LLAMA_TOP,
    )
    return dataclasses.replace(spec, **fields)


LLAMA = llama_style(
    "llama", ("llama", "mistral", "qwen2"), layer_lists=("layer_types", "no_rope_layers")
)
"""Llama, Mistral (sliding window kept), Qwen2 (q/k/v biases; ``max_window_layers`` sliced)."""
