"""Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM``): the Llama-style spec with four norms.

Pre- and post-norms around both sublayers (RMSNorm scaling by ``1 + weight``); Gemma 3 adds
per-head q/k norms over ``head_dim`` (never sliced). The embedding output is multiplied by
``sqrt(hidden_size)``, which changes when hidden channels are pruned: `_rescale` multiplies the
embedding by ``sqrt(old / new)`` so kept channels enter the first layer unchanged, and, as the
tied LM head, divides the final norm's ``1 + w`` by the same factor so the logits stay equal.
Soft-capping and ``query_pre_attn_scalar`` are constants; depth pruning slices ``layer_types``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from prune_distill.arch._spec import Resize
from prune_distill.arch.llama import llama_style

_EMBED = "model.embed_tokens.weight"
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


GEMMA2 = llama_style("gemma2", layer_norms=_NORMS, rescale=_rescale, buffers=_buffers)
GEMMA3 = llama_style(
    "gemma3",
    ("gemma3_text",),
    layer_norms=_NORMS,
    qk_norm="head_dim",
    rescale=_rescale,
    buffers=_buffers,
)
