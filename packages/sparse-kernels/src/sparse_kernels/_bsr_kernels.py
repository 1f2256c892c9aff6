# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Block-sparse x dense kernels of `BlockSparseLinear` (sm_80 and later): kernels, launchers.

W (N x K) stores b x b tiles `values[p]` (layout in `BlockLayout`); X is (M, K):

* forward (DSD):      Y[:, r] = Σ_{p in row r}  X[:, c_p] · values[p]ᵀ   (+ bias)
* dX (DSDᵀ):          dX[:, c] = Σ_{p in col c} dY[:, r_p] · values[p]
* dW (SDD, sampled):  dvalues[p] = dY[:, r_p]ᵀ · X[:, c_p]   (only stored tiles are computed)

so all three training GEMMs cost density x dense (the STK decomposition of MegaBlocks, Gale et
al., arXiv 2211.15841). fp32 accumulation, one cast on store; fp32 operands at
`dot_precision`; UPCAST (the interpreter, whose bf16 arithmetic is wrong) upcasts loads to fp32.
Launch configs: `_bsr_launch`; PyTorch paths and references: `_bsr_torch`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from sparse_kernels._bsr_launch import (
    aligned,
    cdiv,
    check_sdd,
    dot_precision,
    kernel_config,
    sdd_plan,
)
from sparse_kernels._triton import HAS_TRITON, INTERPRET, available
from sparse_kernels.config import BLOCK_SIZES
from sparse_kernels.layout import BlockLayout

_INTERPRET_BLOCK_M = 16  # the interpreter pays ~0.5 ms per program and per op: small tiles


