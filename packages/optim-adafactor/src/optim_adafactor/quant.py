"""Blockwise 8-bit storage of a first moment (`state_dtype=torch.int8`), PyTorch reference.

Shared by Adafactor's momentum and optim-came's CAME `exp_avg`. The state of a >= 2-D
parameter is int8 codes shaped like the parameter plus `exp_avg_scale`, one fp32 absmax per
block of `QBLOCK` elements of a row; blocks never cross rows, so a row shard (shard-zero,
FSDP2) quantizes exactly as the whole tensor. Code `q` in [-127, 127] stands for
`sign(q)·(q/127)²·scale`: denser near zero like bitsandbytes' dynamic map, but encoded and
decoded arithmetically (a square root, a square) instead of a table search, which keeps a fused
kernel's per-element work small. Rounding is nearest, or stochastic with noise hashed from
(seed, global element index), so shards and resumes draw the same noise.

The fused kernels' side: `quant_seed` (the hash constant of a seed and a shard's first
element), `quant_tile` (multi-tensor tiles of whole blocks) and, with Triton, the
`@triton.jit` helpers `load_momentum` / `store_momentum` (decode after the load, encode before
the store, in the pass that touches the moment), `dequant` and `quant_args` (a matrix's scale
pointer and hash constant from a multi-tensor address table whose last column is the scales).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import Tensor
from torch.nn import functional as F

from optim_adafactor._quant_kernels import _HASH_MUL, _MASK32, QBLOCK, QMAX, _int32
from optim_adafactor.base import stat_dtype
from optim_adafactor.factored import chunk

if TYPE_CHECKING:
    from optim_adafactor.base import FactoredOptimizer, StepWork

__all__ = [
    "QBLOCK",
    "QMAX",
    "blocked",
    "convert_",
    "dequantize",
    "hash_uniform",
    "load_state",
    "num_blocks",
    "prepare",
    "quant_seed",
    "quant_tile",
    "quantize_",
    "scale_shape",
    "shard_offset",
    "store_state",
]

_QMAX_SQ = float(QMAX * QMAX)
_ALL = slice(None)


def num_blocks(cols: int) -> int:
    """Blocks per row of `cols` elements (the last one partial when `cols % QBLOCK`)."""
    return -(-cols // QBLOCK)


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of `exp_avg_scale` for a parameter of `shape` (>= 2-D): rows x blocks."""
    return (*shape[:-1], num_blocks(shape[-1]))


def blocked(x: Tensor) -> Tensor:
    """(..., m) -> (..., blocks, QBLOCK), zero-padded at the end of each row when needed."""
    m = x.shape[-1]
    nb = num_blocks(m)
    pad = nb * QBLOCK - m
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, QBLOCK)


def _block_views(x: Tensor) -> list[tuple[Tensor, slice]]:
    """Views of `x` (..., m) as whole blocks (..., k, QBLOCK) and the partial last block.

    The partial block (when `m % QBLOCK`) is a (..., 1, m % QBLOCK) view. Each view comes with
    the range of blocks it covers: no copy, no padding.
    """
    m = x.shape[-1]
    full = m // QBLOCK
    views = []
    if full:
        head = x[..., : full * QBLOCK]
        views.append((head.view(*head.shape[:-1], full, QBLOCK), slice(0, full)))
    if m % QBLOCK:
        views.append((x[..., full * QBLOCK :].unsqueeze(-2), slice(full, full + 1)))
    return views


def _mul_blocks_(x: Tensor, per_block: Tensor) -> Tensor:
    """`x *= per_block` broadcast over each block's elements, in place."""
    for view, blocks in _block_views(x):
        view.mul_(per_block[..., blocks].unsqueeze(-1))
    return x


def dequantize(
    codes: Tensor, scale: Tensor, *, out: Tensor | None = None, scratch: Tensor | None = None
) -> Tensor:
    """Values of int8 `codes` (..., m) with per-block `scale` (..., blocks), in scale's dtype.

    `out`, `scratch`: tensors of that dtype shaped like `codes` to write the values into and to
    use for a temporary (fresh ones when None), so that a step allocates nothing.
    """
    out = torch.empty(codes.shape, dtype=scale.dtype, device=codes.device) if out is None else out
    out.copy_(codes)
    out.mul_(torch.abs(out, out=scratch) if scratch is not None else out.abs())  # q·|q|
    return _mul_blocks_(out, scale / _QMAX_SQ)


