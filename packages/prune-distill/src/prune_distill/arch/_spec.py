"""`ArchSpec`: what pruning needs to know about a family (module paths, parameter axes, config).

Every prunable tensor is described by the `Axis` each of its dimensions indexes (hidden, heads,
key/value heads, fused projections, MLP neurons, or never pruned), so one slicing routine serves
every family. A parameter the spec does not list makes pruning fail loudly instead of leaving a
stale tensor. Most families are written as differences from the Llama-style spec
(`arch.llama.llama_style`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

Axis = Literal["hidden", "q", "kv", "qkv", "qkv_heads", "ffn", "ffn2"] | None
"""What one dimension of a parameter indexes:

* ``"hidden"``: the residual stream (embedding width), one global index set for the model;
* ``"q"``: the query heads' inner width (and the input of the attention output projection),
  ``num_attention_heads * head_dim`` channels, head-major;
* ``"kv"``: the key/value width, ``num_key_value_heads * head_dim`` channels;
* ``"qkv"``: a fused ``[q | k | v]`` projection output (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``);
* ``"qkv_heads"``: a fused projection laid out per head, ``[q_h | k_h | v_h]`` for every head
  (GPT-NeoX ``query_key_value``; multi-head attention only);
* ``"ffn"``: the MLP inner width (neurons);
* ``"ffn2"``: a fused ``[gate | up]`` MLP input projection (Phi-3 ``gate_up_proj``);
* ``None``: a dimension that is never pruned (vocabulary, positions, a per-head norm).
"""
ParamAxes = Mapping[str, tuple[Axis, ...]]


@dataclass(frozen=True)
class Dims:
    """The prunable sizes of a model, read from its modules and config."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


@dataclass(frozen=True)
class Resize:
    """What `prune` did, for specs whose scales depend on a pruned size.

    Attributes:
        old: the source model's sizes.
        new: the pruned model's sizes.
        kept_layers: the source index of every kept layer, in order (new index = position).
        old_config: the source model's config.
        new_config: the pruned model's config.
    """

    old: Dims
    new: Dims
    kept_layers: tuple[int, ...]
    old_config: Any
    new_config: Any


def no_buffers(_config: Any) -> dict[str, torch.Tensor]:
    """The default `ArchSpec.buffers`: every non-persistent buffer is copied from the source."""
    return {}


def any_variant(_config: Any) -> None:
    """The default `ArchSpec.check`: every variant of the family is accepted."""


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """How one architecture family lays out its modules, parameters and config fields."""

    name: str
    """Family name used in messages."""
    model_types: tuple[str, ...]
    """``config.model_type`` values this spec handles."""
    layers: str
    """Dotted path of the decoder-layer `ModuleList`."""
    attn_out: str
    """Module (relative to a layer) whose *input* is the per-head attention output."""
    mlp_out: str
    """Module (relative to a layer) whose *input* is the MLP activation (one channel per neuron)."""
    layer_norms: tuple[str, ...]
    """Every per-layer norm over the hidden width; their outputs score hidden channels."""
    final_norm: str
    layer_params: ParamAxes
    """Parameter name relative to a layer -> the axis of each dimension."""
    top_params: ParamAxes
    """Parameter names outside the layers -> the axis of each dimension."""
    hidden_field: str = "hidden_size"
    ffn_field: str = "intermediate_size"
    heads_field: str = "num_attention_heads"
    kv_field: str | None = "num_key_value_heads"
    """None: no grouped-query attention (every head has its own keys and values)."""
    layers_field: str = "num_hidden_layers"
    head_dim_field: str | None = "head_dim"
    """None: the config derives head_dim as hidden / heads, so the attention width must stay
    equal to the hidden size (GPT-2, GPT-NeoX)."""
    layer_lists: tuple[str, ...] = ("layer_types",)
    """Per-layer config lists sliced on depth pruning."""
    rescale: Callable[[dict[str, torch.Tensor], Resize], None] | None = None
    """Adjusts the pruned state dict in place for scales that depend on a pruned size."""
    buffers: Callable[[Any], dict[str, torch.Tensor]] = no_buffers
    """Non-persistent buffers that must be recomputed from the new config (not copied)."""
    check: Callable[[Any], None] = any_variant
    """Raises `ValueError` for variants of the family that are not supported."""

    @property
    def layer_regex(self) -> re.Pattern[str]:
        """Matches `<layers>.<index>.<rest>` parameter names."""
        return re.compile(rf"^{re.escape(self.layers)}\.(\d+)\.(.+)$")


def linear(name: str, out: Axis, inp: Axis, *, bias: bool = True) -> dict[str, tuple[Axis, ...]]:
    """Axes of an `nn.Linear` called `name` (weight ``[out, in]``, optional bias ``[out]``)."""
    axes: dict[str, tuple[Axis, ...]] = {f"{name}.weight": (out, inp)}
    if bias:
        axes[f"{name}.bias"] = (out,)
    return axes


def norm(name: str, axis: Axis = "hidden", *, bias: bool = False) -> dict[str, tuple[Axis, ...]]:
    """Axes of a norm called `name` over `axis` (weight, optional bias)."""
    axes: dict[str, tuple[Axis, ...]] = {f"{name}.weight": (axis,)}
    if bias:
        axes[f"{name}.bias"] = (axis,)
    return axes


def norms(names: tuple[str, ...], *, bias: bool = False) -> dict[str, tuple[Axis, ...]]:
    """Axes of every norm in `names`, each over the hidden width."""
    return {key: axes for name in names for key, axes in norm(name, bias=bias).items()}
