"""How a training stage's model and optimizer are spread over processes (`engine`).

- `"ddp"`: accelerate's DDP replicates them (and the only choice with one process).
- `"zero"`: shard-zero shards optimizer state (`zero_stage` 1), + gradients (2), + parameters (3)
  as row-sharded fp32 masters, exact for CAME and Adafactor.
- `"fsdp2"`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) shards parameters and
  gradients as `DTensor`s (dim 0), and so the optimizer state: each decoder layer (the model's
  `_no_split_modules`) is one unit, gathered for its forward and backward, and the root holds
  the rest (embeddings, final norm, head). Its checkpoints are `torch.distributed.checkpoint`
  folders (one file per process; reshardable with AdamW, whose state is `DTensor`s). CAME and
  Adafactor step each shard's rows with their row statistics and keep that state as plain local
  tensors, which DCP cannot tell apart per rank: their optimizer state is saved per process and
  resumes at the same number of processes (`_Fsdp2State`).

The training loop (`leanlm.trainer`) calls the same methods whichever engine runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from leanlm.optim import decay_param_groups, optimizer_over
from leanlm.sections import TrainConfig
from leanlm.stages import StageContext


class _ZeroState:
    """shard-zero's own checkpoint of the sharded model and optimizer (`zero/`)."""

    folder = "zero"

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def save(self, path: Path) -> None:
        from shard_zero import save_checkpoint

        save_checkpoint(path, self.model, self.optimizer)

    def load(self, path: Path) -> None:
        from shard_zero import load_checkpoint

        load_checkpoint(path, self.model, self.optimizer)


class _Fsdp2State:
    """Model and optimizer `DTensor` shards as a `torch.distributed.checkpoint` (DCP) folder.

    AdamW keeps its moments as `DTensor`s, so the model and the optimizer go through DCP
    (reshardable). CAME and Adafactor keep each `DTensor` parameter's state as plain tensors of
    its local shard (`optim_adafactor.dtensor`: the shard's rows of the row statistics, the full
    column statistics, a local-shaped first moment). DCP takes a plain tensor as replicated and
    keeps one rank's copy, so a resume would silently give every rank that rank's row
    statistics; their state is therefore saved per rank instead (`optim-rank<r>-of-<w>.pt`, the
    optimizer's own `state_dict()`), next to the model's DCP files, and loads only at the same
    number of processes.
    """

    folder = "fsdp2"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _per_rank_file(self, path: Path) -> Path:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        return path / f"optim-rank{rank:05d}-of-{world:05d}.pt"

    def save(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        if _local_optimizer_state(self.optimizer):
            save({"model": get_model_state_dict(self.model)}, checkpoint_id=str(path))
            torch.save(self.optimizer.state_dict(), self._per_rank_file(path))
            return
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        """Raises `ValueError` for per-rank optimizer state written by another world size."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load

        per_rank = sorted(path.glob("optim-rank*-of-*.pt"))
        if per_rank:
            mine = self._per_rank_file(path)
            if not mine.is_file():
                raise ValueError(
                    f"{path} holds the optimizer state of each process ({per_rank[0].name}, "
                    f"...) for another number of processes than this run's; CAME and "
                    "Adafactor state under FSDP2 resumes only at the number of processes "
                    "that wrote it"
                )
            state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
            load(state, checkpoint_id=str(path))
            set_model_state_dict(self.model, state["model"])
            self.optimizer.load_state_dict(torch.load(mine, weights_only=True))
            return
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        load(state, checkpoint_id=str(path))
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


def fsdp2_shard(model: torch.nn.Module) -> torch.nn.Module:
    """`fully_shard` each decoder layer (per `_no_split_modules`), then the root; in place.

    Rank 0's parameters and buffers are broadcast first, as DDP does: a module initialised on
    each process from the global RNG would otherwise mix every rank's init (the hidden-state
    loss's projection is seeded by the run's seed, so it starts equal on every process).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)

    layer_types = {
        name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()
    }
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module)
    fully_shard(model)
    return model


