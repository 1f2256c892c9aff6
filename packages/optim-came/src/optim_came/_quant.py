"""Blockwise 8-bit storage of CAME's first moment (`state_dtype=torch.int8`), PyTorch reference.

`exp_avg` of a >= 2-D parameter is kept as int8 codes shaped like the parameter plus
`exp_avg_scale`, one fp32 absmax per block of `QBLOCK` consecutive elements of a row (the last
dim; a row whose length is not a multiple of `QBLOCK` ends in a partial block). Blocks never
cross rows, so sharding a parameter by rows (shard-zero, FSDP2) keeps every block whole and a
shard quantizes exactly as the whole tensor does.

The map is signed and quadratic: code `q` in [-127, 127] stands for `sign(q)·(q/127)²·scale`.
Like bitsandbytes' dynamic map it spends its codes more densely near zero than a linear map
(spacing `scale·(2|q|+1)/127²`: ~6e-5·scale next to zero, ~0.016·scale at the absmax, about
the dynamic map's 1/64 there), but encoding and decoding are arithmetic (a square root and a
square) rather than a 256-entry table gather and an 8-step binary search, which keeps a fused
kernel's per-element work small. The block's absmax is coded exactly (`q = ±127`).

Rounding is to the nearest representable value, or stochastic (unbiased in value: up with
probability `(a - lo²)/(hi² - lo²)` between the neighbouring codes `lo`, `hi`). The stochastic
noise is a hash of (seed, global element index), so a row shard draws the same noise for its
elements as the whole tensor does (exact under sharding) and a resume continues it from the
seed and step count alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

QBLOCK = 128  # elements per scale; divides every shipped column tile (>= 128, powers of two)
QMAX = 127
_QMAX_SQ = float(QMAX * QMAX)
_MASK32 = 0xFFFFFFFF


def num_blocks(cols: int) -> int:
    """Blocks per row of `cols` elements (the last one partial when `cols % QBLOCK`)."""
    return -(-cols // QBLOCK)


def scale_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of `exp_avg_scale` for a parameter of `shape` (>= 2-D): rows x blocks."""
    return (*shape[:-1], num_blocks(shape[-1]))


def _blocked(x: Tensor) -> Tensor:
    """(..., m) -> (..., blocks, QBLOCK), zero-padded at the end of each row when needed."""
    m = x.shape[-1]
    nb = num_blocks(m)
    pad = nb * QBLOCK - m
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, QBLOCK)


def _unblocked(xb: Tensor, m: int) -> Tensor:
    x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * QBLOCK)
    return x[..., :m] if x.shape[-1] != m else x


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """Values of int8 `codes` (..., m) with per-block `scale` (..., blocks), in scale's dtype."""
    c = codes.to(scale.dtype)
    c.mul_(c.abs())  # q·|q|: the signed square
    vb = _blocked(c).mul_((scale / _QMAX_SQ).unsqueeze(-1))
    return _unblocked(vb, codes.shape[-1])


def hash_uniform(seed: int, offset: int, shape: Sequence[int], device: torch.device) -> Tensor:
    """Uniform [0, 1) noise for the elements `offset + arange(numel)` of a flat tensor.

    murmur3's 32-bit finaliser of `index ^ seed'` (low 32 bits of the index), computed in int64
    with masking; 24 bits of it become an exact fp32 in [0, 1).
    """
    numel = math.prod(shape)
    h = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    h = (h * 0x9E3779B1 + (seed * 0x85EBCA6B + 0x27D4EB2F)) & _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return (h >> 8).float().mul_(2.0**-24).view(*shape)


def quantize_(x: Tensor, codes: Tensor, scale: Tensor, *, noise: Tensor | None = None) -> None:
    """Write fp32 `x` (..., m) into int8 `codes` (same shape) and fp32 `scale` (..., blocks).

    `noise`: uniform [0, 1) values shaped like `x` for stochastic rounding (None: nearest).
    """
    m = x.shape[-1]
    xb = _blocked(x.float())
    absmax = xb.abs().amax(dim=-1)
    scale.copy_(absmax)
    inv = torch.where(absmax > 0, _QMAX_SQ / absmax, 0.0).unsqueeze(-1)
    a = xb.abs().mul_(inv).clamp_(max=_QMAX_SQ)  # target in code² units, [0, 127²]
    lo = a.sqrt().floor_()
    lo.sub_((lo * lo > a).float()).add_(((lo + 1) * (lo + 1) <= a).float())  # exact floor(√a)
    lo.clamp_(0, QMAX)
    lo_sq = lo * lo
    width = 2.0 * lo + 1.0  # (lo+1)² - lo²
    frac = (a - lo_sq).div_(width)  # position between the two codes' values, in [0, 1)
    up = frac > 0.5 if noise is None else _blocked(noise) < frac  # ties (0.5) round down
    q = (lo + up.float()).clamp_(max=QMAX).mul_(xb.sign())
    codes.copy_(_unblocked(q, m))
