"""Launch configurations and operand layout of the block-sparse kernels in `_bsr_kernels`.

Plain torch, no Triton: the tile edges the kernels take, each kernel's GPU launch configuration
(`kernel_config`, also compiled by `tools/gpu_compile.py`), the precision of their fp32 `tl.dot`,
the token splits of the dW kernels and the 16-column padding of the operands (`aligned`).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor

from sparse_kernels.config import BLOCK_SIZES  # the tile edges the kernels take

_SHARED_BUDGET = 160 * 1024  # bytes of shared memory a config may plan for (A100: 163 KB)


def kernel_config(kernel: str, block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """GPU launch configuration of `kernel` ("dsd" | "dsdt" | "sdd") for b x b tiles of `dtype`.

    `BLOCK_M` is the token tile (the rows of X/dY a program owns; for "sdd" the token step of its
    reduction loop), `BK` the reduction chunk of a tile per loop step ("dsd"/"dsdt"), and
    `num_warps`/`num_stages` go to the launch. The launchers use exactly these (compile records:
    benchmarks/RESULTS.md). "dsd"/"dsdt" take 3 stages where they fit `_SHARED_BUDGET`; "sdd"
    holds a (b, b) fp32 accumulator: 8 warps at b = 128 keep it at 64 registers per thread, and
    a 32-token step keeps the operand buffers small.
    """
    if kernel not in ("dsd", "dsdt", "sdd"):
        raise ValueError(f"`kernel` ({kernel!r}) must be 'dsd', 'dsdt' or 'sdd'")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"the Triton kernels take `block_size` in {BLOCK_SIZES}, got {block_size}")
    elt = dtype.itemsize
    warps = 8 if block_size == 128 else 4
    if kernel == "sdd":
        block_m = 32 if block_size == 128 else 64
        return {"BLOCK_M": block_m, "BK": block_size, "num_warps": warps, "num_stages": 3}
    bk = min(block_size, 64 if elt <= 2 else 32)
    per_stage = (64 * bk + block_size * bk) * elt
    stages = 3 if 3 * per_stage <= _SHARED_BUDGET else 2
    return {"BLOCK_M": 64, "BK": bk, "num_warps": warps, "num_stages": stages}


DotPrecision = Literal["ieee", "tf32"]


def dot_precision(dtype: torch.dtype) -> DotPrecision:
    """`input_precision` of the kernels' `tl.dot` for operands of `dtype` (a launch constexpr).

    fp32 operands follow `torch.get_float32_matmul_precision()`, as `nn.Linear` does on CUDA:
    "highest" (torch's default) -> "ieee" (exact fp32 products and fp32 sums, on the FMA units,
    not the tensor cores), "high" or "medium" -> "tf32" (operands rounded to a 10-bit mantissa,
    products summed in fp32 on the tensor cores). 3xTF32 ("tf32x3") is not used for "highest":
    whether it matches IEEE fp32 to the same tolerance has not been measured on a GPU.
    bf16/fp16 operands get "tf32", Triton's default, which Triton ignores for 16-bit operands,
    so their kernels compile exactly as without the argument.
    """
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def sdd_splits(nnzb: int, tokens: int, block_m: int, programs: int) -> int:
    """Token splits of the dW kernel.

    Enough programs (`nnzb · splits` >= `programs`, about two waves of SMs), each with at least
    4 token steps, at most 16 partial sums.
    """
    want = -(-programs // max(nnzb, 1))
    return max(1, min(want, tokens // (4 * block_m), 16))


def check_sdd(dy: Tensor, x: Tensor, splits: int | None) -> None:
    """The dW launchers' own argument checks (beyond the operand checks of `_bsr_kernels`)."""
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"`dy` has {dy.shape[0]} rows but `x` has {x.shape[0]}")
    if splits is not None and splits < 1:
        raise ValueError(f"`splits` ({splits}) must be >= 1")


def sdd_plan(
    tokens: int, nnzb: int, block_m: int, splits: int | None, device: torch.device
) -> tuple[int, int]:
    """(splits, tokens per split) of a dW launch over `tokens` >= 1 and `nnzb` >= 1 tiles.

    `splits` None: `sdd_splits` over two waves of SMs (4 "SMs" on CPU). Tokens per split are a
    multiple of `block_m`, and the splits are recounted from them.
    """
    if splits is None:
        splits = sdd_splits(nnzb, tokens, block_m, 2 * sm_count(device))
    per_split = -(-tokens // splits)
    per = -(-per_split // block_m) * block_m
    return -(-tokens // per), per


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device` (the waves `sdd_splits` aims at); 4 on CPU.

    Queried once per device and cached: a steady-state launch makes no torch.cuda query.
    """
    if device.type == "cpu":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.cache
def capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of CUDA `device` (None for another device), queried once per device."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (`triton.cdiv` is a constexpr function: ~1.4 us a call)."""
    return -(-a // b)


def aligned(t: Tensor) -> Tensor:
    """`t` contiguous, its columns zero-padded to a multiple of 16 (one copy if odd).

    Rows are then 16-byte aligned and the mask bound a multiple of 16, so the kernels' loads
    vectorize and pipeline.
    """
    pad = -t.shape[1] % 16
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()
