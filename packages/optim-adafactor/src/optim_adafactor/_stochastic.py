"""Stochastic rounding of fp32 values to bf16 (the PyTorch reference; the CPU path).

bf16 is the upper 16 bits of an fp32. Adding a uniform random integer in `[0, 2^16)` to the fp32
bit pattern and truncating the low 16 bits rounds the magnitude up with probability equal to the
discarded fraction, so `E[round(x)] = x` (unbiased) for every finite x that does not overflow.
Because fp32 is sign-magnitude, the same integer add works for negative values. Small updates
(below half a bf16 ulp) then survive in expectation instead of being lost to round-to-nearest.

`torch.compile(opt.step)` calls it as the custom op `optim_adafactor::copy_stochastic` (opaque
to the compiler, no graph break): dynamo cannot trace a `torch.Generator`, and aot_autograd
refuses the in-place add through an int32 view of the source.
"""

from __future__ import annotations

import torch
from torch import Tensor


def copy_stochastic_(
    target: Tensor, source: Tensor, generator: torch.Generator | None = None
) -> None:
    """`target.copy_(source)` with stochastic rounding; `target` bf16, `source` fp32, same shape.

    `source` is used as scratch (its low bits are overwritten).
    """
    if target.dtype != torch.bfloat16 or source.dtype != torch.float32:
        raise TypeError(
            f"stochastic rounding copies fp32 into bf16, got {source.dtype} -> {target.dtype}"
        )
    bits = source.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, source.shape, dtype=torch.int32, device=source.device, generator=generator
    )
    bits.add_(noise).bitwise_and_(-65536)  # -65536 == 0xFFFF0000 as int32
    target.copy_(source)  # exact: the value is representable in bf16 now


@torch.library.custom_op("optim_adafactor::copy_stochastic", mutates_args=("target", "source"))
def copy_stochastic_seeded(target: Tensor, source: Tensor, seed: int) -> None:
    """`copy_stochastic_` with a new generator on `source`'s device seeded with `seed`."""
    generator = torch.Generator(device=source.device).manual_seed(seed)
    copy_stochastic_(target, source, generator=generator)


@copy_stochastic_seeded.register_fake
def _(target: Tensor, source: Tensor, seed: int) -> None:
    return None