def hash_uniform(
    seed: int,
    offset: int,
    shape: Sequence[int],
    device: torch.device,
    *,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """Uniform [0, 1) noise for the elements `offset + arange(numel)` of a flat tensor.

    murmur3's 32-bit finaliser of `index ^ seed'` (low 32 bits of the index); 24 bits of it
    become an exact fp32 in [0, 1). Computed in place in int32, whose multiplication and
    addition wrap modulo 2^32 like the kernels' masked 64-bit arithmetic; the arithmetic right
    shifts are masked into logical ones. `out` (fp32) and `scratch` (int32), `shape`-sized
    workspaces (None: allocated), receive the noise and hold the hash.
    """
    if torch.compiler.is_compiling():  # the same noise, through a custom op
        noise: Tensor = _hash_uniform_op(seed, offset, list(shape), device)
        return noise
    numel = math.prod(shape)
    if numel >= 1 << 31:  # int64 -> int32 keeps the low 32 bits
        h = torch.arange(numel, dtype=torch.int64, device=device).to(torch.int32)
    elif scratch is not None:
        h = torch.arange(numel, dtype=torch.int32, device=device, out=scratch.view(-1))
    else:
        h = torch.arange(numel, dtype=torch.int32, device=device)
    out = torch.empty(numel, dtype=torch.float32, device=device) if out is None else out
    h.add_(_int32(offset)).mul_(_int32(_HASH_MUL)).add_(_int32(seed * 0x85EBCA6B + 0x27D4EB2F))
    shifted = out.view(-1).view(torch.int32)  # the output's bytes, until the end
    for mul, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13), (None, 16)):
        torch.bitwise_right_shift(h, shift, out=shifted).bitwise_and_((1 << (32 - shift)) - 1)
        h.bitwise_xor_(shifted)
        if mul is not None:
            h.mul_(_int32(mul))
    h.bitwise_right_shift_(8).bitwise_and_((1 << 24) - 1)
    return out.view(-1).copy_(h).mul_(2.0**-24).view(*shape)


def quantize_(
    x: Tensor,
    codes: Tensor,
    scale: Tensor,
    *,
    noise: Tensor | None = None,
    scratch: Tensor | None = None,
    signs: Tensor | None = None,
    sr_scratch: Tensor | None = None,
) -> None:
    """Write `x` (..., m) into int8 `codes` (same shape) and fp32 `scale` (..., blocks).

    `noise`: uniform [0, 1) values shaped like `x` for stochastic rounding (None: nearest).
    `scratch`: an fp32 tensor shaped like `x` for temporaries; when given, an fp32 `x` is
    overwritten too (the step passes the momentum it no longer needs). None: `x` is left
    intact. `signs`: a bool tensor shaped like `x` for the signs; `sr_scratch`: one more fp32
    tensor like `x`, for stochastic rounding (None: allocated). With them, nothing N-sized is
    allocated (on CPU a fresh tensor's page faults cost more than an elementwise op).

    Every op is element-wise or a per-block reduction over views (no padding, no per-block
    tensors), in place in `x` and `scratch`:

    - `a = |x| · (127²/absmax)` clamped to 127², then `lo = floor(√a)` by an fp32 sqrt, which
      can round up to `k` just below `a = k²`;
    - nearest: up one code iff `(a - lo²)/(2lo+1) > 0.5`, tested as `a - (lo + 1/2)² > 1/4`:
      the subtraction is exact (`(lo + 1/2)²` lies on `a`'s ulp grid and the result needs fewer
      bits than `a`), and the fp32 quotient could only round onto 0.5 from a distance below its
      half-ulp, which `a`'s grid never reaches. A `lo` one too large (`a` just below `k²`)
      gives `k` either way;
    - stochastic: `lo` corrected to the exact floor, then the fp32 quotient as written,
      compared with the noise.
    """
    if torch.compiler.is_compiling():  # the same codes, through a custom op
        _quantize_op(x, codes, scale, noise)
        return
    if scratch is None or x.dtype != torch.float32 or scratch.dtype != torch.float32:
        x = x.to(torch.float32, copy=True)
        scratch = torch.empty_like(x)
    a = torch.abs(x, out=scratch)
    absmax = torch.empty(scale.shape, dtype=torch.float32, device=x.device)
    for view, blocks in _block_views(a):
        absmax[..., blocks] = view.amax(dim=-1)
    scale.copy_(absmax)
    # fl(127²/absmax) correctly rounded, as the kernels' div_rn: torch's `scalar / tensor`
    # multiplies by a rounded reciprocal, one ulp off in about a quarter of the blocks
    inv = torch.where(absmax > 0, torch.full_like(absmax, _QMAX_SQ).div_(absmax), 0.0)
    # 0/1 into int8 (twice as fast as into bool on the CPU); -0.0 and 0.0 both code 0
    negative = torch.lt(
        x, 0.0, out=torch.empty_like(codes) if signs is None else signs.view(codes.dtype)
    )
    _mul_blocks_(a, inv).clamp_(max=_QMAX_SQ)  # a in code² units, [0, 127²]
    lo = torch.sqrt(a, out=x).floor_()
    if noise is None:
        half = lo.add_(0.5)  # lo + 1/2: a - (lo + 1/2)² = a - lo² - lo - 1/4, exact
        d = torch.addcmul(a, half, half, value=-1.0, out=a)
        q = half.add_(torch.gt(d, 0.25, out=d))  # ties round down; the int8 cast drops the 1/2
    else:
        d = torch.addcmul(a, lo, lo, value=-1.0, out=sr_scratch)  # < 0: lo is one too large
        lo.sub_(torch.lt(d, 0.0, out=d))
        frac = torch.addcmul(a, lo, lo, value=-1.0, out=a)  # (a - lo²) / (2lo + 1) in [0, 1)
        frac.div_(torch.mul(lo, 2.0, out=d).add_(1.0))
        q = lo.add_(torch.lt(noise, frac, out=frac)).clamp_(max=QMAX)
    codes.copy_(q)  # truncates toward zero
    codes.mul_(negative.mul_(-2).add_(1))  # the signs, as ±1 int8


