"""Exact, fast Adafactor for PyTorch.

`Adafactor` has the Hugging Face constructor and semantics by default, presets for
`torch.optim.Adafactor` (`semantics="torch"` / `Adafactor.from_torch_args`) and the paper /
Tensor2Tensor (`semantics="t2t"`), fp32 state (or an 8-bit momentum, `optim_adafactor.quant`),
optional bf16 stochastic rounding, a vectorized PyTorch path, fused Triton kernels, and the
row-sharding protocol of `optim_adafactor.sharding`.
"""

from optim_adafactor.optimizer import Adafactor
from optim_adafactor.sharding import ROW_SHARD_ATTR, RowShard

__all__ = ["ROW_SHARD_ATTR", "Adafactor", "RowShard"]
__version__ = "0.1.0"
