"""Which modules and parameters of a supported causal LM carry which prunable axis.

Every prunable tensor is described by the axis each of its dimensions indexes:

* ``"hidden"``: the residual stream (embedding width), one global index set for the model;
* ``"q"``: the attention inner width of the query heads (and of the input of the output
  projection), ``num_attention_heads * head_dim`` channels;
* ``"kv"``: the key/value width, ``num_key_value_heads * head_dim`` channels;
* ``"qkv"``: GPT-2's fused ``c_attn`` output, three ``"q"`` blocks side by side;
* ``"ffn"``: the MLP inner width (neurons);
* ``None``: a dimension that is never pruned (vocabulary, positions).

A parameter the table does not know makes pruning fail loudly instead of silently producing a
model with a stale tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Axis = Literal["hidden", "q", "kv", "qkv", "ffn"] | None

_LLAMA_LAYER: dict[str, tuple[Axis, ...]] = {
    "self_attn.q_proj.weight": ("q", "hidden"),
    "self_attn.q_proj.bias": ("q",),
    "self_attn.k_proj.weight": ("kv", "hidden"),
    "self_attn.k_proj.bias": ("kv",),
    "self_attn.v_proj.weight": ("kv", "hidden"),
    "self_attn.v_proj.bias": ("kv",),
    "self_attn.o_proj.weight": ("hidden", "q"),
    "self_attn.o_proj.bias": ("hidden",),
    "mlp.gate_proj.weight": ("ffn", "hidden"),
    "mlp.gate_proj.bias": ("ffn",),
    "mlp.up_proj.weight": ("ffn", "hidden"),
    "mlp.up_proj.bias": ("ffn",),
    "mlp.down_proj.weight": ("hidden", "ffn"),
    "mlp.down_proj.bias": ("hidden",),
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
}
_LLAMA_TOP: dict[str, tuple[Axis, ...]] = {
    "model.embed_tokens.weight": (None, "hidden"),
    "model.norm.weight": ("hidden",),
    "lm_head.weight": (None, "hidden"),
    "lm_head.bias": (None,),
}

# GPT-2 stores Conv1D weights transposed: [in_features, out_features].
_GPT2_LAYER: dict[str, tuple[Axis, ...]] = {
    "ln_1.weight": ("hidden",),
    "ln_1.bias": ("hidden",),
    "attn.c_attn.weight": ("hidden", "qkv"),
    "attn.c_attn.bias": ("qkv",),
    "attn.c_proj.weight": ("q", "hidden"),
    "attn.c_proj.bias": ("hidden",),
    "ln_2.weight": ("hidden",),
    "ln_2.bias": ("hidden",),
    "mlp.c_fc.weight": ("hidden", "ffn"),
    "mlp.c_fc.bias": ("ffn",),
    "mlp.c_proj.weight": ("ffn", "hidden"),
    "mlp.c_proj.bias": ("hidden",),
}
_GPT2_TOP: dict[str, tuple[Axis, ...]] = {
    "transformer.wte.weight": (None, "hidden"),
    "transformer.wpe.weight": (None, "hidden"),
    "transformer.ln_f.weight": ("hidden",),
    "transformer.ln_f.bias": ("hidden",),
    "lm_head.weight": (None, "hidden"),
}


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture family lays out its modules, parameters and config fields."""

    family: Literal["llama", "gpt2"]
    layers: str
    """Dotted path of the decoder-layer `ModuleList`."""
    attn_out: str
    """Module (relative to a layer) whose *input* is the per-head attention output."""
    mlp_out: str
    """Module (relative to a layer) whose *input* is the MLP activation (one channel per neuron)."""
    layer_norms: tuple[str, ...]
    final_norm: str
    layer_params: dict[str, tuple[Axis, ...]]
    top_params: dict[str, tuple[Axis, ...]]
    hidden_field: str
    ffn_field: str
    heads_field: str
    kv_field: str | None
    layers_field: str

    @property
    def layer_regex(self) -> re.Pattern[str]:
        """Matches `<layers>.<index>.<rest>` parameter names."""
        return re.compile(rf"^{re.escape(self.layers)}\.(\d+)\.(.+)$")


LLAMA = ArchSpec(
    family="llama",
    layers="model.layers",
    attn_out="self_attn.o_proj",
    mlp_out="mlp.down_proj",
    layer_norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="model.norm",
    layer_params=_LLAMA_LAYER,
    top_params=_LLAMA_TOP,
    hidden_field="hidden_size",
    ffn_field="intermediate_size",
    heads_field="num_attention_heads",
    kv_field="num_key_value_heads",
    layers_field="num_hidden_layers",
)
GPT2 = ArchSpec(
    family="gpt2",
    layers="transformer.h",
    attn_out="attn.c_proj",
    mlp_out="mlp.c_proj",
    layer_norms=("ln_1", "ln_2"),
    final_norm="transformer.ln_f",
    layer_params=_GPT2_LAYER,
    top_params=_GPT2_TOP,
    hidden_field="n_embd",
    ffn_field="n_inner",
    heads_field="n_head",
    kv_field=None,
    layers_field="n_layer",
)

SUPPORTED: dict[str, ArchSpec] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gpt2": GPT2}


@dataclass(frozen=True)
class Dims:
    """The prunable sizes of a model, read from its modules (not only its config)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


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
    if spec.family == "gpt2" and getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with `add_cross_attention=True` is not supported")
    return spec


def layers_of(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    """The decoder layers of `model`."""
    layers = model.get_submodule(spec.layers)
    assert isinstance(layers, nn.ModuleList)
    return layers


def dims_of(model: nn.Module, spec: ArchSpec) -> Dims:
    """Read the prunable sizes of `model`."""
    config: Any = model.config
    layers = layers_of(model, spec)
    first = layers[0]
    heads = int(getattr(config, spec.heads_field))
    if spec.family == "llama":
        q_proj = first.get_submodule("self_attn.q_proj")
        k_proj = first.get_submodule("self_attn.k_proj")
        down = first.get_submodule("mlp.down_proj")
        assert isinstance(down, nn.Linear)
        ffn = down.in_features
        assert isinstance(q_proj, nn.Linear)
        assert isinstance(k_proj, nn.Linear)
        head_dim = q_proj.out_features // heads
        kv_heads = k_proj.out_features // head_dim
        hidden = q_proj.in_features
    else:
        hidden = int(config.n_embd)
        head_dim = hidden // heads
        kv_heads = heads
        c_fc: Any = first.get_submodule("mlp.c_fc")
        ffn = int(c_fc.weight.shape[1])
    return Dims(
        hidden=hidden,
        ffn=int(ffn),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        layers=len(layers),
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter."""
    return next(model.parameters()).device