# `torch.compile(opt.step)` calls `hash_uniform` and `quantize_` as these custom ops (opaque to
# the compiler, no graph break), which run the eager functions: the same noise, codes and scales.
# Inductor (torch 2.13, CPU) miscompiled the eager ones' in-place dtype views (flipped signs, a C++
# compile error), then functional forms of them on tensors whose leading dimensions are all 1:
# each element's block factor gathered by index read outside the scales when the last block was
# partial, and the hash of a static (1, 100) tensor gave wrong noise and corrupted the heap.
@torch.library.custom_op("optim_adafactor::hash_uniform", mutates_args=())
def _hash_uniform_op(seed: int, offset: int, shape: list[int], device: torch.device) -> Tensor:
    """`hash_uniform(seed, offset, shape, device)` in a new tensor."""
    return hash_uniform(seed, offset, shape, device)


@_hash_uniform_op.register_fake
def _(seed: int, offset: int, shape: list[int], device: torch.device) -> Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device)


@torch.library.custom_op("optim_adafactor::quantize", mutates_args=("codes", "scale"))
def _quantize_op(x: Tensor, codes: Tensor, scale: Tensor, noise: Tensor | None) -> None:
    """`quantize_(x, codes, scale, noise=noise)`; `x` is left intact."""
    quantize_(x, codes, scale, noise=noise)


@_quantize_op.register_fake
def _(x: Tensor, codes: Tensor, scale: Tensor, noise: Tensor | None) -> None:
    return None


def quant_seed(seed: int | None, offset: int = 0) -> int:
    """The additive constant of `hash_uniform`'s first round, masked to 32 bits (0 for None).

    `offset`: the flat index of the tensor's first element in the whole tensor (a row
    shard's), folded in so that a kernel hashing its local indices draws the global noise:
    `(i + offset)·K + c = i·K + (offset·K + c)` modulo 2^32.
    """
    if seed is None:
        return 0
    return (offset * _HASH_MUL + seed * 0x85EBCA6B + 0x27D4EB2F) & _MASK32


def quant_tile(
    sub: int, bm: int, warps: int, *, quant: bool, apply: bool = False
) -> tuple[int, int, int]:
    """(SUB, BLOCK_M, num_warps) of a multi-tensor launch; int8: 8 x 128 on 4 warps (whole blocks).

    Tiles of `bm` = 256 columns already hold whole blocks and are kept. `apply` on unaligned
    rows (scalar loads): 4 x 128, 4 elements per thread as the 16 x 32 tile it replaces (CAME's
    8 x 128 took 156 registers on sm_80 and spilled 16 bytes with SR).
    """
    if quant and bm != 256:
        return (4, 128, 4) if apply and bm < 128 else (8, 128, 4)
    return sub, bm, warps


# ---------------------------------------------------------------------------------- optimizers
def convert_(p: Tensor, state: dict[str, Any], dtype: torch.dtype) -> None:
    """Convert `state["exp_avg"]` of `p` to `dtype` (a group's `state_dtype` changed).

    A float `exp_avg` is quantized to nearest; int8 codes (with `state["exp_avg_scale"]`,
    dropped) are dequantized.
    """
    m = state["exp_avg"]
    if m.dtype == dtype:
        return
    if m.dtype == torch.int8:  # int8 -> float: dequantize, drop the scales
        m = dequantize(m.to(p.device), state.pop("exp_avg_scale").to(p.device))
    if dtype == torch.int8:
        codes = torch.empty(p.shape, dtype=torch.int8, device=p.device)
        scale = torch.empty(scale_shape(p.shape), dtype=stat_dtype(p), device=p.device)
        quantize_(m.to(device=p.device, dtype=torch.float32), codes, scale)
        state["exp_avg"], state["exp_avg_scale"] = codes, scale
    else:
        state["exp_avg"] = m.to(device=p.device, dtype=dtype)


