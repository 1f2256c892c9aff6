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
the tensor cores as they are. fp32 operands follow `torch.get_float32_matmul_precision()`
through the PRECISION constexpr (`_bsr_launch.dot_precision`): "ieee" for "highest" (torch's
default: exact fp32, as `nn.Linear`), "tf32" for "high"/"medium" (10-bit-mantissa operands on
the tensor cores). dW splits the token sum over programs when there are few tiles: fp32
partials, summed in split order (deterministic).
Launch configurations: `_bsr_launch.kernel_config` (also compiled for sm_80/sm_90 by
tools/gpu_compile.py).

The PyTorch paths (`*_torch`, the CPU implementation) and the dense references the kernel tests
compare against (`*_dense_reference`) are in `_bsr_torch`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

from sparse_kernels._bsr_launch import (
    BLOCK_SIZES,
    aligned,
    check_sdd,
    dot_precision,
    kernel_config,
    sdd_plan,
)
from sparse_kernels.layout import BlockLayout

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRET_BLOCK_M = 16  # the interpreter pays ~0.5 ms per program and per op: small tiles


def _launch_config(kernel: str, block_size: int, dtype: torch.dtype) -> dict[str, int]:
    config = kernel_config(kernel, block_size, dtype)
    if _INTERPRET:
        config["BLOCK_M"] = _INTERPRET_BLOCK_M
    return config


def available(device: torch.device) -> bool:
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
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One program: rows [pid_m·BLOCK_M, +BLOCK_M) of Y, block column r (= block row of W).

        One flat loop over (stored tile p of row r, chunk of BK of its columns): a tile index
        load, then two operand loads and a dot, a shape Triton's software pipeliner
        multi-buffers. `K` is the masked width of x (the launcher pads x to a multiple of 16
        columns, so rows are 16-byte aligned and the loads vectorize).
        """
        pid_m = tl.program_id(0)
        r = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BS)
        offs_k = tl.arange(0, BK)
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_tile = v_ptr + offs_b[:, None] * BS + offs_k[None, :]  # (BS, BK) chunk of a tile
        acc = tl.zeros([BLOCK_M, BS], dtype=tl.float32)
        start = tl.load(row_ptr + r)
        end = tl.load(row_ptr + r + 1)
        # the tile's block column is loaded one step ahead (loop-carried), so the operand
        # addresses never wait on a load of the same step: Triton then pipelines the operand
        # loads with num_stages - 1 buffers (with the index load in the same step, sm_80 got 1)
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
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BK: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One program: rows of dX in block column c.

        One flat loop over (stored tile of column c, chunk of BK of its rows). `N` is the
        masked (16-padded) width of dy.
        """
        pid_m = tl.program_id(0)
        c = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_b = tl.arange(0, BS)
        offs_k = tl.arange(0, BK)
        m_mask = offs_m < M
        dy_rows = dy_ptr + offs_m[:, None].to(tl.int64) * stride_dym
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
        nnzb,
        m_per_split,
        stride_dym,
        stride_xm,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BS: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Program (p, s): out[s, p] = Σ_{m in split s} dY[m, r_p]ᵀ X[m, c_p] (fp32 accumulator).

        Split s covers tokens [s·m_per_split, (s+1)·m_per_split) (a multiple of BLOCK_M); with
        one split `out` is dvalues itself, otherwise fp32 partials the launcher sums in a fixed
        order (deterministic, no atomics).
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
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), layout.row_blocks)
    _dsd_kernel[grid](
        x, values, layout.row_ptr, layout.col_idx, bias if bias is not None else x, y,
        M, layout.out_features, x.shape[1], x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, UPCAST=_INTERPRET, PRECISION=dot_precision(x.dtype),
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
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), layout.col_blocks)
    _dsdt_kernel[grid](
        dy, values, layout.col_ptr, layout.t_perm, layout.row_idx, dx,
        M, dy.shape[1], layout.in_features, dy.stride(0), dx.stride(0),
        UPCAST=_INTERPRET, PRECISION=dot_precision(dy.dtype), BS=layout.block_size, BK=cfg["BK"],
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
    _check(x, values, layout, layout.in_features, "x")
    _check(dy, values, layout, layout.out_features, "dy")
    check_sdd(dy, x, splits)
    dy, x = aligned(dy), aligned(x)
    cfg = config or _launch_config("sdd", layout.block_size, x.dtype)
    M, nnzb, b = x.shape[0], layout.nnzb, layout.block_size
    if nnzb == 0 or M == 0:
        return torch.zeros_like(values)
    splits, per = sdd_plan(M, nnzb, cfg["BLOCK_M"], splits, x.device)
    f32 = torch.float32
    out = torch.empty_like(values) if splits == 1 else x.new_empty(splits, nnzb, b, b, dtype=f32)
    _sdd_kernel[(nnzb, splits)](
        dy, x, layout.row_idx, layout.col_idx, out,
        M, dy.shape[1], x.shape[1], nnzb, per, dy.stride(0), x.stride(0),
        UPCAST=_INTERPRET, PRECISION=dot_precision(x.dtype), BS=b,
        BLOCK_M=cfg["BLOCK_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out if splits == 1 else out.sum(0).to(values.dtype)
