"""Masks from scores: unstructured, N:M and block. `True` = kept weight.

Every function takes a score tensor of a Linear weight's shape `(out_features, in_features)`
(larger = more important) and returns a boolean mask of that shape. Counts are exact: an
unstructured or block mask prunes exactly `round(sparsity * units)` units (elements or tiles);
an N:M mask keeps exactly `n` in every group of `m` consecutive input features.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from sparse_kernels.config import Pattern, SparsityConfig, check_int


def _ranked(scores: Tensor) -> Tensor:
    """Detached scores in the dtype they are ranked in.

    fp32 and fp64 as they are; anything narrower (bf16, fp16, integers) in fp32, which holds
    16-bit floats exactly.
    """
    s = scores.detach()
    return s if s.dtype in (torch.float32, torch.float64) else s.float()


def _prune_lowest(scores: Tensor, k: int) -> Tensor:
    """Mask of a 1-D score vector with its `k` lowest entries set to False."""
    mask = torch.ones_like(scores, dtype=torch.bool)
    if k > 0:
        mask[torch.topk(scores, k, largest=False, sorted=False).indices] = False
    return mask


def unstructured_mask(scores: Tensor, sparsity: float, *, per_row: bool = False) -> Tensor:
    """Prune the `round(sparsity · numel)` lowest scores (per row: `round(sparsity · cols)`).

    Args:
        scores: (out, in) importance scores.
        sparsity: fraction of zeros in [0, 1).
        per_row: rank within each output row instead of over the whole tensor.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"`sparsity` ({sparsity}) must be in [0, 1)")
    s = _ranked(scores)
    if not per_row or s.dim() < 2:
        return _prune_lowest(s.flatten(), round(sparsity * s.numel())).view_as(s)
    rows = s.reshape(s.shape[0], -1)
    k = round(sparsity * rows.shape[1])
    mask = torch.ones_like(rows, dtype=torch.bool)
    if k > 0:
        idx = torch.topk(rows, k, dim=1, largest=False, sorted=False).indices
        mask.scatter_(1, idx, False)
    return mask.view_as(s)


def nm_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the `n` largest scores in every group of `m` consecutive entries of each row.

    Args:
        scores: (out, in) importance scores; `in` must be a multiple of `m`.
        n: weights kept per group (0 < n < m).
        m: group size along the last (input) dimension.

    Raises:
        TypeError: if `n` or `m` is not an int.
        ValueError: unless 0 < n < m, or if `in` is not a multiple of `m`.
    """
    check_int("n", n)
    check_int("m", m)
    if not 0 < n < m:
        raise ValueError(f"`n` ({n}) must satisfy 0 < n < `m` ({m}) for N:M sparsity")
    s = _ranked(scores)
    cols = s.shape[-1]
    if cols % m:
        raise ValueError(
            f"the last dimension ({cols}) must be a multiple of `m` ({m}) for {n}:{m} sparsity"
        )
    groups = s.reshape(-1, cols // m, m)
    keep = torch.topk(groups, n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.view_as(s)


def block_scores(scores: Tensor, block_size: int) -> Tensor:
    """Mean score of each `block_size x block_size` tile; (ceil(out/b), ceil(in/b)).

    Edge tiles of a shape that is not a multiple of `block_size` average their real entries.
    """
    s = _ranked(scores)
    rows, cols = s.shape
    rb, cb = -(-rows // block_size), -(-cols // block_size)
    pad = (0, cb * block_size - cols, 0, rb * block_size - rows)
    total = torch.nn.functional.pad(s, pad).view(rb, block_size, cb, block_size).sum((1, 3))
    ones = torch.nn.functional.pad(torch.ones_like(s), pad)
    count = ones.view(rb, block_size, cb, block_size).sum((1, 3))
    return total / count


def expand_blocks(
    block_mask: Tensor, block_size: int, shape: torch.Size | tuple[int, ...]
) -> Tensor:
    """Element mask of `shape` from a (row-blocks, col-blocks) tile mask."""
    full = block_mask.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return full[: shape[0], : shape[1]].contiguous()


def block_mask(scores: Tensor, block_size: int, sparsity: float) -> Tensor:
    """Prune the `round(sparsity · tiles)` tiles with the lowest mean score.

    Args:
        scores: (out, in) importance scores (any shape; edge tiles may be partial).
        block_size: tile edge.
        sparsity: fraction of tiles pruned, in [0, 1).

    Raises:
        TypeError: if `block_size` is not an int.
        ValueError: for a non-2-D `scores`, `block_size` < 1 or `sparsity` outside [0, 1).
    """
    check_int("block_size", block_size)
    if scores.dim() != 2:
        raise ValueError(f"block sparsity needs a 2-D weight, got shape {tuple(scores.shape)}")
    if block_size < 1:
        raise ValueError(f"`block_size` ({block_size}) must be >= 1")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"`sparsity` ({sparsity}) must be in [0, 1)")
    tiles = block_scores(scores, block_size)
    keep = _prune_lowest(tiles.flatten(), round(sparsity * tiles.numel())).view_as(tiles)
    return expand_blocks(keep, block_size, scores.shape)


def warn_if_empty(mask: Tensor, layer: str, sparsity: float) -> None:
    """UserWarning naming `layer` when `mask` keeps nothing although `sparsity` < 1.

    The counts stay `round(sparsity · units)` as documented; a layer with few units (e.g. one
    or two 64x64 tiles at 0.75) can round to all of them, and its output is then the bias.
    """
    if sparsity < 1.0 and mask.numel() and not bool(mask.any()):
        warnings.warn(
            f"sparsity {sparsity} prunes every weight of `{layer}` (its {tuple(mask.shape)} "
            f"mask keeps nothing: round(sparsity · units) is all of its units); use a lower "
            f"sparsity or a smaller `block_size` to keep some",
            UserWarning,
            stacklevel=2,
        )


def mask_from_scores(
    scores: Tensor,
    pattern: Pattern,
    *,
    sparsity: float,
    block_size: int = 64,
    per_row: bool = False,
) -> Tensor:
    """Dispatch to the mask function of `pattern` (sparsity is ignored for N:M)."""
    if pattern.kind == "nm":
        return nm_mask(scores, pattern.n, pattern.m)
    if pattern.kind == "block":
        return block_mask(scores, block_size, sparsity)
    return unstructured_mask(scores, sparsity, per_row=per_row)


def mask_for_config(scores: Tensor, config: SparsityConfig) -> Tensor:
    """The mask `config` selects from `scores`."""
    return mask_from_scores(
        scores,
        config.parsed,
        sparsity=config.sparsity,
        block_size=config.block_size,
        per_row=config.granularity == "row",
    )