def prepare(opt: FactoredOptimizer, w: StepWork) -> None:
    """Give `w` with an int8 or bf16 `exp_avg` its workspaces (int8: and its codes' seed).

    On the PyTorch path a bf16 `exp_avg` is upcast into `w.m_buf` by `load_state` and rounded
    back by `store_state`: one op per element in each direction, where computing on the bf16
    tensor itself (a mixed-dtype op per update term) took 5-6x the time on the CPU.
    """
    dtype = w.state["exp_avg"].dtype
    if dtype != torch.int8:
        if not w.fused and dtype != w.grad.dtype:
            w.m_buf = opt._workspace(w.grad, slot=1, shape=opt._buf_shape(w))
        return
    if w.opts.stochastic_rounding:
        w.quant_seed = opt._kernel_seed(w)
    if not w.fused:  # workspaces of the dequantized exp_avg and the quantizer: one chunk each
        shape = opt._buf_shape(w)
        w.m_buf = opt._workspace(w.grad, slot=1, shape=shape)
        w.sign_buf = opt._workspace(w.grad, dtype=torch.bool, shape=shape)
        if w.quant_seed is not None:
            w.noise_buf = opt._workspace(w.grad, dtype=torch.float32, slot=2, shape=shape)
            w.hash_buf = opt._workspace(w.grad, dtype=torch.int32, shape=shape)


def shard_offset(w: StepWork) -> int:
    """Flat index of `w`'s first element in the whole tensor (a row shard's; else 0)."""
    return w.shard.row_offset * math.prod(w.param.shape[1:]) if w.shard is not None else 0


def load_state(w: StepWork, scratch: Tensor | None = None, rows: slice = _ALL) -> Tensor:
    """Rows `rows` of `exp_avg` in fp32: the state, or its codes or bf16 values in `w.m_buf`.

    `scratch`: a workspace shaped like those rows, free for a temporary.
    """
    m: Tensor = _rows(w.state["exp_avg"], rows)
    if m.dtype != torch.int8:
        return m if w.m_buf is None else chunk(w.m_buf, rows).copy_(m)
    scale = _rows(w.state["exp_avg_scale"], rows)
    if scratch is not None and scratch.dtype != scale.dtype:
        scratch = None
    return dequantize(m, scale, out=_chunk(w.m_buf, rows), scratch=scratch)


def store_state(w: StepWork, m: Tensor, scratch: Tensor | None = None, rows: slice = _ALL) -> None:
    """Write fp32 `m` (`load_state`'s), rows `rows` of the moment, back into `exp_avg`.

    A no-op where `m` is the state itself. `scratch`: a workspace shaped like `m`; when given,
    an int8 store overwrites `m` as well.
    """
    codes = _rows(w.state["exp_avg"], rows)
    if codes.dtype != torch.int8:
        if w.m_buf is not None:
            codes.copy_(m)  # bf16: rounded to nearest, as the kernels store it
        return
    hash_buf, noise = _chunk(w.hash_buf, rows), None
    if w.quant_seed is not None:  # noise of the global elements: a row shard draws its own
        first = shard_offset(w) + (rows.start or 0) * math.prod(m.shape[1:])
        noise = hash_uniform(
            w.quant_seed, first, m.shape, m.device, out=_chunk(w.noise_buf, rows), scratch=hash_buf
        )
    sr_scratch = None if hash_buf is None else hash_buf.view(torch.float32)  # hash done
    scale = _rows(w.state["exp_avg_scale"], rows)
    quantize_(
        m, codes, scale, noise=noise, scratch=scratch, signs=_chunk(w.sign_buf, rows),
        sr_scratch=sr_scratch,
    )  # fmt: skip


@overload
def _rows(t: Tensor, rows: slice) -> Tensor: ...
@overload
def _rows(t: None, rows: slice) -> None: ...
def _rows(t: Tensor | None, rows: slice) -> Tensor | None:
    """`t[rows]` (`t` itself for all rows: a 0-dim state takes no slice; None stays None)."""
    return t if t is None or rows == _ALL else t[rows]


def _chunk(buf: Tensor | None, rows: slice) -> Tensor | None:
    """The part of a one-chunk workspace (`StepWork.m_buf`, ...) that rows `rows` use."""
    return None if buf is None else chunk(buf, rows)


HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    from optim_adafactor._quant_kernels import (
        dequant,
        load_momentum,
        quant_args,
        store_momentum,
    )

    __all__ += ["dequant", "load_momentum", "quant_args", "store_momentum"]
