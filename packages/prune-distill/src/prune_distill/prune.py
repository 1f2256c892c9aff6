"""Structured pruning to a uniform target shape, Minitron style.

`prune` ranks every axis with `ImportanceScores`, keeps the top entries **in their original order**
(so a target equal to the current shape is an exact copy) and slices the weights into a fresh model
of the same transformers class built from an updated config. The same number of neurons and heads
is kept in every layer (which ones differs per layer), so the result is a plain Hugging Face
checkpoint: `save_pretrained` then `AutoModelForCausalLM.from_pretrained` gives the same model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prune_distill._config_rules import longrope_conflict, writes_head_dim
from prune_distill.arch import ArchSpec, Axis, Dims, Resize, arch_of, dims_of
from prune_distill.config import PruneTarget
from prune_distill.importance import ImportanceScores


@dataclass(frozen=True)
class _Plan:
    """The resolved target: sizes and the indices kept on every axis."""

    dims: Dims
    kv_heads: int
    layers: list[int]
    hidden: torch.Tensor
    heads: list[torch.Tensor]
    q: list[torch.Tensor]
    kv: list[torch.Tensor]
    ffn: list[torch.Tensor]


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest scores, ascending (ties keep the earlier index)."""
    order = torch.sort(scores.float(), descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def _check_size(name: str, value: int | None, current: int) -> int:
    if value is None:
        return current
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int or None, got {type(value).__name__}")
    if not 1 <= value <= current:
        raise ValueError(
            f"`{name}` ({value}) must be between 1 and the model's current value ({current}): "
            "pruning can only shrink a model"
        )
    return value


def _head_channels(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def _plan(spec: ArchSpec, dims: Dims, scores: ImportanceScores, target: PruneTarget) -> _Plan:
    L = dims.layers
    expected = {
        "hidden": (dims.hidden,),
        "heads": (L, dims.heads),
        "neurons": (L, dims.ffn),
        "block_importance": (L,),
    }
    for name, shape in expected.items():
        got = tuple(getattr(scores, name).shape)
        if got != shape:
            raise ValueError(
                f"`scores.{name}` has shape {got} but the model needs {shape}: the scores were "
                "collected on a different model; run `collect_importance` on this one"
            )

    hidden = _check_size("hidden_size", target.hidden_size, dims.hidden)
    ffn = _check_size("intermediate_size", target.intermediate_size, dims.ffn)
    heads = _check_size("num_attention_heads", target.num_attention_heads, dims.heads)
    group = dims.heads // dims.kv_heads
    if spec.kv_field is None:
        if target.num_key_value_heads is not None:
            raise ValueError(
                f"`num_key_value_heads` ({target.num_key_value_heads}) is not a field of "
                f"{spec.name} models (no grouped-query attention); leave it None"
            )
        kv_heads = heads
    elif target.num_key_value_heads is None:
        kv_heads = heads if group == 1 else dims.kv_heads
    else:
        kv_heads = _check_size("num_key_value_heads", target.num_key_value_heads, dims.kv_heads)
    if heads % kv_heads:
        raise ValueError(
            f"`num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` "
            f"({kv_heads}): every KV group serves the same number of query heads"
        )
    if heads // kv_heads > group:
        raise ValueError(
            f"`num_attention_heads` / `num_key_value_heads` ({heads} / {kv_heads} = "
            f"{heads // kv_heads} query heads per KV group) must be <= the model's {group} per "
            "group: query heads are kept within their group. Keep more KV groups "
            f"(`num_key_value_heads` >= {-(-heads // group)}) or fewer query heads"
        )
    if spec.head_dim_field is None and hidden != heads * dims.head_dim:
        raise ValueError(
            f"`hidden_size` ({hidden}) must equal `num_attention_heads` ({heads}) x head_dim "
            f"({dims.head_dim}) = {heads * dims.head_dim} for {spec.name}, whose attention width "
            "is its hidden size: prune heads and hidden size together, e.g. "
            + _matching_sizes(target, dims.head_dim)
        )

    layers = _pick_layers(dims, scores, target)
    new_group = heads // kv_heads
    head_idx, q_idx, kv_idx, ffn_idx = [], [], [], []
    for i in layers:
        per_group = scores.heads[i].float().reshape(dims.kv_heads, group)
        kept_groups = _top(per_group.norm(dim=1), kv_heads)
        kept_heads = torch.cat([g * group + _top(per_group[g], new_group) for g in kept_groups])
        head_idx.append(kept_heads)
        q_idx.append(_head_channels(kept_heads, dims.head_dim))
        kv_idx.append(_head_channels(kept_groups, dims.head_dim))
        ffn_idx.append(_top(scores.neurons[i], ffn))
    return _Plan(
        dims=dims,
        kv_heads=kv_heads,
        layers=layers,
        hidden=_top(scores.hidden, hidden),
        heads=head_idx,
        q=q_idx,
        kv=kv_idx,
        ffn=ffn_idx,
    )


def _matching_sizes(target: PruneTarget, head_dim: int) -> str:
    """Heads and hidden size that agree, from the sizes `target` asks for (heads first)."""
    heads = [target.num_attention_heads] if target.num_attention_heads is not None else []
    if target.hidden_size is not None:
        heads.append(max(1, target.hidden_size // head_dim))
    return " or ".join(
        f"num_attention_heads={h}, hidden_size={h * head_dim}" for h in dict.fromkeys(heads)
    )


def _pick_layers(dims: Dims, scores: ImportanceScores, target: PruneTarget) -> list[int]:
    L = dims.layers
    keep = _check_size("num_hidden_layers", target.num_hidden_layers, L)
    if target.drop_layers is not None:
        drop = set(target.drop_layers)
        bad = sorted(i for i in drop if not 0 <= i < L)
        if bad or len(drop) != len(target.drop_layers):
            raise ValueError(
                f"`drop_layers` ({target.drop_layers}) must be distinct indices in [0, {L})"
            )
        if len(drop) >= L:
            raise ValueError(f"`drop_layers` ({target.drop_layers}) would drop all {L} layers")
        if target.num_hidden_layers is not None and keep != L - len(drop):
            raise ValueError(
                f"`num_hidden_layers` ({keep}) disagrees with `drop_layers` "
                f"({len(drop)} of {L} dropped leaves {L - len(drop)}); set only one of them"
            )
        return [i for i in range(L) if i not in drop]
    if keep == L:
        return list(range(L))
    if target.layer_metric == "block_importance":
        metric = scores.block_importance
    elif target.layer_metric == "lm_loss":
        if scores.lm_loss_increase is None:
            raise ValueError(
                "`layer_metric` is 'lm_loss' but the scores hold no `lm_loss_increase`: "
                "collect them with `collect_importance(..., layer_loss=True)`"
            )
        metric = scores.lm_loss_increase
    else:
        raise ValueError(
            f"`layer_metric` ({target.layer_metric!r}) must be 'block_importance' or 'lm_loss'"
        )
    return [int(i) for i in _top(metric, keep)]


def _new_config(model: nn.Module, spec: ArchSpec, plan: _Plan) -> Any:
    config: Any = copy.deepcopy(model.config)
    d = plan.dims
    heads = plan.q[0].numel() // d.head_dim if plan.q else d.heads
    updates: dict[str, Any] = {
        spec.hidden_field: int(plan.hidden.numel()),
        spec.ffn_field: int(plan.ffn[0].numel()) if plan.ffn else d.ffn,
        spec.heads_field: int(heads),
        spec.layers_field: len(plan.layers),
    }
    if spec.kv_field is not None:
        updates[spec.kv_field] = plan.kv_heads
    if spec.head_dim_field is not None and writes_head_dim(
        config, spec.head_dim_field, int(plan.hidden.numel()), int(heads), d.head_dim
    ):
        # The attention width may no longer follow hidden_size / heads: state head_dim.
        updates[spec.head_dim_field] = d.head_dim
    for name in spec.layer_lists:
        value = getattr(config, name, None)
        if isinstance(value, list | tuple) and len(value) == d.layers:
            updates[name] = [value[i] for i in plan.layers]
    window = getattr(config, "max_window_layers", None)
    if isinstance(window, int) and window < d.layers:
        updates["max_window_layers"] = sum(1 for i in plan.layers if i < window)
    for key, value in updates.items():
        setattr(config, key, value)
    try:
        type(config).from_dict(config.to_dict())
    except Exception as exc:
        hint = longrope_conflict(config, d.head_dim)
        if hint is not None:
            raise ValueError(
                f"{type(config).__name__} rejects the pruned shape {updates}: {hint}"
            ) from exc
        reason = " ".join(str(exc).split()).rstrip(".")
        raise ValueError(
            f"{type(config).__name__} rejects the pruned shape {updates}: {reason}. "
            "Choose sizes the config class accepts (e.g. hidden_size divisible by "
            "num_attention_heads)"
        ) from exc
    return config


def _index(axis: Axis, layer: int | None, plan: _Plan) -> torch.Tensor | None:
    if axis is None:
        return None
    if axis == "hidden":
        return plan.hidden
    assert layer is not None, f"axis {axis} outside a layer"
    d = plan.dims
    if axis == "q":
        return plan.q[layer]
    if axis == "kv":
        return plan.kv[layer]
    if axis == "ffn":
        return plan.ffn[layer]
    if axis == "ffn2":  # fused [gate | up]
        return torch.cat([plan.ffn[layer], plan.ffn[layer] + d.ffn])
    if axis == "qkv_heads":  # per head [q_h | k_h | v_h]
        return _head_channels(plan.heads[layer], 3 * d.head_dim)
    q_width, kv_width = d.heads * d.head_dim, d.kv_heads * d.head_dim  # "qkv": [q | k | v]
    kv = plan.kv[layer]
    return torch.cat([plan.q[layer], kv + q_width, kv + q_width + kv_width])


def _pruned_state(model: nn.Module, spec: ArchSpec, plan: _Plan) -> dict[str, torch.Tensor]:
    new_pos = {old: new for new, old in enumerate(plan.layers)}
    regex = spec.layer_regex
    done: dict[tuple[int, str, int | None], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = regex.match(name)
        if match:
            old, rest = int(match.group(1)), match.group(2)
            if old not in new_pos:
                continue
            layer: int | None = new_pos[old]
            axes = spec.layer_params.get(rest)
            new_name = f"{spec.layers}.{layer}.{rest}"
        else:
            layer, axes, new_name = None, spec.top_params.get(name), name
        if axes is None:
            raise ValueError(
                f"don't know how to prune parameter `{name}` of {type(model).__name__}: this "
                "variant of the architecture is not supported"
            )
        assert len(axes) == tensor.dim(), (name, axes, tensor.shape)
        key = (tensor.data_ptr(), ",".join(str(a) for a in axes), layer)
        if key not in done:  # tied tensors (embeddings / lm_head) are sliced once
            result = tensor
            for dim, axis in enumerate(axes):
                index = _index(axis, layer, plan)
                if index is not None:
                    result = result.index_select(dim, index.to(result.device))
            # index_select copies; clone the rest so the new model never shares storage.
            done[key] = result.clone() if result is tensor else result.contiguous()
        out[new_name] = done[key]
    return out


def prune(model: nn.Module, scores: ImportanceScores, target: PruneTarget) -> Any:
    """Return a pruned copy of `model` (same transformers class, updated config).

    The input model is not modified. Hidden channels are chosen once for the whole model; MLP
    neurons and heads per layer (the same count in every layer); query heads are ranked within
    their KV group and KV groups by the L2 norm of their query-head scores; layers by
    `target.layer_metric` (or dropped explicitly with `target.drop_layers`). Kept structures stay
    in their original order, layers are renumbered from 0.

    Args:
        model: a causal LM of a supported architecture (see `prune_distill.arch.SUPPORTED`).
        scores: `collect_importance(model, ...)` of this very model.
        target: the shape to prune to.

    Returns:
        A new model on the same device and dtype, in the same train/eval mode.

    Raises:
        ValueError: unsupported architecture, scores of another model, or an impossible target
            (larger than the model, heads not divisible by KV heads, a shape the config rejects).
    """
    spec = arch_of(model)
    dims = dims_of(model, spec)
    plan = _plan(spec, dims, scores, target)
    config = _new_config(model, spec, plan)
    state = _pruned_state(model, spec, plan)
    if spec.rescale is not None:
        new_dims = Dims(
            hidden=int(plan.hidden.numel()),
            ffn=int(plan.ffn[0].numel()) if plan.ffn else dims.ffn,
            heads=int(plan.heads[0].numel()) if plan.heads else dims.heads,
            kv_heads=plan.kv_heads,
            head_dim=dims.head_dim,
            layers=len(plan.layers),
        )
        resize = Resize(dims, new_dims, tuple(plan.layers), model.config, config)
        spec.rescale(state, resize)

    with torch.device("meta"):
        new: Any = type(model)(config)
    new.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        new.tie_weights()
    _copy_buffers(model, new, spec, plan, config)
    leftover = [n for n, t in [*new.named_parameters(), *new.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"internal error: pruned model has uninitialised tensors {leftover}")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        new.generation_config = copy.deepcopy(gen)
    new.train(model.training)
    return new


def _copy_buffers(
    model: nn.Module, new: nn.Module, spec: ArchSpec, plan: _Plan, config: Any
) -> None:
    """Fill buffers not in the state dict.

    Those the adapter derives from the new config (Gemma's embedding scale) are computed, and so
    are the rotary frequencies (`*inv_freq`: the rotary module rebuilt from its config, as
    `from_pretrained` builds it; copying them would copy what dynamic-NTK RoPE rewrote while the
    source model ran on long inputs). The rest are copied from the source model. Device and
    dtype are the source buffer's.
    """
    old_buffers = dict(model.named_buffers(remove_duplicate=False))  # aliases: dynamic RoPE
    fresh = spec.buffers(config)
    rebuilt: dict[str, dict[str, torch.Tensor]] = {}  # rotary module name -> its fresh buffers
    regex = spec.layer_regex
    for name, buf in list(new.named_buffers()):
        owner, _, attr = name.rpartition(".")
        match = regex.match(name)
        old_name = (
            f"{spec.layers}.{plan.layers[int(match.group(1))]}.{match.group(2)}" if match else name
        )
        source = old_buffers.get(old_name)
        if name not in fresh and not buf.is_meta:
            continue
        value = fresh.get(name)
        if value is None and attr.endswith("inv_freq"):
            value = _rotary(new, owner, rebuilt).get(attr)
        if value is None and source is not None:
            value = source.clone()
        if source is None or value is None or source.shape != value.shape:
            raise RuntimeError(f"internal error: cannot initialise buffer `{name}`")
        value = value.to(device=source.device, dtype=source.dtype)
        new.get_submodule(owner).register_buffer(attr, value, persistent=False)


def _rotary(
    new: nn.Module, owner: str, rebuilt: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The buffers of rotary module `owner`, built afresh on the CPU from its config.

    Empty if its class does not take the config alone.
    """
    if owner not in rebuilt:
        module = new.get_submodule(owner)
        try:
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            rebuilt[owner] = dict(fresh.named_buffers())
        except (TypeError, AttributeError):
            rebuilt[owner] = {}
    return rebuilt[owner]
