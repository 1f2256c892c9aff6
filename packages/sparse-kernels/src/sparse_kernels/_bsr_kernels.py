# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Block-sparse x dense kernels for `BlockSparseLinear`: Triton kernels, launchers, references.

With W (N x K, tiles of b x b stored as `values[p]`, layout in `BlockLayout`) and X (M x K):

* forward (DSD):      Y[:, r] = Σ_{p in row r}  X[:, c_p] · values[p]ᵀ   (+ bias)
* dX (DSDᵀ):          dX[:, c] = Σ_{p in col c} dY[:, r_p] · values[p]
* dW (SDD, sampled):  dvalues[p] = dY[:, r_p]ᵀ · X[:, c_p]   (only stored tiles are computed)

so all three training GEMMs cost density x dense (the STK decomposition, Gale et al.,
"MegaBlocks", arXiv 2211.15841). Numerics: every kernel accumulates in fp32 (`tl.dot` with an
fp32 accumulator) and casts once on store. Loads are upcast to fp32 when UPCAST is set (always
under TRITON_INTERPRET=1, where bf16 arithmetic is wrong); on a GPU bf16/fp16 operands go to
the tensor cores as they are, and fp32 operands use TF32 (Triton's default).

The PyTorch paths (`*_torch`) are the CPU implementation and the reference the kernel tests
compare against; `*_dense_reference` compute the same products through the dense weight.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch
from torch import Tensor

from sparse_kernels.layout import BlockLayout, blocks_to_dense, dense_to_blocks

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
BLOCK_M = 16 if _INTERPRET else 64


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA, or CPU under the interpreter)."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _dsd_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        v_ptr,
        row_ptr,
        col_idx,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One program: rows [pid_m·BLOCK_M, +BLOCK_M) of Y, block column r (= block row of W)."""
        pid_m = tl.program_id(0)
        r = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BS)
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
        start = tl.load(row_ptr + r)
        end = tl.load(row_ptr + r + 1)
        for p in range(start, end):
            c = tl.load(col_idx + p)
            k = c * BS + offs_b
            x = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                mask=m_mask[:, None] & (k[None, :] < K),
                other=0.0,
            )
            # int32 offset: the launcher checks nnzb·BS² < 2³¹ (the loop index is int32).
            w = tl.load(v_ptr + p * (BS * BS) + offs_b[:, None] * BS + offs_b[None, :])
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
        n = r * BS + offs_b
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (n[None, :] < N),
        )

    @triton.jit  # type: ignore[untyped-decorator]
    def _dsdt_kernel(  # type: ignore[no-untyped-def]
        dy_ptr,
        v_ptr,
        col_ptr,
        t_perm,
        row_idx,
        dx_ptr,
        M,
        N,
        K,
        stride_dym,
        stride_dxm,
        UPCAST: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One program: rows of dX in block column c; loops over the stored tiles of column c."""
        pid_m = tl.program_id(0)
        c = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BS)
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
        start = tl.load(col_ptr + c)
        end = tl.load(col_ptr + c + 1)
        for q in range(start, end):
            p = tl.load(t_perm + q)
            r = tl.load(row_idx + p)
            n = r * BS + offs_b
            dy = tl.load(
                dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + n[None, :],
                mask=m_mask[:, None] & (n[None, :] < N),
                other=0.0,
            )
            w = tl.load(v_ptr + p.to(tl.int64) * BS * BS + offs_b[:, None] * BS + offs_b[None, :])
            if UPCAST:
                dy = dy.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(dy, w)
        k = c * BS + offs_b
        tl.store(
            dx_ptr + offs_m[:, None].to(tl.int64) * stride_dxm + k[None, :],
            acc.to(dx_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (k[None, :] < K),
        )

    @triton.jit  # type: ignore[untyped-decorator]
    def _sdd_kernel(  # type: ignore[no-untyped-def]
        dy_ptr,
        x_ptr,
        row_idx,
        col_idx,
        dv_ptr,
        M,
        N,
        K,
        stride_dym,
        stride_xm,
        UPCAST: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One program per stored tile p: dvalues[p] = Σ_m dY[m, r_p]ᵀ X[m, c_p] (fp32)."""
        p = tl.program_id(0)
        r = tl.load(row_idx + p)
        c = tl.load(col_idx + p)
        offs_b = tl.arange(0, BS)
        n = r * BS + offs_b
        k = c * BS + offs_b
        acc = tl.zeros([BS, BS], dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < M
            dy = tl.load(
                dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym + n[None, :],
                mask=m_mask[:, None] & (n[None, :] < N),
                other=0.0,
            )
            x = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                mask=m_mask[:, None] & (k[None, :] < K),
                other=0.0,
            )
            if UPCAST:
                dy = dy.to(tl.float32)
                x = x.to(tl.float32)
            acc += tl.dot(tl.trans(dy), x)
        tl.store(
            dv_ptr + p.to(tl.int64) * BS * BS + offs_b[:, None] * BS + offs_b[None, :],
            acc.to(dv_ptr.dtype.element_ty),
        )


# ----------------------------------------------------------------------------------- launchers
def _check(x: Tensor, values: Tensor, layout: BlockLayout, features: int, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"`{what}` must be 2-D (tokens, features), got shape {tuple(x.shape)}")
    if x.shape[1] != features:
        raise ValueError(f"`{what}` has {x.shape[1]} features, expected {features}")
    b = layout.block_size
    if tuple(values.shape) != (layout.nnzb, b, b):
        raise ValueError(f"`values` shape {tuple(values.shape)} must be ({layout.nnzb}, {b}, {b})")
    if x.dtype != values.dtype:
        raise TypeError(f"`{what}` dtype {x.dtype} must equal `values` dtype {values.dtype}")
    if x.device != values.device:
        raise ValueError(f"`{what}` is on {x.device} but `values` on {values.device}")
    if not triton_available(x.device):
        raise ValueError(f"the Triton kernels need CUDA or TRITON_INTERPRET=1 (got {x.device})")
    if layout.nnzb * b * b >= 2**31:
        raise ValueError(f"{layout.nnzb} tiles of {b}x{b} overflow the kernels' int32 offsets")
    if b < 16 or b & (b - 1):
        raise ValueError(f"the Triton kernels need a power-of-two `block_size` >= 16, got {b}")


def dsd_triton(x: Tensor, values: Tensor, layout: BlockLayout, bias: Tensor | None) -> Tensor:
    """Y = X·Wᵀ (+ bias) with the Triton kernel; x (M, K) -> (M, N)."""
    _check(x, values, layout, layout.in_features, "x")
    x = x.contiguous()
    values = values.contiguous()
    M = x.shape[0]
    y = torch.empty(M, layout.out_features, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, BLOCK_M), layout.row_blocks)
    _dsd_kernel[grid](
        x, values, layout.row_ptr, layout.col_idx, bias if bias is not None else x, y,
        M, layout.out_features, layout.in_features, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=_INTERPRET, BS=layout.block_size, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return y


def dsdt_triton(dy: Tensor, values: Tensor, layout: BlockLayout) -> Tensor:
    """DX = dY·W with the Triton kernel; dy (M, N) -> (M, K)."""
    _check(dy, values, layout, layout.out_features, "dy")
    dy = dy.contiguous()
    values = values.contiguous()
    M = dy.shape[0]
    dx = torch.empty(M, layout.in_features, device=dy.device, dtype=dy.dtype)
    grid = (triton.cdiv(M, BLOCK_M), layout.col_blocks)
    _dsdt_kernel[grid](
        dy, values, layout.col_ptr, layout.t_perm, layout.row_idx, dx,
        M, layout.out_features, layout.in_features, dy.stride(0), dx.stride(0),
        UPCAST=_INTERPRET, BS=layout.block_size, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return dx


def sdd_triton(dy: Tensor, x: Tensor, layout: BlockLayout, values: Tensor) -> Tensor:
    """dvalues[p] = dY[:, r_p]ᵀ·X[:, c_p] with the Triton kernel; (nnzb, b, b) in x's dtype."""
    _check(x, values, layout, layout.in_features, "x")
    _check(dy, values, layout, layout.out_features, "dy")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"`dy` has {dy.shape[0]} rows but `x` has {x.shape[0]}")
    dy = dy.contiguous()
    x = x.contiguous()
    dv = torch.empty_like(values)
    if layout.nnzb == 0:
        return dv
    _sdd_kernel[(layout.nnzb,)](
        dy, x, layout.row_idx, layout.col_idx, dv,
        x.shape[0], layout.out_features, layout.in_features, dy.stride(0), x.stride(0),
        UPCAST=_INTERPRET, BS=layout.block_size, BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return dv


# ------------------------------------------------------------------- PyTorch paths (CPU path)
def _pad_cols(t: Tensor, cols: int) -> Tensor:
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
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = x.shape[0]
    acc = _acc_dtype(x)
    if layout.density > dense_crossover:
        w = blocks_to_dense(values, layout)
        if x.dtype in (torch.float32, torch.float64):
            return torch.nn.functional.linear(x, w, bias)
        y = torch.nn.functional.linear(x.to(acc), w.to(acc), None if bias is None else bias.to(acc))
        return y.to(x.dtype)
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
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = dy.shape[0]
    acc = _acc_dtype(dy)
    if layout.density > dense_crossover:
        w = blocks_to_dense(values, layout)
        if dy.dtype in (torch.float32, torch.float64):
            return (dy @ w).contiguous()
        return (dy.to(acc) @ w.to(acc)).to(dy.dtype)
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
    density: the dense dYᵀX, then its stored tiles.
    """
    if layout.density > dense_crossover:
        return dense_to_blocks(dy.T @ x, layout)
    b = layout.block_size
    rb, cb = layout.row_blocks, layout.col_blocks
    M = x.shape[0]
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
