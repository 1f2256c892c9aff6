"""How a training stage's model and optimizer are spread over processes (`engine`).

Each engine is a small `Engine` class (`ENGINES` by name): how it wraps the model and optimizer,
skips the gradient reduction, clips, gathers the final weights, counts its memory, and its
checkpoint format. `"ddp"` (accelerate's DDP) replicates everything; `"zero"` (shard-zero) shards
optimizer state, gradients and parameters by `zero_stage`; `"fsdp2"` (`fully_shard`) shards
parameters, gradients and so the optimizer state as `DTensor`s. The training loop
(`leanlm.train.trainer`) calls `Parallel`, the same whichever runs.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from leanlm.config import TrainConfig
from leanlm.stages.base import StageContext
from leanlm.train.optim import decay_param_groups, optimizer_over
from leanlm.train.sharded_state import Fsdp2State, ZeroState

if TYPE_CHECKING:
    from accelerate import Accelerator

MakeOptimizer = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
"""Builds the stage's optimizer over the parameters (or shards) it is given."""


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


class Engine(abc.ABC):
    """One way of spreading the model and optimizer over processes; `ENGINES` names each.

    `wrap` wraps or shards them; the training loop then reaches them only through these
    methods (by way of `Parallel`).
    """

    state: ClassVar[type[Any] | None] = None
    """Its checkpoint format (`save(path)` / `load(path)` of the model and optimizer), or None:
    accelerate's, saved with the trainer's state."""
    lockstep: ClassVar[bool] = False
    """Whether every process must run as many forward passes as the others."""

    def __init__(self, acc: Accelerator, cfg: TrainConfig) -> None:
        self.acc, self.cfg = acc, cfg
        self.model: torch.nn.Module
        self.optimizer: Any

    @abc.abstractmethod
    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> None:
        """Wrap (or shard) `model` and build its optimizer: sets `model` and `optimizer`."""

    @abc.abstractmethod
    def no_sync(self) -> Any:
        """A context in which backward accumulates gradients without reducing them."""

    @abc.abstractmethod
    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping (a plain tensor)."""

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict when sharded (a collective), else None."""
        return None

    def model_state_mib(self) -> float | None:
        """Model-state MiB (params, grads, optimizer state, device and host) if sharded."""
        return None

    def host_state_mib(self) -> float | None:
        """The part of `model_state_mib` in host memory (ZeRO-Offload), else None."""
        return None

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """The report's `parallel` column."""


class DdpEngine(Engine):
    """accelerate's DDP: every process holds the whole model and optimizer.

    The only choice with one process.
    """

    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> None:
        """Wrap (or shard) the model and build its optimizer."""
        self.model, self.optimizer = self.acc.prepare(model, make_optimizer(model.parameters()))

    def no_sync(self) -> Any:
        """Backward without the gradient reduction."""
        return self.acc.no_sync(self.model)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; the norm before clipping."""
        return self.acc.clip_grad_norm_(self.model.parameters(), max_norm)  # type: ignore[no-any-return]

    @property
    def label(self) -> str:
        """The report's `parallel` column."""
        return "DDP" if self.acc.num_processes > 1 else ""


class ZeroEngine(Engine):
    """shard-zero at `zero_stage`: optimizer state (1), + gradients (2), + parameters (3).

    Parameters are row-sharded fp32 masters, so CAME and Adafactor stay exact.
    """

    state = ZeroState

    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> None:
        """Wrap (or shard) the model and build its optimizer."""
        from shard_zero import ZeroConfig, prepare

        cfg = self.cfg
        config = ZeroConfig(
            stage=cfg.zero_stage,  # type: ignore[arg-type]
            accum_dtype=torch.bfloat16 if cfg.zero_accum_dtype == "bf16" else None,
            offload_accum=cfg.zero_offload_accum,
            offload_optimizer=cfg.zero_offload_optimizer,
        )
        self.model, self.optimizer = prepare(model, make_optimizer, config)

    def no_sync(self) -> Any:
        """Backward without the gradient reduction."""
        return self.model.no_sync()  # type: ignore[operator]

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; the norm before clipping."""
        norm: torch.Tensor = self.optimizer.clip_grad_norm_(max_norm)
        return norm

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict (a collective)."""
        from shard_zero import full_state_dict

        return full_state_dict(self.model)

    def model_state_mib(self) -> float | None:
        """This process's model-state MiB, device and host (`zero_offload_*`) together."""
        from shard_zero import memory_stats

        stats = memory_stats(self.model, self.optimizer)
        return float(stats["total"] + stats["host_total"]) / 2**20

    def host_state_mib(self) -> float | None:
        """The host part of `model_state_mib` (`zero_offload_optimizer`/`_accum`), else None."""
        from shard_zero import memory_stats

        host = memory_stats(self.model, self.optimizer)["host_total"]
        return float(host) / 2**20 if host else None

    @property
    def label(self) -> str:
        """The report's `parallel` column."""
        return f"ZeRO-{self.cfg.zero_stage}"


