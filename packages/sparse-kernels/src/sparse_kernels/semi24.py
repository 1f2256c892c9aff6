"""2:4 compression: kept values + 2-bit indices, and dispatch to torch's 2:4 kernels on CUDA.

A 2:4 matrix (at most 2 non-zeros in every group of 4 consecutive entries of a row) of shape
(rows, cols) is stored as

* `values` (rows, cols / 2): the 2 kept entries of each group, in column order;
* `meta` int16 (rows, ceil(cols / 16)): per group the 4-bit code `idx0 | idx1 << 2`
  (`idx0 < idx1`, positions inside the group), 4 groups per int16 with the first group in the
  lowest bits. This is the encoding CUTLASS (and `torch.sparse` semi-structured tensors with
  the CUTLASS backend) use for fp16/bf16; `layout="cutlass"` additionally applies CUTLASS's
  interleaved column-major reordering of `meta` (rows % 32 == 0 and cols % 32 == 0 required),
  so `torch.sparse._semi_structured_conversions.sparse_semi_structured_to_dense_cutlass`
  decodes it.

For fp16/bf16 the compressed size is 50% values + 1/16 metadata = 56.25% of the dense bytes.
Groups with fewer than 2 non-zeros store a zero at a padding position. The round trip
`decompress_24(*compress_24(w), cols)` is exact (bitwise) for every 2:4 matrix.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from sparse_kernels._semi24_kernels import compress_24_triton, decompress_24_triton
from sparse_kernels._triton import available

MetaLayout = Literal["rowmajor", "cutlass"]
Backend = Literal["auto", "torch", "triton"]


def is_24(weight: Tensor) -> bool:
    """Whether every group of 4 consecutive entries along the last dim has <= 2 non-zeros."""
    if weight.shape[-1] % 4:
        return False
    groups = (weight != 0).reshape(*weight.shape[:-1], -1, 4)
    return bool((groups.sum(-1) <= 2).all())


def _cutlass_offsets(rows: int, meta_cols: int, device: torch.device) -> Tensor:
    # CUTLASS's ColumnMajorInterleaved<2> reordering of the metadata, as torch computes it.
    from torch.sparse._semi_structured_conversions import (
        _calculate_meta_reordering_scatter_offsets,
    )

    offsets: Tensor = _calculate_meta_reordering_scatter_offsets(  # type: ignore[no-untyped-call]
        rows, meta_cols, torch.int16, device
    )
    return offsets


def _check_cutlass(rows: int, cols: int, dtype: torch.dtype) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"layout 'cutlass' supports fp16/bf16 values, got {dtype}")
    if rows % 32 or cols % 32:
        raise ValueError(
            f"layout 'cutlass' needs rows % 32 == 0 and cols % 32 == 0, got ({rows}, {cols})"
        )


@torch.no_grad()
def compress_24(
    weight: Tensor,
    *,
    layout: MetaLayout = "rowmajor",
    mask: Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """Compress a 2:4 matrix into (values, meta).

    Args:
        weight: (rows, cols) with cols % 4 == 0 and at most 2 non-zeros per group of 4.
        layout: `"rowmajor"` metadata, or `"cutlass"` (reordered for CUTLASS; fp16/bf16).
        mask: optional boolean 2:4 mask to encode instead of the non-zeros (so a kept weight
            that happens to be 0 stays "kept"; `mask_24` recovers it). `weight` must be zero
            outside it.
        backend: `"torch"` (vectorized PyTorch, the reference), `"triton"`
            (`_semi24_kernels`), or `"auto"` (Triton on CUDA when installed). With `mask`,
            PyTorch is used.

    Returns:
        values (rows, cols // 2) in weight's dtype, meta int16 (rows, ceil(cols / 16)).

    Raises:
        ValueError: if the shape or the sparsity pattern is not 2:4.
    """
    if weight.dim() != 2:
        raise ValueError(f"`weight` must be 2-D, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if cols % 4:
        raise ValueError(f"cols ({cols}) must be a multiple of 4 for 2:4 compression")
    if layout == "cutlass":
        _check_cutlass(rows, cols, weight.dtype)
    elif layout != "rowmajor":
        raise ValueError(f"`layout` ({layout!r}) must be 'rowmajor' or 'cutlass'")
    groups = weight.reshape(rows, cols // 4, 4)
    nz = groups != 0
    if mask is not None:
        if mask.shape != weight.shape:
            raise ValueError(f"`mask` shape {tuple(mask.shape)} must equal {tuple(weight.shape)}")
        if bool((weight[~mask.to(torch.bool)] != 0).any()):
            raise ValueError("`weight` has non-zeros outside `mask`")
        nz = mask.to(torch.bool).reshape(rows, cols // 4, 4)
    if bool((nz.sum(-1) > 2).any()):
        raise ValueError("`weight` is not 2:4: some group of 4 has more than 2 non-zeros")
    if _use_triton(backend, weight.device) and mask is None:
        values, meta = compress_24_triton(weight)
        return values, _reorder(meta, rows, weight.device) if layout == "cutlass" else meta
    # Non-zeros first, then the earliest zero positions; indices ascending.
    key = nz.to(torch.int64) * 4 + (3 - torch.arange(4, device=weight.device))
    idx = torch.topk(key, 2, dim=-1).indices.sort(-1).values
    values = groups.gather(-1, idx).reshape(rows, cols // 2)
    codes = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.int32)  # (rows, groups), 0..15
    ngroups = cols // 4
    pad = -ngroups % 4
    codes = torch.nn.functional.pad(codes, (0, pad)).view(rows, -1, 4)
    shifts = torch.tensor([0, 4, 8, 12], device=weight.device, dtype=torch.int32)
    packed = (codes << shifts).sum(-1, dtype=torch.int32)
    meta = torch.where(packed >= 2**15, packed - 2**16, packed).to(torch.int16)
    if layout == "cutlass":
        meta = _reorder(meta, rows, weight.device)
    return values.contiguous(), meta


def _reorder(meta: Tensor, rows: int, device: torch.device) -> Tensor:
    offsets = _cutlass_offsets(rows, meta.shape[1], device)
    reordered = torch.empty_like(meta).view(-1)
    reordered.scatter_(0, offsets, meta.reshape(-1))
    return reordered.view(rows, -1)


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"`backend` ({backend!r}) must be 'auto', 'torch' or 'triton'")
    if backend == "triton":
        if not available(device):
            raise ValueError(
                f"backend 'triton' needs triton and CUDA (or TRITON_INTERPRET=1); got {device}"
            )
        return True
    return backend == "auto" and device.type == "cuda" and available(device)


def _codes(meta: Tensor, rows: int, ngroups: int) -> Tensor:
    packed = meta.to(torch.int32) & 0xFFFF
    shifts = torch.tensor([0, 4, 8, 12], device=meta.device, dtype=torch.int32)
    codes = ((packed[..., None] >> shifts) & 0xF).view(rows, -1)[:, :ngroups]
    return torch.stack([codes & 3, (codes >> 2) & 3], dim=-1).to(torch.int64)


@torch.no_grad()
def mask_24(meta: Tensor, cols: int) -> Tensor:
    """The (rows, cols) boolean mask of the positions encoded in row-major `meta`."""
    rows, ngroups = meta.shape[0], cols // 4
    idx = _codes(meta, rows, ngroups)
    mask = torch.zeros(rows, ngroups, 4, dtype=torch.bool, device=meta.device)
    return mask.scatter_(-1, idx, True).view(rows, cols)


@torch.no_grad()
def decompress_24(
    values: Tensor,
    meta: Tensor,
    cols: int,
    *,
    layout: MetaLayout = "rowmajor",
    backend: Backend = "auto",
) -> Tensor:
    """Dense (rows, cols) matrix from `compress_24`'s (values, meta); exact.

    `backend` as in `compress_24`.

    Raises:
        ValueError: if the shapes do not match `cols`.
    """
    rows = values.shape[0]
    if cols % 4 or tuple(values.shape) != (rows, cols // 2):
        raise ValueError(f"`values` shape {tuple(values.shape)} must be (rows, {cols} // 2)")
    ngroups = cols // 4
    meta_cols = -(-ngroups // 4)
    if tuple(meta.shape) != (rows, meta_cols) or meta.dtype != torch.int16:
        raise ValueError(
            f"`meta` must be int16 of shape ({rows}, {meta_cols}), got {meta.dtype} "
            f"{tuple(meta.shape)}"
        )
    if layout == "cutlass":
        _check_cutlass(rows, cols, values.dtype)
        offsets = _cutlass_offsets(rows, meta_cols, meta.device)
        meta = meta.reshape(-1).gather(0, offsets).view(rows, meta_cols)
    elif layout != "rowmajor":
        raise ValueError(f"`layout` ({layout!r}) must be 'rowmajor' or 'cutlass'")
    if _use_triton(backend, values.device):
        return decompress_24_triton(values, meta, cols)
    idx = _codes(meta, rows, ngroups)
    dense = values.new_zeros(rows, ngroups, 4)
    dense.scatter_(-1, idx, values.view(rows, ngroups, 2))
    return dense.view(rows, cols)


@torch.no_grad()
def to_semi_structured_(linear: nn.Linear) -> nn.Linear:
    """Swap `linear.weight` for a `torch.sparse` semi-structured tensor (CUDA, inference).

    `F.linear` then runs on cuSPARSELt / CUTLASS 2:4 kernels. The weight must already be 2:4
    (e.g. after `sparsify_(..., SparsityConfig(pattern="2:4"))` and `remove_masks_`), fp16 or
    bf16, on a CUDA device supported by torch's semi-structured backends.

    Raises:
        ValueError: on CPU, or if the weight is not 2:4.
    """
    weight = linear.weight
    if weight.device.type != "cuda":
        raise ValueError(
            "torch's 2:4 kernels (to_sparse_semi_structured) are CUDA-only; got "
            f"{weight.device}. On CPU keep the dense weight with zeros or use compress_24."
        )
    if not is_24(weight):
        raise ValueError("`linear.weight` is not 2:4; prune it with pattern '2:4' first")
    sparse = torch.sparse.to_sparse_semi_structured(weight.detach())
    linear.weight = nn.Parameter(sparse, requires_grad=False)
    return linear
