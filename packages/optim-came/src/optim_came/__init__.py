"""Exact, fast CAME for PyTorch.

`CAME` is a drop-in for `came_pytorch.CAME` 0.1.3 (same constructor, same math by default) with
no host synchronisation in `step()`, a vectorized PyTorch path, fused Triton kernels, the
row-sharding protocol of `optim_adafactor.sharding`, and opt-in extras: bias correction, a
non-zero instability initialisation, a bf16 first moment and stochastic rounding.
"""

from optim_came.optimizer import CAME

__all__ = ["CAME"]
__version__ = "0.1.0"