@functools.cache  # one dict per (kernel, tile, dtype), shared: callers only read it
def _launch_config(kernel: str, block_size: int, dtype: torch.dtype) -> dict[str, int]:
    config = kernel_config(kernel, block_size, dtype)
    if INTERPRET:
        config["BLOCK_M"] = _INTERPRET_BLOCK_M
    return config


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _program_tile(  # type: ignore[no-untyped-def]
        a_ptr, stride_am, M, BS: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """Output block (grid axis 1), token rows (axis 0: offsets, mask, row addresses in A)."""
        pid_m = tl.program_id(0)
        blk = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BS)
        offs_k = tl.arange(0, BK)
        m_mask = offs_m < M
        rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
        return blk, offs_m, m_mask, rows, offs_b, offs_k

    @triton.jit  # type: ignore[untyped-decorator]
    def _store_rows(  # type: ignore[no-untyped-def]
        out_ptr, acc, offs_m, m_mask, n, n_out, stride_om, b_ptr, HAS_BIAS: tl.constexpr
    ):
        """out[offs_m, n] = acc (+ bias[n]) where m_mask and n < n_out, cast once."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < n_out, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None].to(tl.int64) * stride_om + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & (n[None, :] < n_out),
        )

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
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Token rows of Y (grid axis 0) in block column r (axis 1).

        One flat loop over (stored tile p of row r, chunk of BK of its columns): a shape
        Triton's software pipeliner multi-buffers.
        """
        r, offs_m, m_mask, x_rows, offs_b, offs_k = _program_tile(
            x_ptr, stride_xm, M, BS, BK, BLOCK_M
        )
        w_tile = v_ptr + offs_b[:, None] * BS + offs_k[None, :]  # (BS, BK) chunk of a tile
        acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
        start = tl.load(row_ptr + r)
        end = tl.load(row_ptr + r + 1)
        # NOTE: the block column c is loaded one step ahead (loop-carried), so the operand
        # addresses never wait on a load of the same step and the operand loads pipeline
        c = tl.load(col_idx + start, mask=start < end, other=0)
        for it in range(0, (end - start) * (BS // BK)):
            p = start + it // (BS // BK)
            kk = (it % (BS // BK)) * BK
            k = c * BS + kk + offs_k
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
            w = tl.load(w_tile + p.to(tl.int64) * (BS * BS) + kk)
            p_next = start + (it + 1) // (BS // BK)
            c = tl.load(col_idx + p_next, mask=p_next < end, other=0)
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        _store_rows(y_ptr, acc, offs_m, m_mask, r * BS + offs_b, N, stride_ym, b_ptr,
                    HAS_BIAS)  # fmt: skip

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
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Token rows of dX in block column c: as `_dsd_kernel`, over the stored tiles of c."""
        c, offs_m, m_mask, dy_rows, offs_b, offs_k = _program_tile(
            dy_ptr, stride_dym, M, BS, BK, BLOCK_M
        )
        w_tile = v_ptr + offs_k[:, None] * BS + offs_b[None, :]  # (BK, BS) chunk of a tile
        acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
        start = tl.load(col_ptr + c)
        end = tl.load(col_ptr + c + 1)
        # tile id and block row loaded one step ahead (loop-carried), as in `_dsd_kernel`
        p = tl.load(t_perm + start, mask=start < end, other=0)
        r = tl.load(row_idx + p, mask=start < end, other=0)
        for it in range(0, (end - start) * (BS // BK)):
            kk = (it % (BS // BK)) * BK
            n = r * BS + kk + offs_k
            dy = tl.load(dy_rows + n[None, :], mask=m_mask[:, None] & (n[None, :] < N), other=0.0)
            w = tl.load(w_tile + p.to(tl.int64) * (BS * BS) + kk * BS)
            q_next = start + (it + 1) // (BS // BK)
            p = tl.load(t_perm + q_next, mask=q_next < end, other=0)
            r = tl.load(row_idx + p, mask=q_next < end, other=0)
            if UPCAST:
                dy = dy.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(dy, w, input_precision=PRECISION)
        _store_rows(dx_ptr, acc, offs_m, m_mask, c * BS + offs_b, K, stride_dxm, dx_ptr,
                    False)  # fmt: skip

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
        nnzb,
        m_per_split,
        stride_dym,
        stride_xm,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Program (p, s): out[s, p] = Σ_{m in split s} dY[m, r_p]ᵀ X[m, c_p].

        Split s covers tokens [s·m_per_split, (s+1)·m_per_split); with one split `out` is
        dvalues, otherwise fp32 partials the launcher sums in split order (no atomics).
        """
        p = tl.program_id(0)
        s = tl.program_id(1)
        r = tl.load(row_idx + p)
        c = tl.load(col_idx + p)
        offs_b = tl.arange(0, BS)
        n = r * BS + offs_b
        k = c * BS + offs_b
        n_mask = n < N
        k_mask = k < K
        acc = tl.zeros([BS, BS], dtype=tl.float32)
        m_lo = s * m_per_split
        m_hi = tl.minimum(m_lo + m_per_split, M)
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < m_hi
            rows = offs_m[:, None].to(tl.int64)
            dy = tl.load(
                dy_ptr + rows * stride_dym + n[None, :],
                mask=m_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            x = tl.load(
                x_ptr + rows * stride_xm + k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                dy = dy.to(tl.float32)
                x = x.to(tl.float32)
            acc += tl.dot(tl.trans(dy), x, input_precision=PRECISION)
        out = (s.to(tl.int64) * nnzb + p) * (BS * BS)
        tl.store(
            dv_ptr + out + offs_b[:, None] * BS + offs_b[None, :],
            acc.to(dv_ptr.dtype.element_ty),
        )

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every kernel launch the launchers below make on a GPU (for tools/gpu_compile.py).

        Per dtype (fp32 with both `dot_precision` values) and tile edge, the config of
        `kernel_config`, with representative arguments:
        feature widths and strides are always multiples of 16 (the launchers pad), tokens M and
        stored tiles nnzb are listed both as a multiple of 16 and not (Triton specializes on it).
        """
        launches: list[dict[str, Any]] = []
        i32 = torch.int32
        # fp32 is launched as "ieee" (matmul precision "highest") or "tf32" ("high"/"medium")
        dtypes = [(torch.bfloat16, "tf32"), (torch.float16, "tf32")]
        dtypes += [(torch.float32, "ieee"), (torch.float32, "tf32")]
        for dtype, precision in dtypes:
            for bs in BLOCK_SIZES:
                for M, nnzb in ((2048, 400), (2047, 409)) if bs == 64 else ((2048, 400),):
                    common = {"M": M, "N": 4096, "K": 4096, "UPCAST": False, "BS": bs,
                              "PRECISION": precision}  # fmt: skip
                    args = {"x_ptr": dtype, "v_ptr": dtype, "row_ptr": i32, "col_idx": i32,
                            "b_ptr": dtype, "y_ptr": dtype, "stride_xm": 4096,
                            "stride_ym": 4096, "HAS_BIAS": True, **common}  # fmt: skip
                    launches.append(_spec(_dsd_kernel, args, kernel_config("dsd", bs, dtype)))
                    args = {"dy_ptr": dtype, "v_ptr": dtype, "col_ptr": i32, "t_perm": i32,
                            "row_idx": i32, "dx_ptr": dtype, "stride_dym": 4096,
                            "stride_dxm": 4096, **common}  # fmt: skip
                    launches.append(_spec(_dsdt_kernel, args, kernel_config("dsdt", bs, dtype)))
                    # partials (splits > 1) are fp32; one split writes dvalues in `dtype`
                    for out in {torch.float32, dtype}:
                        args = {"dy_ptr": dtype, "x_ptr": dtype, "row_idx": i32, "col_idx": i32,
                                "dv_ptr": out, "nnzb": nnzb, "m_per_split": 512,
                                "stride_dym": 4096, "stride_xm": 4096, **common}  # fmt: skip
                        cfg = kernel_config("sdd", bs, dtype)
                        launches.append(_spec(_sdd_kernel, args, cfg, bk=False))
        return launches

    def _spec(kernel: Any, args: dict[str, Any], cfg: dict[str, int], bk: bool = True) -> Any:
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        args = {**args, "BLOCK_M": cfg["BLOCK_M"], **({"BK": cfg["BK"]} if bk else {})}
        return {"kernel": kernel, "args": args, "options": options}


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
    if not available(x.device):
        raise ValueError(f"the Triton kernels need CUDA or TRITON_INTERPRET=1 (got {x.device})")
    if b not in BLOCK_SIZES:
        raise ValueError(f"the Triton kernels need `block_size` in {BLOCK_SIZES}, got {b}")


def _check_sdd_args(
    dy: Tensor, x: Tensor, layout: BlockLayout, values: Tensor, splits: int | None
) -> None:
    _check(x, values, layout, layout.in_features, "x")
    _check(dy, values, layout, layout.out_features, "dy")
    check_sdd(dy, x, splits)


def _sdd_out(values: Tensor, splits: int) -> Tensor:
    """What the dW kernels write: dvalues itself (one split) or fp32 partials (splits, *shape)."""
    if splits == 1:
        return torch.empty_like(values)
    return values.new_empty(splits, *values.shape, dtype=torch.float32)


def _sdd_sum(out: Tensor, values: Tensor, splits: int) -> Tensor:
    """Dvalues from `_sdd_out`'s buffer: the partials summed in split order (deterministic)."""
    return out if splits == 1 else out.sum(0).to(values.dtype)


def dsd_triton(
    x: Tensor,
    values: Tensor,
    layout: BlockLayout,
    bias: Tensor | None,
    *,
    config: dict[str, int] | None = None,
) -> Tensor:
    """Y = X·Wᵀ (+ bias) with the Triton kernel; x (M, K) -> (M, N).

    `config` overrides `kernel_config("dsd", ...)` (tests run the interpreter at GPU tiles).
    """
    _check(x, values, layout, layout.in_features, "x")
    x = aligned(x)
    values = values.contiguous()
    cfg = config or _launch_config("dsd", layout.block_size, x.dtype)
    M = x.shape[0]
    y = torch.empty(M, layout.out_features, device=x.device, dtype=x.dtype)
    grid = (cdiv(M, cfg["BLOCK_M"]), layout.row_blocks)
    _dsd_kernel[grid](
        x, values, layout.row_ptr, layout.col_idx, bias if bias is not None else x, y,
        M, layout.out_features, x.shape[1], x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=INTERPRET, PRECISION=dot_precision(x.dtype),
        BS=layout.block_size, BK=cfg["BK"],
        BLOCK_M=cfg["BLOCK_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


def dsdt_triton(
    dy: Tensor, values: Tensor, layout: BlockLayout, *, config: dict[str, int] | None = None
) -> Tensor:
    """DX = dY·W with the Triton kernel; dy (M, N) -> (M, K)."""
    _check(dy, values, layout, layout.out_features, "dy")
    dy = aligned(dy)
    values = values.contiguous()
    cfg = config or _launch_config("dsdt", layout.block_size, dy.dtype)
    M = dy.shape[0]
    dx = torch.empty(M, layout.in_features, device=dy.device, dtype=dy.dtype)
    grid = (cdiv(M, cfg["BLOCK_M"]), layout.col_blocks)
    _dsdt_kernel[grid](
        dy, values, layout.col_ptr, layout.t_perm, layout.row_idx, dx,
        M, dy.shape[1], layout.in_features, dy.stride(0), dx.stride(0),
        UPCAST=INTERPRET, PRECISION=dot_precision(dy.dtype), BS=layout.block_size, BK=cfg["BK"],
        BLOCK_M=cfg["BLOCK_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return dx


def sdd_triton(
    dy: Tensor,
    x: Tensor,
    layout: BlockLayout,
    values: Tensor,
    *,
    config: dict[str, int] | None = None,
    splits: int | None = None,
) -> Tensor:
    """dvalues[p] = dY[:, r_p]ᵀ·X[:, c_p] with the Triton kernel; (nnzb, b, b) in x's dtype.

    The token dimension is split over `splits` programs per tile (default `sdd_splits`: about
    two waves of SMs), whose fp32 partials are summed in split order (deterministic).
    """
    _check_sdd_args(dy, x, layout, values, splits)
    dy, x = aligned(dy), aligned(x)
    cfg = config or _launch_config("sdd", layout.block_size, x.dtype)
    M, nnzb, b = x.shape[0], layout.nnzb, layout.block_size
    if nnzb == 0 or M == 0:
        return torch.zeros_like(values)
    splits, per = sdd_plan(M, nnzb, cfg["BLOCK_M"], splits, x.device)
    out = _sdd_out(values, splits)
    _sdd_kernel[(nnzb, splits)](
        dy, x, layout.row_idx, layout.col_idx, out,
        M, dy.shape[1], x.shape[1], nnzb, per, dy.stride(0), x.stride(0),
        UPCAST=INTERPRET, PRECISION=dot_precision(x.dtype), BS=b,
        BLOCK_M=cfg["BLOCK_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return _sdd_sum(out, values, splits)
