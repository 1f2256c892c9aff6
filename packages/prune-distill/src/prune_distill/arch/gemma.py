"""Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM`` with ``Gemma3TextConfig``).

Pre- and post-norms around both sublayers (RMSNorm with a ``1 + weight`` scale), GELU-gated MLP,
``head_dim`` independent of ``hidden_size / heads``, attention scaled by
``query_pre_attn_scalar`` (a config constant, kept), attention and final logit soft-capping
(constants, kept), a sliding-window pattern in ``layer_types`` (sliced on depth pruning). Gemma 3
adds per-head q/k norms over ``head_dim`` (shared by all heads: never pruned).

The embedding output is multiplied by ``sqrt(hidden_size)``, which `prune` changes when it
removes hidden channels. `_rescale` compensates in the weights: the embedding matrix is
multiplied by ``sqrt(old / new)`` so every kept channel enters the first layer with exactly the
value it had. With tied embeddings that matrix is also the LM head, so the final norm's scale
``1 + w`` is divided by the same factor, which leaves the logits of the kept channels unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from prune_distill.arch._spec import LLAMA_TOP, ArchSpec, Resize, gated_mlp, llama_attention, norm

_EMBED = "model.embed_tokens.weight"

_GEMMA2_LAYER = {
    **llama_attention(),
    **gated_mlp(),
    **norm("input_layernorm"),
    **norm("post_attention_layernorm"),
    **norm("pre_feedforward_layernorm"),
    **norm("post_feedforward_layernorm"),
}
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _rescale(state: dict[str, torch.Tensor], resize: Resize) -> None:
    if resize.new.hidden == resize.old.hidden:
        return
    factor = math.sqrt(resize.old.hidden / resize.new.hidden)
    embed = state[_EMBED]
    with torch.no_grad():
        embed.mul_(factor)
        if state.get("lm_head.weight") is embed:  # tied: the LM head grew by `factor` too
            final = state["model.norm.weight"]
            final.copy_(((1.0 + final.double()) / factor - 1.0).to(final.dtype))


def _buffers(config: Any) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.embed_scale": torch.tensor(config.hidden_size**0.5)}


def _gemma(name: str, model_types: tuple[str, ...], layer_params: Any) -> ArchSpec:
    return ArchSpec(
        name=name,
        model_types=model_types,
        layers="model.layers",
        attn_out="self_attn.o_proj",
        mlp_out="mlp.down_proj",
        layer_norms=_NORMS,
        final_norm="model.norm",
        layer_params=layer_params,
        top_params=LLAMA_TOP,
        rescale=_rescale,
        buffers=_buffers,
    )


GEMMA2 = _gemma("gemma2", ("gemma2",), _GEMMA2_LAYER)
GEMMA3 = _gemma(
    "gemma3",
    ("gemma3_text",),
    {**_GEMMA2_LAYER, **norm("self_attn.q_norm", None), **norm("self_attn.k_norm", None)},
)
