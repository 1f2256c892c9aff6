# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Triton kernels for 2:4 compression / decompression (row-major metadata), with launchers.

A program handles BLOCK_R rows x BLOCK_W metadata words; an int16 word holds the 4-bit codes
`idx0 | idx1 << 2` of 4 groups of 4 columns (group q at bits 4q..4q+3). Kept positions are the
non-zeros padded with the earliest zeros up to 2, the rule of `semi24.compress_24`. The kernels
only move values (fp32 upcast is exact for fp16/bf16/fp32), so both directions are bit-exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sparse_kernels._triton import HAS_TRITON, INTERPRET, available

BLOCK_R = 16
BLOCK_W = 4 if INTERPRET else 8
NUM_WARPS = 4  # launch option of both kernels (Triton's default, stated so the gate compiles it)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _tile(rows, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):  # type: ignore[no-untyped-def]
        """This program's rows r (grid axis 0), metadata words (axis 1) and row mask."""
        pid_r = tl.program_id(0)
        pid_w = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        words = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        return r, words, r < rows

    @triton.jit
    def _words(meta_ptr, r, r_mask, words, n_words):  # type: ignore[no-untyped-def]
        """Addresses and mask of the (BLOCK_R, BLOCK_W) metadata words."""
        mask = r_mask[:, None] & (words[None, :] < n_words)
        return meta_ptr + r[:, None].to(tl.int64) * n_words + words[None, :], mask

    @triton.jit
    def _group(words, q, r_mask, cols):  # type: ignore[no-untyped-def]
        """Group g = 4·word + q of each word, masked to the matrix's cols // 4 groups."""
        g = words * 4 + q
        return g, r_mask[:, None] & (g[None, :] < cols // 4)

    @triton.jit  # type: ignore[untyped-decorator]
    def _compress_kernel(  # type: ignore[no-untyped-def]
        w_ptr, v_ptr, meta_ptr, rows, cols, n_words, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr
    ):
        """values[r, 2g + j] = w[r, 4g + idx_j]; meta word = Σ_q code_q << 4q."""
        r, words, r_mask = _tile(rows, BLOCK_R, BLOCK_W)
        row_w = r[:, None].to(tl.int64) * cols
        row_v = r[:, None].to(tl.int64) * (cols // 2)
        meta = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.int32)
        for q in tl.static_range(4):
            g, mask = _group(words, q, r_mask, cols)
            base = w_ptr + row_w + g[None, :] * 4
            a0 = tl.load(base + 0, mask=mask, other=0.0).to(tl.float32)
            a1 = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
            a2 = tl.load(base + 2, mask=mask, other=0.0).to(tl.float32)
            a3 = tl.load(base + 3, mask=mask, other=0.0).to(tl.float32)
            n0 = (a0 != 0).to(tl.int32)
            n1 = (a1 != 0).to(tl.int32)
            n2 = (a2 != 0).to(tl.int32)
            n3 = (a3 != 0).to(tl.int32)
            pad = 2 - (n0 + n1 + n2 + n3)  # zero positions still to choose, earliest first
            # zrank_i = number of zeros before position i
            c0 = (n0 == 1) | (pad > 0)
            c1 = (n1 == 1) | ((1 - n0) < pad)
            c2 = (n2 == 1) | ((2 - n0 - n1) < pad)
            c3 = (n3 == 1) | ((3 - n0 - n1 - n2) < pad)
            idx0 = tl.where(c0, 0, tl.where(c1, 1, 2))
            idx1 = tl.where(c3, 3, tl.where(c2, 2, 1))
            v0 = tl.where(idx0 == 0, a0, tl.where(idx0 == 1, a1, a2))
            v1 = tl.where(idx1 == 3, a3, tl.where(idx1 == 2, a2, a1))
            out = v_ptr + row_v + g[None, :] * 2
            tl.store(out, v0.to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(out + 1, v1.to(v_ptr.dtype.element_ty), mask=mask)
            code = tl.where(mask, idx0 | (idx1 << 2), 0)  # missing tail groups: code 0
            meta = meta | (code << (4 * q))
        meta = tl.where(meta >= 32768, meta - 65536, meta)  # two's complement int16
        meta_words, w_mask = _words(meta_ptr, r, r_mask, words, n_words)
        tl.store(meta_words, meta.to(tl.int16), mask=w_mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _decompress_kernel(  # type: ignore[no-untyped-def]
        v_ptr, meta_ptr, w_ptr, rows, cols, n_words, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr
    ):
        """w[r, 4g + idx_j] = values[r, 2g + j]; zeros elsewhere."""
        r, words, r_mask = _tile(rows, BLOCK_R, BLOCK_W)
        meta_words, w_mask = _words(meta_ptr, r, r_mask, words, n_words)
        meta = tl.load(meta_words, mask=w_mask, other=0).to(tl.int32)
        meta = meta & 0xFFFF
        row_w = r[:, None].to(tl.int64) * cols
        row_v = r[:, None].to(tl.int64) * (cols // 2)
        for q in tl.static_range(4):
            g, mask = _group(words, q, r_mask, cols)
            code = (meta >> (4 * q)) & 15
            idx0 = code & 3
            idx1 = code >> 2
            src = v_ptr + row_v + g[None, :] * 2
            v0 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            v1 = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
            base = w_ptr + row_w + g[None, :] * 4
            for i in tl.static_range(4):
                val = tl.where(idx0 == i, v0, tl.where(idx1 == i, v1, 0.0))
                tl.store(base + i, val.to(w_ptr.dtype.element_ty), mask=mask)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch the launchers below make on a GPU (for tools/gpu_compile.py).

        Both kernels, fp16/bf16/fp32, column counts that are and are not multiples of 16.
        """
        launches: list[dict[str, Any]] = []
        opts = {"num_warps": NUM_WARPS}
        tiles = {"BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W}
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for cols in (4096, 4100):
                shape = {"rows": 4096, "cols": cols, "n_words": -(-cols // 16), **tiles}
                args = {"w_ptr": dtype, "v_ptr": dtype, "meta_ptr": torch.int16, **shape}
                launches.append({"kernel": _compress_kernel, "args": args, "options": opts})
                args = {"v_ptr": dtype, "meta_ptr": torch.int16, "w_ptr": dtype, **shape}
                launches.append({"kernel": _decompress_kernel, "args": args, "options": opts})
        return launches


def _check_device(t: Tensor) -> None:
    if not available(t.device):
        raise ValueError(f"the Triton 2:4 kernels need CUDA or TRITON_INTERPRET=1 (got {t.device})")


def _launch(kernel: Any, tensors: tuple[Tensor, ...], rows: int, cols: int, n_words: int) -> None:
    """`kernel` over the (row, metadata word) tiles of a rows x cols matrix (none when empty)."""
    if rows and cols:
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(n_words, BLOCK_W))
        kernel[grid](*tensors, rows, cols, n_words, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W,
                     num_warps=NUM_WARPS)  # fmt: skip


def compress_24_triton(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Row-major (values, meta) of a 2:4 `weight` (validated by the caller) with Triton."""
    _check_device(weight)
    weight = weight.contiguous()
    rows, cols = weight.shape
    n_words = -(-cols // 16)
    values = torch.empty(rows, cols // 2, device=weight.device, dtype=weight.dtype)
    meta = torch.empty(rows, n_words, device=weight.device, dtype=torch.int16)
    _launch(_compress_kernel, (weight, values, meta), rows, cols, n_words)
    return values, meta


def decompress_24_triton(values: Tensor, meta: Tensor, cols: int) -> Tensor:
    """Dense (rows, cols) from row-major (values, meta) with Triton (shapes checked by caller)."""
    _check_device(values)
    values = values.contiguous()
    meta = meta.contiguous()
    rows = values.shape[0]
    n_words = meta.shape[1]
    dense = torch.empty(rows, cols, device=values.device, dtype=values.dtype)
    _launch(_decompress_kernel, (values, meta, dense), rows, cols, n_words)
    return dense
