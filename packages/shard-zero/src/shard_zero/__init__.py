"""shard-zero: ZeRO stages 1-3 on torch.distributed, exact for factored optimizers."""

from shard_zero._api import prepare
from shard_zero._checkpoint import load_checkpoint, save_checkpoint
from shard_zero._config import ZeroConfig
from shard_zero._gathered import gathered
from shard_zero._layout import RowShardInfo
from shard_zero._optimizer import ZeroOptimizer
from shard_zero._state import full_state_dict, memory_stats

__all__ = [
    "RowShardInfo",
    "ZeroConfig",
    "ZeroOptimizer",
    "full_state_dict",
    "gathered",
    "load_checkpoint",
    "memory_stats",
    "prepare",
    "save_checkpoint",
]
