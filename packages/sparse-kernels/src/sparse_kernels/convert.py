"""Swap a model's Linear layers for `BlockSparseLinear` (only the active tiles stored), and back."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from sparse_kernels.block_sparse import Backend, BlockSparseLinear
from sparse_kernels.config import check_int
from sparse_kernels.masks import block_scores, expand_blocks
from sparse_kernels.sparsify import apply_mask_, get_mask, select_targets


def to_block_sparse_(
    model: nn.Module,
    *,
    block_size: int = 64,
    sparsity: float | None = None,
    targets: Sequence[str] | None = None,
    backend: Backend = "auto",
) -> dict[str, BlockSparseLinear]:
    """Replace the targeted Linears of `model` in place by `BlockSparseLinear` modules.

    With `sparsity=None` each target must carry a block-structured mask (e.g. from
    `sparsify_(model, SparsityConfig(pattern="block", block_size=...))` or a block
    `GradualPruning`): its tiles are kept exactly. With a `sparsity`, tiles are chosen by mean
    |W| (`BlockSparseLinear.from_dense`). Weights and biases are copied; the new modules are
    called like the Linears they replace.

    Args:
        model: the model.
        block_size: tile edge.
        sparsity: fraction of tiles to drop, or None to reuse the existing masks.
        targets: module regexes as in `SparsityConfig.targets`.
        backend: `"auto"`, `"torch"` or `"triton"`.

    Returns:
        Qualified name -> the new module.

    Raises:
        ValueError: if a target has no mask (with `sparsity=None`) or its mask is not made of
            whole `block_size` tiles, or `block_size` < 1. Every target is checked before any
            is replaced, so on an error the model is unchanged.
        TypeError: if `block_size` is not an int or `targets` is a single string.
    """
    check_int("block_size", block_size)
    if block_size < 1:
        raise ValueError(f"`block_size` ({block_size}) must be >= 1")
    # every target is checked (and its tiles read) before any is replaced
    block_masks: dict[str, Tensor | None] = {}
    linears = select_targets(model, targets)
    for name, linear in linears.items():
        block_masks[name] = None
        if sparsity is None:
            mask = get_mask(linear)
            if mask is None:
                raise ValueError(
                    f"{name} has no mask: pass `sparsity`, or sparsify_ with pattern='block' first"
                )
            tiles = block_scores(mask.float(), block_size)
            if not bool(((tiles == 0) | (tiles == 1)).all()):
                raise ValueError(
                    f"the mask of {name} is not made of whole {block_size}x{block_size} tiles"
                )
            block_masks[name] = tiles == 1
    out = {}
    for name, linear in linears.items():
        new = BlockSparseLinear.from_dense(
            linear,
            block_size=block_size,
            sparsity=0.0 if sparsity is None else sparsity,
            block_mask=block_masks[name],
            backend=backend,
        )
        _replace(model, name, new)
        out[name] = new
    return out


def to_masked_linear_(model: nn.Module) -> dict[str, nn.Linear]:
    """Replace every `BlockSparseLinear` of `model` in place by a masked `nn.Linear`.

    The inverse of `to_block_sparse_` on masked Linears: each new Linear carries the mask of the
    stored tiles (`apply_mask_`, cropped to the weight's shape) and holds the dense weight with
    zeros outside them, in the tiles' dtype and device, and the bias. The effective weights,
    masks and biases are exactly those of the block-sparse modules, so the model saves and
    reloads as one `sparsify_` pruned (`save_pretrained_sparse`, `load_masks_`).

    Args:
        model: the model (a `BlockSparseLinear` itself is not replaced; pass its parent).

    Returns:
        Qualified name -> the new Linear.
    """
    out = {}
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, BlockSparseLinear) or not name:
            continue
        linear = layer.to_linear()
        shape = (layer.out_features, layer.in_features)
        apply_mask_(linear, expand_blocks(layer.layout.block_mask(), layer.block_size, shape))
        _replace(model, name, linear)
        out[name] = linear
    return out


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)
