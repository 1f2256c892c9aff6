"""PyTorch paths of the block-sparse products (the CPU path) and their dense references.

Same products as the Triton kernels in `_bsr_kernels` (forward DSD, input gradient DSDᵀ, stored
tiles of the weight gradient SDD), with fp32 accumulation (float64 for float64 inputs). The
`*_dense_reference` functions compute them through the dense weight in fp32: the tests' oracle.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sparse_kernels.layout import BlockLayout, blocks_to_dense, dense_to_blocks


# ------------------------------------------------------------------- PyTorch paths (CPU path)
def _check_features(t: Tensor, features: int, what: str) -> None:
    """ValueError unless `t` is (tokens, features): `_pad_cols` would crop or pad it silently."""
    if t.dim() != 2 or t.shape[1] != features:
        raise ValueError(f"`{what}` must be (tokens, {features}), got shape {tuple(t.shape)}")


def _pad_cols(t: Tensor, cols: int) -> Tensor:
    assert t.shape[1] <= cols, (tuple(t.shape), cols)  # never crop: callers check the width
    return t if t.shape[1] == cols else torch.nn.functional.pad(t, (0, cols - t.shape[1]))


def _bsr(values: Tensor, crow: Tensor, col: Tensor, rows: int, cols: int) -> Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*BSR tensor support is in beta.*")
        return torch.sparse_bsr_tensor(
            crow.long(), col.long(), values, size=(rows, cols), check_invariants=False
        )


# Above this tile density the PyTorch path multiplies through the dense weight instead: on a
# 2-core CPU (4096², fp32) torch's BSR product only beats the dense GEMM below ~25-30% density
# (benchmarks/RESULTS.md).
DENSE_CROSSOVER = 0.3


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _through_dense(
    a: Tensor, values: Tensor, layout: BlockLayout, product: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """`product(a, W)` through the materialized weight W; 16-bit `a` in fp32, cast back."""
    w = blocks_to_dense(values, layout)
    if a.dtype in (torch.float32, torch.float64):
        return product(a, w)
    acc = _acc_dtype(a)
    return product(a.to(acc), w.to(acc)).to(a.dtype)


def dsd_torch(
    x: Tensor,
    values: Tensor,
    layout: BlockLayout,
    bias: Tensor | None,
    *,
    dense_crossover: float = DENSE_CROSSOVER,
) -> Tensor:
    """Y = X·Wᵀ (+ bias) with PyTorch ops; cost ∝ stored tiles, fp32 accumulation.

    CPU: one BSR x dense product `(W_bsr @ Xᵀ)ᵀ` in fp32 (torch's CPU BSR kernel is fp32/fp64
    only, so bf16/fp16 operands are upcast once and the result cast back). Other devices: one
    `addmm` per stored tile into an fp32 accumulator. Above `dense_crossover` tile density:
    one dense GEMM through the materialized weight (faster there).
    """
    _check_features(x, layout.in_features, "x")
    if layout.density > dense_crossover:
        return _through_dense(
            x,
            values,
            layout,
            lambda a, w: F.linear(a, w, None if bias is None else bias.to(a.dtype)),
        )
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = x.shape[0]
    acc = _acc_dtype(x)
    xp = _pad_cols(x, cb * b).to(acc)
    if x.device.type == "cpu":
        w = _bsr(values.to(acc), layout.row_ptr, layout.col_idx, rb * b, cb * b)
        y = (w @ xp.T).T
    else:
        y3 = xp.new_zeros(M, rb, b)
        xb = xp.view(M, cb, b)
        va = values.to(acc)
        tiles = zip(layout.row_idx.tolist(), layout.col_idx.tolist(), strict=True)
        for p, (r, c) in enumerate(tiles):
            y3[:, r].addmm_(xb[:, c], va[p].T)
        y = y3.view(M, rb * b)
    y = y[:, : layout.out_features]
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).contiguous()


def dsdt_torch(
    dy: Tensor, values: Tensor, layout: BlockLayout, *, dense_crossover: float = DENSE_CROSSOVER
) -> Tensor:
    """The input gradient dY·W with PyTorch ops, fp32 accumulation.

    CPU: BSR of the transposed tiles; other devices: one `addmm` per tile. Above
    `dense_crossover` tile density: one dense GEMM through the materialized weight.
    """
    _check_features(dy, layout.out_features, "dy")
    if layout.density > dense_crossover:
        return _through_dense(dy, values, layout, torch.matmul).contiguous()
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = dy.shape[0]
    acc = _acc_dtype(dy)
    dyp = _pad_cols(dy, rb * b).to(acc)
    va = values.to(acc)
    if dy.device.type == "cpu":
        perm = layout.t_perm.long()
        wt = _bsr(
            va[perm].transpose(1, 2).contiguous(),
            layout.col_ptr,
            layout.row_idx[perm],
            cb * b,
            rb * b,
        )
        dx = (wt @ dyp.T).T
    else:
        dx3 = dyp.new_zeros(M, cb, b)
        dyb = dyp.view(M, rb, b)
        tiles = zip(layout.row_idx.tolist(), layout.col_idx.tolist(), strict=True)
        for p, (r, c) in enumerate(tiles):
            dx3[:, c].addmm_(dyb[:, r], va[p])
        dx = dx3.view(M, cb * b)
    return dx[:, : layout.in_features].to(dy.dtype).contiguous()


def sdd_torch(
    dy: Tensor, x: Tensor, layout: BlockLayout, *, dense_crossover: float = DENSE_CROSSOVER
) -> Tensor:
    """dvalues[p] = dY[:, r_p]ᵀ·X[:, c_p] for stored tiles only, per block row with PyTorch ops.

    For each block row r the stored columns of X are gathered once and one GEMM
    `dY[:, r]ᵀ · X[:, cols(r)]` yields all of that row's tiles. Above `dense_crossover` tile
    density: the dense dYᵀX, then its stored tiles. No tokens: zeros, as for `nn.Linear`.
    """
    _check_features(x, layout.in_features, "x")
    _check_features(dy, layout.out_features, "dy")
    if layout.density > dense_crossover:
        return dense_to_blocks(dy.T @ x, layout)
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = x.shape[0]
    if M == 0:  # the per-row gather below cannot view 0 tokens as (-1, M)
        return x.new_zeros(layout.nnzb, b, b)
    xt = _pad_cols(x, cb * b).T.contiguous().view(cb, b, M)
    dyt = _pad_cols(dy, rb * b).T.contiguous().view(rb, b, M)
    out = x.new_empty(layout.nnzb, b, b)
    ptr = layout.row_ptr.tolist()
    col = layout.col_idx.long()
    for r in range(rb):
        s, e = ptr[r], ptr[r + 1]
        if s == e:
            continue
        g = dyt[r] @ xt[col[s:e]].view(-1, M).T  # (b, tiles·b)
        out[s:e] = g.view(b, e - s, b).transpose(0, 1)
    return out


def differentiable_backward(
    dy: Tensor, x: Tensor, values: Tensor, layout: BlockLayout, needs: tuple[bool, ...]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dX, dW's tiles, db) with differentiable PyTorch ops through the dense weight.

    The backward of every backend when it records a graph (`create_graph=True`, e.g. a
    gradient penalty): higher-order gradients are then those of `F.linear` with the dense
    weight (the kernels' outputs have no `grad_fn`). One dense GEMM per gradient. `needs`:
    which of (x, values, bias) want a gradient.
    """
    dx = dy @ blocks_to_dense(values, layout) if needs[0] else None
    dv = dense_to_blocks(dy.T @ x, layout) if needs[1] else None
    db = dy.sum(0) if needs[2] else None
    return dx, dv, db


# -------------------------------------------------------------------- dense references (tests)
def dsd_dense_reference(
    x: Tensor, values: Tensor, layout: BlockLayout, bias: Tensor | None
) -> Tensor:
    """Y through the dense weight, in fp32 (the test oracle)."""
    w = blocks_to_dense(values.float(), layout)
    y = x.float() @ w.T
    return y if bias is None else y + bias.float()


def dsdt_dense_reference(dy: Tensor, values: Tensor, layout: BlockLayout) -> Tensor:
    """DX through the dense weight, in fp32."""
    return dy.float() @ blocks_to_dense(values.float(), layout)


def sdd_dense_reference(dy: Tensor, x: Tensor, layout: BlockLayout) -> Tensor:
    """Stored tiles of the dense dW = dYᵀX, in fp32."""
    return dense_to_blocks(dy.float().T @ x.float(), layout)
