"""How a training stage's model and optimizer are spread over processes (`engine`).

- `"ddp"`: accelerate's DDP replicates them (and the only choice with one process).
- `"zero"`: shard-zero shards optimizer state (`zero_stage` 1), + gradients (2), + parameters (3)
  as row-sharded fp32 masters, exact for CAME and Adafactor.
- `"fsdp2"`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) shards parameters and
  gradients as `DTensor`s (dim 0), and so the optimizer state: each decoder layer (the model's
  `_no_split_modules`) is one unit, gathered for its forward and backward, and the root holds
  the rest (embeddings, final norm, head). Its checkpoints are `torch.distributed.checkpoint`
  folders (one file per process), reshardable: they load at any number of processes. CAME and
  Adafactor step each shard's rows with their row statistics and keep that state as plain local
  tensors; it is saved as `DTensor`s over the parameters' mesh (`_Fsdp2State`).

The training loop (`leanlm.train.trainer`) calls the same methods whichever engine runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from leanlm.config import TrainConfig
from leanlm.stages.base import StageContext
from leanlm.train.optim import decay_param_groups, optimizer_over


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

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face model (the classes named in `_no_split_modules`)."""
    layer_types = {
        name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()
    }
    return [m for m in model.modules() if type(m).__name__ in layer_types]


def compile_layers(model: torch.nn.Module) -> int:
    """`torch.compile` each decoder layer's `forward` in place; returns how many were compiled.

    Per block, before any engine wraps or shards the model, as torchtitan does (its
    `apply_compile` in `torchtitan/models/llama3/parallelize.py`). Only `forward` is compiled,
    not the module's `__call__`: the hooks an engine registers on a layer (FSDP2's and
    shard-zero's gathers, DDP's) run outside the compiled code, and parameter names (state
    dicts, checkpoints, `save_pretrained`) stay as they are. Every layer runs the same code, so
    the layers share one compiled graph.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)


class Parallel:
    """What differs between the engines in the training loop."""

    def __init__(self, ctx: StageContext, model: torch.nn.Module, cfg: TrainConfig) -> None:
        acc = ctx.accelerator
        self.acc = acc
        engine = configured = cfg.resolved_engine
        if engine != "ddp" and acc.num_processes == 1:
            what = f"zero_stage={cfg.zero_stage}" if engine == "zero" else f"engine={engine!r}"
            acc.print(
                f"[{ctx.stage_dir.name}] {what}: 1 process runs unsharded (its checkpoints keep "
                "the engine's format)"
            )
            engine = "ddp"
        self.engine = engine
        self.zero_stage = cfg.zero_stage if engine == "zero" else 0
        if cfg.activation_checkpointing:
            from leanlm.train.model import enable_activation_checkpointing

            enable_activation_checkpointing(model)
        self.model: torch.nn.Module
        self.optimizer: Any

        def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
            groups = decay_param_groups(params, cfg.weight_decay)
            return optimizer_over(
                cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas, state_dtype=cfg.state_dtype
            )

        if cfg.compile:
            layers = compile_layers(model)
            acc.print(f"[{ctx.stage_dir.name}] compile: torch.compile of {layers} decoder layers")
        self.sharded: _ZeroState | _Fsdp2State | None = None
        if engine == "zero":
            from shard_zero import ZeroConfig, prepare

            config = ZeroConfig(
                stage=cfg.zero_stage,  # type: ignore[arg-type]
                accum_dtype=torch.bfloat16 if cfg.zero_accum_dtype == "bf16" else None,
                offload_accum=cfg.zero_offload_accum,
                offload_optimizer=cfg.zero_offload_optimizer,
            )
            self.model, self.optimizer = prepare(model, make_optimizer, config)
            self.sharded = _ZeroState(self.model, self.optimizer)
        elif engine == "fsdp2":
            self.model = fsdp2_shard(model.to(acc.device))
            self.optimizer = make_optimizer(self.model.parameters())
            self.sharded = _Fsdp2State(self.model, self.optimizer)
        else:
            self.model, self.optimizer = acc.prepare(model, make_optimizer(model.parameters()))
        # One process runs unsharded, but its checkpoints keep the configured engine's format,
        # written from (and read into) the whole model and optimizer: shard-zero's checkpoints
        # and DCP need no process group, and reshard when a later run has several processes.
        self.whole: _ZeroState | _Fsdp2State | None = None
        if configured != engine:
            plain = acc.unwrap_model(self.model)
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
            state = _ZeroState if configured == "zero" else _Fsdp2State
            self.whole = state(plain, inner)

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
