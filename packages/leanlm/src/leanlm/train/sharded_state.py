"""The checkpoint formats of the sharding engines: shard-zero's own, and FSDP2's DCP folders.

Each holds a model and optimizer and can `save(path)` / `load(path)` them (the
`leanlm.train.checkpoint.ShardedState` protocol); `leanlm.train.engines` picks one per engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class ZeroState:
    """shard-zero's own checkpoint of the sharded model and optimizer (`zero/`)."""

    folder = "zero"

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def save(self, path: Path) -> None:
        """Write the model and optimizer to `path`."""
        from shard_zero import save_checkpoint

        save_checkpoint(path, self.model, self.optimizer)

    def load(self, path: Path) -> None:
        """Read the model and optimizer from `path`."""
        from shard_zero import load_checkpoint

        load_checkpoint(path, self.model, self.optimizer)


class Fsdp2State:
    """Model and optimizer `DTensor` shards as a `torch.distributed.checkpoint` (DCP) folder.

    AdamW keeps its moments as `DTensor`s and goes through torch's `get_state_dict`. CAME and
    Adafactor keep each `DTensor` parameter's state as plain tensors of its local shard, which
    DCP would take as replicated (one rank's copy for all): they go through
    `optim_adafactor.dtensor.distributed_state_dict`, which describes that state as `DTensor`s
    over the parameters' mesh (row statistics and moments sharded like the rows, a matrix's
    column statistics replicated). Either way the folder reshards: it loads at any number of
    processes.
    """

    folder = "fsdp2"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if _local_optimizer_state(self.optimizer):
            from optim_adafactor.dtensor import distributed_state_dict

            model_state = get_model_state_dict(self.model)
            return {
                "model": model_state,
                "optim": distributed_state_dict(self.optimizer, self.model),
            }
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def save(self, path: Path) -> None:
        """Write the model and optimizer to `path`."""
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self._state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        """Raises `ValueError` for the per-process optimizer files earlier leanlm wrote."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        per_rank = sorted(path.glob("optim-rank*-of-*.pt"))
        if per_rank:
            raise ValueError(
                f"{path} holds optimizer state in per-process files ({per_rank[0].name}, ...), "
                "a format this leanlm no longer reads; start the stage again (the model "
                "weights are in the DCP files of the same folder)"
            )
        state = self._state()
        load(state, checkpoint_id=str(path))
        if _local_optimizer_state(self.optimizer):
            from optim_adafactor.dtensor import load_distributed_state_dict

            set_model_state_dict(self.model, state["model"])
            load_distributed_state_dict(self.optimizer, self.model, state["optim"])
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps plain-tensor state for `DTensor` parameters (CAME, Adafactor).

    Decided from the optimizer's class, so that it holds before the first step too: the
    factored optimizers (`optim_adafactor.base.FactoredOptimizer`, also CAME's base) step a
    `DTensor`'s local shard; torch's optimizers keep `DTensor` state.
    """
    from optim_adafactor.base import FactoredOptimizer

    return isinstance(optimizer, FactoredOptimizer)