class Parallel:
    """What differs between the engines in the training loop."""

    def __init__(self, ctx: StageContext, model: torch.nn.Module, cfg: TrainConfig) -> None:
        acc = ctx.accelerator
        self.acc = acc
        engine = cfg.resolved_engine
        if engine != "ddp" and acc.num_processes == 1:
            what = f"zero_stage={cfg.zero_stage}" if engine == "zero" else f"engine={engine!r}"
            acc.print(f"[{ctx.stage_dir.name}] {what} ignored: 1 process")
            engine = "ddp"
        self.engine = engine
        self.zero_stage = cfg.zero_stage if engine == "zero" else 0
        self.model: torch.nn.Module
        self.optimizer: Any

        def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
            groups = decay_param_groups(params, cfg.weight_decay)
            return optimizer_over(cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas)

        self.sharded: _ZeroState | _Fsdp2State | None = None
        if engine == "zero":
            from shard_zero import ZeroConfig, prepare

            self.model, self.optimizer = prepare(
                model,
                make_optimizer,
                ZeroConfig(stage=cfg.zero_stage),  # type: ignore[arg-type]
            )
            self.sharded = _ZeroState(self.model, self.optimizer)
        elif engine == "fsdp2":
            self.model = fsdp2_shard(model.to(acc.device))
            self.optimizer = make_optimizer(self.model.parameters())
            self.sharded = _Fsdp2State(self.model, self.optimizer)
        else:
            self.model, self.optimizer = acc.prepare(model, make_optimizer(model.parameters()))

    def no_sync(self) -> Any:
        """A context in which backward accumulates gradients without reducing them."""
        if self.engine == "zero":
            return self.model.no_sync()  # type: ignore[operator]
        if self.engine == "fsdp2":
            return self._fsdp2_no_sync()
        return self.acc.no_sync(self.model)

    @contextlib.contextmanager
    def _fsdp2_no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping (a plain tensor)."""
        if self.engine == "zero":
            norm: torch.Tensor = self.optimizer.clip_grad_norm_(max_norm)
            return norm
        if self.engine == "fsdp2":
            from torch.distributed.tensor import DTensor

            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            return total.full_tensor() if isinstance(total, DTensor) else total
        return self.acc.clip_grad_norm_(self.model.parameters(), max_norm)  # type: ignore[no-any-return]

    def forward_context(self) -> Any:
        """Autocast for a sharded model (accelerate wraps only a prepared model's forward)."""
        return self.acc.autocast() if self.sharded is not None else contextlib.nullcontext()

    @property
    def lockstep(self) -> bool:
        """Whether every process must run as many forward passes as the others.

        FSDP2 gathers each layer's parameters from all processes in every forward.
        """
        return self.engine == "fsdp2"

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict when sharded (a collective), else None."""
        if self.engine == "zero":
            from shard_zero import full_state_dict

            return full_state_dict(self.model)
        if self.engine == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full: dict[str, Any] = get_model_state_dict(self.model, options=options)
            # one entry per parameter: a tied weight arrives under both names, as two copies
            # that `save_pretrained` cannot see are shared, so keep the first name only
            kept = {name for name, _ in self.model.named_parameters()}
            kept |= {name for name, _ in self.model.named_buffers()}
            return {name: tensor for name, tensor in full.items() if name in kept}
        return None

    def model_state_mib(self) -> float | None:
        """Model-state bytes (params, grads, optimizer state) of this process, if sharded."""
        if self.engine == "zero":
            from shard_zero import memory_stats

            return float(memory_stats(self.model, self.optimizer)["total"]) / 2**20
        if self.engine == "fsdp2":
            # an evaluation forward (no backward) leaves the root unit gathered: shard it first
            self.model.reshard()  # type: ignore[operator]
            return _local_bytes(self.model, self.optimizer) / 2**20
        return None

    @property
    def label(self) -> str:
        """`ZeRO-<stage>`, `FSDP2`, `DDP`, or empty with one process (the report's `parallel`)."""
        if self.engine == "zero":
            return f"ZeRO-{self.zero_stage}"
        if self.engine == "fsdp2":
            return "FSDP2"
        return "DDP" if self.acc.num_processes > 1 else ""


def _local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of this process's shards of parameters, gradients and optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [
        local(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return float(sum(t.numel() * t.element_size() for t in tensors))
