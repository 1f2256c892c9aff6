"""`quant`'s encoder and noise as `torch.compile(opt.step)` traces them: the same bits.

The eager `quant.quantize_` and `quant.hash_uniform` work in place in workspaces, through dtype
views of them (a bool sign buffer as int8, an fp32 buffer as int32). Inductor (torch 2.13, CPU)
miscompiled that: codes with flipped signs, or a C++ compile error; a padded view of the row
left the partial block's codes unwritten. Under compile those functions call these instead:
every op makes a new tensor (inductor fuses them), each element finds its block's factor by
index.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from optim_adafactor._quant_kernels import _HASH_MUL, _MASK32, QBLOCK, QMAX, _int32

_QMAX_SQ = float(QMAX * QMAX)


def quantize_functional(x: Tensor, codes: Tensor, scale: Tensor, noise: Tensor | None) -> None:
    """`quant.quantize_` (nearest, or stochastic with `noise`) as new tensors."""
    x = x.to(torch.float32)
    pad = -x.shape[-1] % QBLOCK
    padded = F.pad(x.abs(), (0, pad))
    absmax = padded.view(*padded.shape[:-1], -1, QBLOCK).amax(dim=-1)
    scale.copy_(absmax)
    inv = torch.where(absmax > 0, torch.full_like(absmax, _QMAX_SQ) / absmax, 0.0)
    block = torch.arange(x.shape[-1], device=x.device) // QBLOCK  # each element's block
    a = (x.abs() * inv[..., block]).clamp(max=_QMAX_SQ)
    lo = torch.sqrt(a).floor()
    if noise is None:
        half = lo + 0.5
        q = lo + (a - half * half > 0.25).to(torch.float32)
    else:  # the exact floor (inductor's fused sqrt may round either way)
        lo = lo - (lo * lo > a).to(torch.float32)
        lo = lo + ((lo + 1.0) * (lo + 1.0) <= a).to(torch.float32)
        frac = (a - lo * lo) / (2.0 * lo + 1.0)
        q = (lo + (noise < frac).to(torch.float32)).clamp(max=QMAX)
    # zeros code 0 (in a block whose 127²/absmax overflows, 0·inf is NaN)
    codes.copy_(torch.where(x < 0, -q, torch.where(x > 0, q, 0.0)))


def hash_functional(seed: int, offset: int, numel: int, device: torch.device) -> Tensor:
    """`quant.hash_uniform`'s noise as new tensors: the same int32 arithmetic.

    The seed enters as a 0-d tensor: as the symbolic int dynamo makes of it (it follows the
    step), inductor's CPU code carried the hash in fp32 vectors (a C++ compile error).
    """
    first = (offset * _HASH_MUL + seed * 0x85EBCA6B + 0x27D4EB2F) & _MASK32  # `quant_seed`
    first_t = torch.full((), first, dtype=torch.int64, device=device).to(torch.int32)
    h = torch.arange(numel, dtype=torch.int64 if numel >= 1 << 31 else torch.int32, device=device)
    h = h.to(torch.int32) * _int32(_HASH_MUL) + first_t  # int64 -> int32 keeps the low bits
    for mul, shift in ((0x85EBCA6B, 16), (0xC2B2AE35, 13), (None, 16)):
        h = h ^ ((h >> shift) & ((1 << (32 - shift)) - 1))
        if mul is not None:
            h = h * _int32(mul)
    return ((h >> 8) & ((1 << 24) - 1)).to(torch.float32) * 2.0**-24
