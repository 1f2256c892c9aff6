"""TF32 in tests: fp32 rounded to TF32, error bounds of TF32 products, and TF32 dots on CPU.

TF32 keeps fp32's sign and 8 exponent bits and the top 10 of its 23 mantissa bits. On NVIDIA
tensor cores a TF32 matmul multiplies TF32 operands exactly and sums the products in fp32.
cuBLAS rounds fp32 operands to nearest; Triton's `tl.dot(..., input_precision="tf32")` hands
the raw fp32 registers to `mma`/`wgmma`, whose conversion the PTX ISA leaves
implementation-defined (in practice the low 13 bits are dropped: triton-lang/triton#4574), so
both roundings are provided.

The Triton interpreter computes every fp32 `tl.dot` exactly, whatever its `input_precision`:
`interpreted_tf32_dots` makes it round the operands of "tf32" dots as the tensor cores do and
records the precision of every dot it runs, so a CPU test sees which precision a kernel
really used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor

Rounding = Literal["nearest", "zero"]

#: Unit roundoff of an fp32 sum that may truncate (tensor-core accumulation): one ulp, 2^-23.
FP32_SUM_UNIT = 2.0**-23
_DROPPED = 13  # fp32 mantissa bits TF32 drops (23 - 10)


def round_to_tf32(t: Tensor, *, rounding: Rounding = "nearest") -> Tensor:
    """`t` (fp32) rounded to TF32, as fp32 values whose low 13 mantissa bits are zero.

    `rounding="nearest"`: to nearest, ties to even on the kept bits (overflow past the largest
    TF32 value gives inf, as IEEE rounding does); `"zero"`: the dropped bits cut off. inf and
    NaN are returned unchanged.
    """
    if t.dtype != torch.float32:
        raise TypeError(f"`t` must be float32 to round to TF32, got {t.dtype}")
    if rounding not in ("nearest", "zero"):
        raise ValueError(f"`rounding` ({rounding!r}) must be 'nearest' or 'zero'")
    bits = t.contiguous().view(torch.int32)
    if rounding == "nearest":
        half = (1 << (_DROPPED - 1)) - 1  # 0xFFF: below half rounds down, above rounds up
        bits = bits + half + ((bits >> _DROPPED) & 1)  # + the kept lsb: ties go to even
    rounded = (bits & ~((1 << _DROPPED) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


def matmul_error_bound(a: Tensor, b: Tensor, *, terms: int) -> Tensor:
    """Worst-case error of an fp32 sum of the exact products of `a @ b` (float64, elementwise).

    `|fl(Σ a_ik b_kj) - Σ a_ik b_kj| <= gamma_n Σ |a_ik b_kj|`, `gamma_n = n u / (1 - n u)`, for any
    summation order (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., Lemma
    3.1 / eq. 3.5), `n = terms` additions and `u = 2^-23`, one ulp per addition, which also
    covers truncating tensor-core accumulators. TF32 products are exact in fp32 (11 x 11
    significand bits), so with `a`, `b` already rounded to TF32 this bounds a TF32 matmul's
    distance from the float64 product of the rounded operands.
    """
    nu = terms * FP32_SUM_UNIT
    if nu >= 1:
        raise ValueError(f"`terms` ({terms}) too large for a bound with u = 2^-23")
    return (nu / (1 - nu)) * (a.double().abs() @ b.double().abs())


@contextmanager
def interpreted_tf32_dots(rounding: Rounding = "zero") -> Iterator[list[str]]:
    """Under TRITON_INTERPRET=1, "tf32" dots round their fp32 operands (`round_to_tf32`).

    Yields the list of the `input_precision` of every `tl.dot` run inside the block, in order
    ("ieee", "tf32", "tf32x3", ...: the value the compiled kernel received). Products and
    sums stay exact fp32 (numpy), as before; "tf32x3" and "ieee" dots are not changed.
    """
    from triton.runtime import interpreter

    builder: Any = interpreter.InterpreterBuilder
    original = builder.create_dot
    seen: list[str] = []

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        precision = args[0]  # (input_precision, max_num_imprecise_acc)
        seen.append(precision.name.lower())
        if precision.name == "TF32" and a.data.dtype.name == "float32":
            a, b = (
                interpreter.TensorHandle(
                    round_to_tf32(torch.from_numpy(h.data), rounding=rounding).numpy(), h.dtype
                )
                for h in (a, b)
            )
        return original(self, a, b, d, *args)

    builder.create_dot = create_dot
    try:
        yield seen
    finally:
        builder.create_dot = original