class Fsdp2Engine(Engine):
    """PyTorch's FSDP2: each decoder layer one `fully_shard` unit, the root the rest.

    Parameters and gradients are `DTensor`s sharded on dim 0; each layer (the model's
    `_no_split_modules`) is gathered for its forward and backward, the root holds embeddings,
    final norm and head. CAME and Adafactor step each shard's rows and keep plain local state,
    saved as `DTensor`s over the mesh (`sharded_state.Fsdp2State`) in a reshardable
    `torch.distributed.checkpoint` folder (loads at any number of processes).
    """

    state = Fsdp2State
    lockstep = True  # every forward gathers each layer's parameters from all processes

    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> None:
        """Wrap (or shard) the model and build its optimizer."""
        self.model = fsdp2_shard(model.to(self.acc.device))
        self.optimizer = make_optimizer(self.model.parameters())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward without the gradient reduction."""
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; the norm before clipping."""
        from torch.distributed.tensor import DTensor

        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return total.full_tensor() if isinstance(total, DTensor) else total

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict (a collective)."""
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

    def model_state_mib(self) -> float | None:
        """This process's model-state MiB."""
        # an evaluation forward (no backward) leaves the root unit gathered: shard it first
        self.model.reshard()  # type: ignore[operator]
        return _local_bytes(self.model, self.optimizer) / 2**20

    @property
    def label(self) -> str:
        """The report's `parallel` column."""
        return "FSDP2"


ENGINES: dict[str, type[Engine]] = {"ddp": DdpEngine, "zero": ZeroEngine, "fsdp2": Fsdp2Engine}
"""The engines by their `engine` name (`TrainConfig.engine`)."""


class Parallel:
    """The engine a training stage runs, set up as its config says (`ENGINES`)."""

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
        self.engine = ENGINES[engine](acc, cfg)
        if cfg.activation_checkpointing:
            from leanlm.train.model import enable_activation_checkpointing

            enable_activation_checkpointing(model)

        def make_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
            groups = decay_param_groups(params, cfg.weight_decay)
            return optimizer_over(
                cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas, state_dtype=cfg.state_dtype
            )

        if cfg.compile:
            layers = compile_layers(model)
            acc.print(f"[{ctx.stage_dir.name}] compile: torch.compile of {layers} decoder layers")
        self.engine.wrap(model, make_optimizer)
        self.model, self.optimizer = self.engine.model, self.engine.optimizer
        state = self.engine.state
        self.sharded: Any = state(self.model, self.optimizer) if state is not None else None
        # One process runs unsharded, but its checkpoints keep the configured engine's format,
        # written from (and read into) the whole model and optimizer: shard-zero's checkpoints
        # and DCP need no process group, and reshard when a later run has several processes.
        self.whole: Any = None
        whole_state = ENGINES[configured].state
        if configured != engine and whole_state is not None:
            plain = acc.unwrap_model(self.model)
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
            self.whole = whole_state(plain, inner)

    def no_sync(self) -> Any:
        """A context in which backward accumulates gradients without reducing them."""
        return self.engine.no_sync()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping (a plain tensor)."""
        return self.engine.clip(max_norm)

    def forward_context(self) -> Any:
        """Autocast for a sharded model (accelerate wraps only a prepared model's forward)."""
        return self.acc.autocast() if self.sharded is not None else contextlib.nullcontext()

    @property
    def lockstep(self) -> bool:
        """Whether every process must run as many forward passes as the others."""
        return self.engine.lockstep

    def final_state(self) -> dict[str, torch.Tensor] | None:
        """The full fp32 state dict when sharded (a collective), else None."""
        return self.engine.final_state()

    def model_state_mib(self) -> float | None:
        """Model-state MiB (params, grads, optimizer state) of this process, if sharded."""
        return self.engine.model_state_mib()

    def host_state_mib(self) -> float | None:
        """The part of `model_state_mib` in host memory, if any."""
        return self.engine.host_state_mib()

    @property
    def label(self) -> str:
        """`ZeRO-<stage>`, `FSDP2`, `DDP`, or empty with one process (the report's `parallel`)."""
        return self.engine.label


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
