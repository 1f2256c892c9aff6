"""CAME's blockwise 8-bit `exp_avg` (`state_dtype=torch.int8`): `optim_adafactor.quant`.

The format, the PyTorch reference and the kernels' helpers live in optim-adafactor (Adafactor's
momentum uses them too); these are the names CAME's modules and tests use.
"""

from optim_adafactor.quant import (
    QBLOCK,
    QMAX,
    dequantize,
    hash_uniform,
    num_blocks,
    quant_seed,
    quantize_,
    scale_shape,
)
from optim_adafactor.quant import blocked as _blocked

__all__ = [
    "QBLOCK",
    "QMAX",
    "_blocked",
    "dequantize",
    "hash_uniform",
    "num_blocks",
    "quant_seed",
    "quantize_",
    "scale_shape",
]
