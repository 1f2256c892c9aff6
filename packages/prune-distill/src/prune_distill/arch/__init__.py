"""Model families as data: one `ArchSpec` per family, one table (`FAMILIES`) here.

A Llama-style family is one `llama_style(...)` call naming what differs (norms, q/k norms,
fused projections, scales); GPT-2 and GPT-NeoX are `gpt_style(...)` calls naming their modules
(`gpt2.py`); another layout writes its `ArchSpec` out.
Adding a family is one short module and one line in `FAMILIES`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prune_distill.arch._spec import ArchSpec, Axis, Dims, Resize
from prune_distill.arch.gemma import GEMMA2, GEMMA3
from prune_distill.arch.gpt2 import GPT2, gpt_style
from prune_distill.arch.gpt_neox import GPT_NEOX
from prune_distill.arch.granite import GRANITE
from prune_distill.arch.llama import LLAMA, llama_style
from prune_distill.arch.olmo2 import OLMO2
from prune_distill.arch.phi3 import PHI3
from prune_distill.arch.qwen3 import QWEN3

FAMILIES: tuple[ArchSpec, ...] = (
    LLAMA,
    QWEN3,
    GEMMA2,
    GEMMA3,
    PHI3,
    OLMO2,
    GRANITE,
    GPT_NEOX,
    GPT2,
)
SUPPORTED: dict[str, ArchSpec] = {t: spec for spec in FAMILIES for t in spec.model_types}

__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "ArchSpec",
    "Axis",
    "Dims",
    "Resize",
    "arch_of",
    "dims_of",
    "gpt_style",
    "in_width",
    "layers_of",
    "llama_style",
    "model_device",
]


def arch_of(model: nn.Module) -> ArchSpec:
    """The `ArchSpec` of `model`, or a `ValueError` naming what is supported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = SUPPORTED.get(str(model_type))
    if spec is None:
        raise ValueError(
            f"unsupported architecture: `config.model_type` is {model_type!r} "
            f"({type(model).__name__}); supported: {sorted(SUPPORTED)}"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(
            f"`model` ({type(model).__name__}) has no `lm_head`: pass the causal-LM class "
            "(e.g. LlamaForCausalLM, GPT2LMHeadModel), not the bare backbone"
        )
    spec.check(config)
    return spec


def layers_of(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    """The decoder layers of `model`."""
    layers = model.get_submodule(spec.layers)
    assert isinstance(layers, nn.ModuleList)
    return layers


def in_width(module: nn.Module) -> int:
    """Input width of an `nn.Linear` or a transformers `Conv1D` (weight stored ``[in, out]``)."""
    if isinstance(module, nn.Linear):
        return module.in_features
    weight = getattr(module, "weight", None)
    assert isinstance(weight, torch.Tensor), type(module)
    return int(weight.shape[0])


def dims_of(model: nn.Module, spec: ArchSpec) -> Dims:
    """Read the prunable sizes of `model`."""
    config: Any = model.config
    first = layers_of(model, spec)[0]
    heads = int(getattr(config, spec.heads_field))
    head_dim = in_width(first.get_submodule(spec.attn_out)) // heads
    kv_heads = int(getattr(config, spec.kv_field)) if spec.kv_field else heads
    return Dims(
        hidden=int(getattr(config, spec.hidden_field)),
        ffn=in_width(first.get_submodule(spec.mlp_out)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layers=len(layers_of(model, spec)),
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter."""
    return next(model.parameters()).device
