"""`sparsify_`: prune a model's Linear layers in place and keep them pruned.

A mask is attached to `linear.weight` as a `torch.nn.utils.parametrize` parametrization: the
trainable tensor becomes `linear.parametrizations.weight.original` and every read of
`linear.weight` returns `original * mask`. The module is still an `nn.Linear` (same call, same
shapes, bias kept). Because the effective weight is a product with a fixed 0/1 mask:

* it is exactly zero outside the mask whatever an optimizer does to `original` (weight decay,
  momentum, Adam moments: none of them can leak into the effective weight);
* the gradient of `original` is zero outside the mask;
* `state_dict()` holds `original` and the mask buffer, so save -> load into a sparsified model
  restores both (`export.py` writes plain HF checkpoints with the mask baked in).

`original` is also zeroed outside the mask when the mask is applied, so it starts consistent.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from sparse_kernels.calibration import InputStats, collect_input_stats
from sparse_kernels.config import SparsityConfig, check_targets_type
from sparse_kernels.masks import mask_for_config, warn_if_empty
from sparse_kernels.sequential import prune_sequential_
from sparse_kernels.sparsegpt import sparsegpt_prune


class WeightMask(nn.Module):
    """Parametrization `W -> W * mask` with a boolean `mask` buffer (saved in state_dict)."""

    mask: Tensor

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool))

    def forward(self, weight: Tensor) -> Tensor:
        """The masked weight (zeros outside the mask)."""
        return weight * self.mask


def stored_weight(linear: nn.Module) -> Tensor:
    """The trainable tensor behind `linear.weight` (`original` when parametrized)."""
    if parametrize.is_parametrized(linear, "weight"):
        plist: Any = getattr(linear, "parametrizations")["weight"]  # noqa: B009
        original: Tensor = plist.original
        return original
    weight = linear.weight
    assert isinstance(weight, Tensor)
    return weight


def _mask_module(linear: nn.Module) -> WeightMask | None:
    if not parametrize.is_parametrized(linear, "weight"):
        return None
    plist: Any = getattr(linear, "parametrizations")["weight"]  # noqa: B009
    for p in plist:
        if isinstance(p, WeightMask):
            return p
    return None


def _in_module_list(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for child_name, _ in module.named_modules():
                if child_name:
                    names.add(f"{name}.{child_name}" if name else child_name)
    return names


def select_targets(model: nn.Module, targets: Iterable[str] | None = None) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules `sparsify_` prunes, by qualified name.

    Args:
        model: any module.
        targets: regexes matched with `re.search` against qualified names; `None` selects
            every Linear inside an `nn.ModuleList` (the decoder blocks of HF models), which
            never includes embeddings or `lm_head`.

    Raises:
        TypeError: if `targets` is a single string (its characters would be the regexes).
    """
    check_targets_type(targets)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if targets is None:
        inside = _in_module_list(model)
        return {n: m for n, m in linears.items() if n in inside}
    patterns = [re.compile(t) for t in targets]
    return {n: m for n, m in linears.items() if any(p.search(n) for p in patterns)}


