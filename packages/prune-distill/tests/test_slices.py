"""Pruned weights are exactly the kept slices of the original, for every family.

The kept index sets are recomputed here from the scores (top-k, original order; query heads
within their KV group, KV groups by the L2 norm of their heads' scores) and every parameter of
the pruned model is compared with the original tensor indexed by them. The per-family layouts
below were written from the transformers modeling code, independently of the adapters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from prune_distill import PruneTarget, collect_importance, prune

LAYERS = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


# axis names: h = hidden, q = query channels, kv = key/value channels, f = MLP neurons,
# qkv = fused [q | k | v], qkv_h = per-head [q_h | k_h | v_h], f2 = fused [gate | up], None = all
_LINEAR_ATTN = {
    "self_attn.q_proj": ("q", "h"),
    "self_attn.k_proj": ("kv", "h"),
    "self_attn.v_proj": ("kv", "h"),
    "self_attn.o_proj": ("h", "q"),
}
_GATED = {"mlp.gate_proj": ("f", "h"), "mlp.up_proj": ("f", "h"), "mlp.down_proj": ("h", "f")}
_LLAMA = {**_LINEAR_ATTN, **_GATED, "input_layernorm": ("h",), "post_attention_layernorm": ("h",)}
_GEMMA = {**_LLAMA, "pre_feedforward_layernorm": ("h",), "post_feedforward_layernorm": ("h",)}
_TOP = {"model.embed_tokens": (None, "h"), "model.norm": ("h",), "lm_head": (None, "h")}
LAYOUT: dict[str, tuple[dict[str, tuple[Any, ...]], dict[str, tuple[Any, ...]]]] = {
    "llama": (_LLAMA, _TOP),
    "mistral": (_LLAMA, _TOP),
    "qwen2": (_LLAMA, _TOP),
    "granite": (_LLAMA, _TOP),
    "qwen3": ({**_LLAMA, "self_attn.q_norm": (None,), "self_attn.k_norm": (None,)}, _TOP),
    "gemma2": (_GEMMA, _TOP),
    "gemma3": ({**_GEMMA, "self_attn.q_norm": (None,), "self_attn.k_norm": (None,)}, _TOP),
    "olmo2": (
        {
            **_LINEAR_ATTN,
            **_GATED,
            "self_attn.q_norm": ("q",),
            "self_attn.k_norm": ("kv",),
            "post_attention_layernorm": ("h",),
            "post_feedforward_layernorm": ("h",),
        },
        _TOP,
    ),
    "phi3": (
        {
            "self_attn.qkv_proj": ("qkv", "h"),
            "self_attn.o_proj": ("h", "q"),
            "mlp.gate_up_proj": ("f2", "h"),
            "mlp.down_proj": ("h", "f"),
            "input_layernorm": ("h",),
            "post_attention_layernorm": ("h",),
        },
        _TOP,
    ),
    "gpt_neox": (
        {
            "attention.query_key_value": ("qkv_h", "h"),
            "attention.dense": ("h", "q"),
            "mlp.dense_h_to_4h": ("f", "h"),
            "mlp.dense_4h_to_h": ("h", "f"),
            "input_layernorm": ("h",),
            "post_attention_layernorm": ("h",),
        },
        {
            "gpt_neox.embed_in": (None, "h"),
            "gpt_neox.final_layer_norm": ("h",),
            "lm_head": (None, "h"),
        },
    ),
    "gpt2": (  # Conv1D: weight stored [in, out], listed here in that order
        {
            "attn.c_attn": ("h", "qkv"),
            "attn.c_proj": ("q", "h"),
            "mlp.c_fc": ("h", "f"),
            "mlp.c_proj": ("f", "h"),
            "ln_1": ("h",),
            "ln_2": ("h",),
        },
        {
            "transformer.wte": (None, "h"),
            "transformer.wpe": (None, "h"),
            "transformer.ln_f": ("h",),
            "lm_head": (None, "h"),
        },
    ),
}


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(torch.sort(scores, descending=True, stable=True).indices[:k]).values


def _channels(units: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([torch.arange(u * width, (u + 1) * width) for u in units.tolist()])


def _indices(model: Any, scores: Any, target: PruneTarget, layer: int) -> dict[str, Any]:
    """The kept channels of every axis in source layer `layer`, computed from the scores."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    ffn = getattr(c, "intermediate_size", None) or c.n_inner
    new_heads = target.num_attention_heads
    group = heads // kv_heads
    new_kv = target.num_key_value_heads or (new_heads if group == 1 else kv_heads)
    per_group = scores.heads[layer].reshape(kv_heads, group)
    groups = _top(per_group.norm(dim=1), new_kv)
    kept = torch.cat([g * group + _top(per_group[g], new_heads // new_kv) for g in groups])
    q, kv = _channels(kept, head_dim), _channels(groups, head_dim)
    f = _top(scores.neurons[layer], target.intermediate_size)
    Q, KV = heads * head_dim, kv_heads * head_dim
    return {
        "h": _top(scores.hidden, target.hidden_size),
        "q": q,
        "kv": kv,
        "f": f,
        "qkv": torch.cat([q, Q + kv, Q + KV + kv]),
        "qkv_h": _channels(kept, 3 * head_dim),
        "f2": torch.cat([f, ffn + f]),
        None: None,
    }


def _slice(t: torch.Tensor, axes: tuple[Any, ...], idx: dict[str, Any]) -> torch.Tensor:
    for dim, axis in enumerate(axes):
        if idx[axis] is not None:
            t = t.index_select(dim, idx[axis])
    return t


@torch.no_grad()
def test_pruned_weights_are_the_kept_slices(arch, make, data, targets):
    model = make(arch, num_hidden_layers=4, **({"layer_types": None} if "gemma" in arch else {}))
    target = dataclasses.replace(targets[arch], num_hidden_layers=3)
    scores = collect_importance(model, data(), layer_loss=False)
    student = prune(model, scores, target)
    layers = LAYERS.get(arch, "model.layers")
    kept_layers = _top(scores.block_importance, 3).tolist()
    per_layer, top = LAYOUT[arch]
    old = dict(model.named_parameters(remove_duplicate=False))
    checked = set()
    for name, new in student.named_parameters(remove_duplicate=False):
        module, _, kind = name.rpartition(".")
        if module.startswith(layers + "."):
            new_i, rest = module[len(layers) + 1 :].split(".", 1)
            src = kept_layers[int(new_i)]
            idx = _indices(model, scores, target, src)
            axes = per_layer[rest]
            source = old[f"{layers}.{src}.{rest}.{kind}"]
        else:
            idx = _indices(model, scores, target, 0)
            axes = top[module]
            source = old[name]
        if kind == "bias":
            axes = axes[-1:] if arch == "gpt2" else axes[:1]
        expect = _slice(source, axes, idx)
        if "gemma" in arch:  # sqrt(hidden) embedding scale compensated in the weights
            factor = math.sqrt(model.config.hidden_size / target.hidden_size)
            if module == "model.embed_tokens" or (
                module == "lm_head" and model.config.tie_word_embeddings
            ):
                expect = expect * factor
            elif module == "model.norm" and model.config.tie_word_embeddings:
                expect = (1 + expect) / factor - 1
        torch.testing.assert_close(new, expect, rtol=1e-6, atol=1e-7, msg=name)
        checked.add(name)
    assert len(checked) == len(list(student.named_parameters(remove_duplicate=False)))


# --- dead query heads, every family --------------------------------------------------------


def _zero_head_outputs(model: Any, arch: str, heads: list[int], head_dim: int) -> None:
    """Zero the attention-output-projection inputs of `heads` in every layer."""
    for layer in model.get_submodule(LAYERS.get(arch, "model.layers")):
        cols = _channels(torch.tensor(heads), head_dim)
        if arch == "gpt2":  # Conv1D [in, out]
            layer.attn.c_proj.weight[cols] = 0
        elif arch == "gpt_neox":
            layer.attention.dense.weight[:, cols] = 0
        else:
            layer.self_attn.o_proj.weight[:, cols] = 0


@pytest.mark.parametrize("arch_", ["llama", "qwen3", "gemma2", "gemma3", "phi3", "granite"])
@torch.no_grad()
def test_dead_query_heads_pruned_exactly(arch_, make, data):
    """Heads whose output-projection columns are zero contribute nothing: dropping them (scored
    lowest) is exact. Half the heads of every KV group die. (OLMo 2's whole-projection q norm
    is covered by the KV-group test in test_prune.py; GPT-2 and GPT-NeoX tie the attention
    width to the hidden size, see the tests below.)"""
    model = make(arch_)
    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    group = heads // kv
    dead = [g * group + j for g in range(kv) for j in range(group) if j % 2 == 1]
    if group == 1:
        dead = list(range(1, heads, 2))
    _zero_head_outputs(model, arch_, dead, c.head_dim)
    scores = collect_importance(model, data(), layer_loss=False)
    hand = torch.ones_like(scores.heads)
    hand[:, dead] = 0
    keep = heads - len(dead)
    student = prune(
        model, dataclasses.replace(scores, heads=hand), PruneTarget(num_attention_heads=keep)
    )
    assert student.config.num_attention_heads == keep
    ids = data(1, seed=1)[0]["input_ids"]
    torch.testing.assert_close(logits(student, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch_", ["granite", "gpt_neox"])
@torch.no_grad()
def test_dead_value_heads_score_zero(arch_, make, data):
    """Multi-head families: a head with zero value rows outputs exactly 0, so it scores exactly 0
    and every other head scores > 0."""
    model = make(arch_)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dead = (0, 3, 2)
    for layer, h in zip(model.get_submodule(LAYERS.get(arch_, "model.layers")), dead, strict=True):
        if arch_ == "gpt_neox":  # per head [q_h | k_h | v_h]
            rows = torch.arange(h * 3 * head_dim + 2 * head_dim, (h + 1) * 3 * head_dim)
            layer.attention.query_key_value.weight[rows] = 0
            layer.attention.query_key_value.bias[rows] = 0
        else:
            rows = torch.arange(h * head_dim, (h + 1) * head_dim)
            layer.self_attn.v_proj.weight[rows] = 0
            layer.self_attn.v_proj.bias[rows] = 0
    scores = collect_importance(model, data(), layer_loss=False)
    for i, h in enumerate(dead):
        assert scores.heads[i, h] == 0
        assert int((scores.heads[i] > 0).sum()) == c.num_attention_heads - 1