def _blocks_of(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The outermost `nn.ModuleList` elements (decoder blocks) that contain the modules `names`."""
    blocks = sorted(
        {
            f"{list_name}.{child}" if list_name else child
            for list_name, module in model.named_modules()
            if isinstance(module, nn.ModuleList)
            for child, _ in module.named_children()
        },
        key=len,
    )
    found: list[str] = []
    for name in names:
        block = next((b for b in blocks if name.startswith(f"{b}.")), None)
        if block is not None and block not in found:
            found.append(block)
    return found


def dense_weights(model: nn.Module, names: Iterable[str]) -> tuple[dict[str, Tensor], float]:
    """The matrix weights in the decoder blocks of `names` that no mask can cover.

    These are the Parameters (frozen or not: one-shot pruning often runs on a frozen model)
    with two or more dimensions inside the decoder blocks
    (elements of an `nn.ModuleList`) holding the modules `names` that are neither an
    `nn.Linear`'s weight nor a `BlockSparseLinear`'s tiles: e.g. the experts of a transformers-5
    MoE block, stored as 3-D tensors, or its router. `sparsify_` and the schedules prune only
    `nn.Linear` modules, so these stay dense.

    Args:
        model: the model.
        names: qualified names of the targeted modules.

    Returns:
        Qualified parameter name -> Parameter, and the share of the blocks' matrix weights
        (elements of Parameters with two or more dimensions) these hold.
    """
    from sparse_kernels.block_sparse import BlockSparseLinear  # torch-heavy: only here

    covered: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            covered.add(id(stored_weight(module)))
        elif isinstance(module, BlockSparseLinear):
            covered.update(id(p) for p in module.parameters())
    seen: set[int] = set()
    dense: dict[str, Tensor] = {}
    total = 0
    for block in _blocks_of(model, names):
        for name, param in model.get_submodule(block).named_parameters(prefix=block):
            if param.dim() < 2 or id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            if id(param) not in covered:
                dense[name] = param
    share = sum(p.numel() for p in dense.values()) / total if total else 0.0
    return dense, share


def warn_dense_weights(model: nn.Module, names: Iterable[str], caller: str) -> None:
    """UserWarning naming the `dense_weights` of the targeted blocks, if there are any."""
    dense, share = dense_weights(model, names)
    if not dense:
        return
    listed = ", ".join(list(dense)[:4]) + (", ..." if len(dense) > 4 else "")
    warnings.warn(
        f"{caller} prunes nn.Linear modules only: {len(dense)} weight Parameter(s) in the "
        f"targeted decoder blocks are not nn.Linear weights and stay dense ({listed}), "
        f"{share:.1%} of those blocks' matrix weights (e.g. MoE experts stored as 3-D tensors); "
        f"`sparsity_report` lists them",
        UserWarning,
        stacklevel=3,
    )


@torch.no_grad()
def apply_mask_(linear: nn.Linear, mask: Tensor) -> None:
    """Attach (or replace) the weight mask of `linear`; zeroes the stored weight outside it.

    Raises:
        ValueError: if `mask` does not have the weight's shape.
    """
    mod = _mask_module(linear)
    shape = (linear.out_features, linear.in_features)
    if tuple(mask.shape) != shape:
        raise ValueError(f"`mask` shape {tuple(mask.shape)} must equal the weight's {shape}")
    # a copy: the module's mask changes in place later (a new mask, a schedule step), the
    # caller's tensor (e.g. what `sparsify_` returned) must not change with it
    mask = mask.to(device=linear.weight.device, dtype=torch.bool, copy=True)
    if mod is None:
        parametrize.register_parametrization(linear, "weight", WeightMask(mask))
        mod = _mask_module(linear)
        assert mod is not None
    else:
        mod.mask.copy_(mask)
    stored_weight(linear).mul_(mod.mask)


def get_mask(linear: nn.Module) -> Tensor | None:
    """The boolean mask attached by `apply_mask_` / `sparsify_`, or None."""
    mod = _mask_module(linear)
    return None if mod is None else mod.mask


def masks(model: nn.Module) -> dict[str, Tensor]:
    """Qualified name -> mask of every masked Linear in `model`."""
    out = {}
    for name, module in model.named_modules():
        mask = get_mask(module)
        if mask is not None:
            out[name] = mask
    return out


def remove_masks_(model: nn.Module) -> None:
    """Bake the masks in (weights keep their zeros) and drop the parametrizations.

    The `weight` Parameter object is kept (`parametrize` reuses `original`), so an optimizer
    built on the sparsified model keeps working: training continues dense.
    """
    for module in model.modules():
        if _mask_module(module) is not None:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def sparsity_report(model: nn.Module) -> dict[str, float]:
    """Qualified name -> fraction of zeros, for every masked Linear and every dense weight.

    The masked Linears are listed by module name (zeros of the effective weight). The matrix
    weights that no mask can cover in the decoder blocks holding them (`dense_weights`: e.g.
    MoE experts stored as 3-D tensors) are listed too, by parameter name, so the report shows
    how much of the blocks stays dense.
    """
    out = {}
    for name, module in model.named_modules():
        if get_mask(module) is not None:
            w = module.weight
            assert isinstance(w, Tensor)
            out[name] = float((w == 0).float().mean())
    dense, _ = dense_weights(model, list(out))
    for name, param in dense.items():
        out[name] = float((param.detach() == 0).float().mean())
    return out


def check_targets(modules: Mapping[str, nn.Linear], config: SparsityConfig) -> None:
    """ValueError naming every target whose shape `config.pattern` cannot prune.

    N:M groups `m` consecutive input features, so `in_features` must be a multiple of `m`.
    """
    pattern = config.parsed
    if pattern.kind != "nm":
        return
    bad = {n: lin.in_features for n, lin in modules.items() if lin.in_features % pattern.m}
    if bad:
        raise ValueError(
            f"`pattern` {config.pattern!r} needs `in_features` to be a multiple of {pattern.m}; "
            f"not so for {', '.join(f'{n} (in_features={k})' for n, k in bad.items())}: "
            f"leave them out of `targets` or pick another pattern"
        )


def check_reached(stats: Mapping[str, InputStats]) -> None:
    """ValueError naming the targets that no calibration token reached."""
    missing = [name for name, st in stats.items() if st.tokens == 0]
    if missing:
        raise ValueError(
            f"no calibration token reached {', '.join(missing)}: the model's forward on the "
            f"`calibration` batches never calls them (or every position is masked out); "
            f"leave them out of `targets` or check the batches"
        )


def _prune_with_stats(
    name: str, linear: nn.Linear, config: SparsityConfig, stats: InputStats | None
) -> Tensor:
    """Prune one Linear by `config.method` and attach its mask; return the mask."""
    weight = linear.weight.detach()
    if config.method != "magnitude" and (stats is None or stats.tokens == 0):
        check_reached({name: stats or InputStats()})
    if config.method == "magnitude":
        mask = mask_for_config(weight.abs(), config)
    elif config.method == "wanda":
        assert stats is not None, name
        assert stats.sumsq is not None, name
        norms = stats.sumsq.to(weight.device).sqrt()
        mask = mask_for_config(weight.abs().float() * norms[None, :], config)
    else:
        assert stats is not None, name
        new_weight, mask = sparsegpt_prune(
            weight,
            stats.hessian().to(weight.device),
            config.parsed,
            sparsity=config.sparsity,
            block_size=config.block_size,
            blocksize=config.sparsegpt_block,
            dampening=config.dampening,
            per_row=config.granularity == "row",
        )
        stored_weight(linear).copy_(new_weight)
    if config.parsed.kind != "nm":  # N:M masks keep n of every m
        warn_if_empty(mask, name, config.sparsity)
    apply_mask_(linear, mask)
    return mask


@torch.no_grad()
def sparsify_(
    model: nn.Module,
    config: SparsityConfig,
    *,
    calibration: Iterable[Mapping[str, Any]] | None = None,
    sequential: bool = False,
) -> dict[str, Tensor]:
    """Prune the targeted Linear layers of `model` in place and keep them pruned.

    Args:
        model: e.g. a Hugging Face causal LM.
        config: pattern, sparsity, method, targets.
        calibration: iterable of dicts of model kwargs (`input_ids`, optional
            `attention_mask`); required by `wanda` and `sparsegpt`.
        sequential: wanda / sparsegpt only. False: run all batches through the dense model
            once and hold every target's statistics at once (a SparseGPT Hessian is
            in_features² fp32 per Linear). True: walk the decoder layers in order, scoring each
            layer on the outputs of the already-pruned layers before it, with one layer's
            statistics in memory at a time (`sequential.py`; Llama-style layouts only, every
            target inside a decoder layer). `calibration` is iterated once either way.

    Returns:
        Qualified name -> boolean mask (True = kept) of every pruned Linear.

    Raises:
        ValueError: if no module is targeted, a target's shape does not fit the pattern (N:M:
            `in_features % m`), calibration is missing for wanda/sparsegpt, no calibration
            token reaches a target, or (sequential) the model layout is unsupported or a
            target is outside the layers. The messages name the modules. Every check but the
            last two runs before any change to the model; an unreached target raises before
            any Linear is pruned in one-shot mode, and before its own layer is pruned in
            sequential mode (earlier layers are pruned by then).
    """
    modules = select_targets(model, config.targets)
    if not modules:
        raise ValueError(
            f"no nn.Linear matched `targets` ({config.targets!r}); pass regexes on module names"
        )
    check_targets(modules, config)
    warn_dense_weights(model, modules, "sparsify_")
    if config.method == "magnitude":
        return {name: _prune_with_stats(name, lin, config, None) for name, lin in modules.items()}
    if calibration is None:
        raise ValueError(f"method {config.method!r} needs `calibration` batches")
    hessian = config.method == "sparsegpt"
    out: dict[str, Tensor] = {}
    if sequential:

        def prune(name: str, linear: nn.Linear, stats: InputStats) -> None:
            out[name] = _prune_with_stats(name, linear, config, stats)

        prune_sequential_(model, modules, calibration, prune, hessian=hessian)
        return {name: out[name] for name in modules}
    all_stats = collect_input_stats(model, modules, calibration, hessian=hessian)
    check_reached(all_stats)
    for name, linear in modules.items():
        out[name] = _prune_with_stats(name, linear, config, all_stats.pop(name))
    return out
