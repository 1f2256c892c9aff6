"""`prepare`: shard a model and build its optimizer over the shards."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn
from torch.optim import Optimizer

from shard_zero._config import ZeroConfig
from shard_zero._engine import ZeroEngine, check_group, model_device
from shard_zero._optimizer import ZeroOptimizer

ENGINE_ATTR = "_shard_zero_engine"
M = TypeVar("M", bound=nn.Module)


def prepare(
    model: M,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    config: ZeroConfig | None = None,
    *,
    group: Any = None,
) -> tuple[M, ZeroOptimizer]:
    """Shard `model` over the data-parallel `group` and build its optimizer over the shards.

    The model is modified in place (hooks installed, parameters cast to `config.param_dtype`,
    stage 3 frees the full parameters) and returned; it gains a `no_sync()` context manager.
    Every rank must call this with the same model structure.

    Args:
        model: the model, identical on every rank (same initial values).
        make_optimizer: `make_optimizer(params) -> Optimizer`, called with the fp32 master
            shards (each a block of whole rows; row shards carry `leanlm_row_shard`).
        config: the ZeRO options (default `ZeroConfig()`: stage 2, fp32).
        group: the data-parallel process group (None: the default group).

    Returns:
        `(model, optimizer)`: the same model object and a `ZeroOptimizer` to use as usual.

    Every buffer shard-zero allocates lives on the model's device (CPU with gloo, CUDA with
    NCCL). With `config.timeout` this creates a process group (a collective over the default
    group: every rank must call `prepare`, in the same order).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the model was already prepared, its parameters are on several devices,
            ranks disagree on its parameters, or `config.timeout` is set with a `group`
            smaller than the world.
        TypeError: `make_optimizer` did not return a `torch.optim.Optimizer`.
    """
    check_group(group)
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"`config` must be a ZeroConfig, got {type(config).__name__}")
    if hasattr(model, ENGINE_ATTR):
        raise ValueError("`model` was already prepared by shard-zero; prepare it once")
    model_device(model)  # raises ValueError unless every parameter is on one device
    engine = ZeroEngine(model, config, group)
    masters = [e.master for e in engine.entries]
    optimizer = make_optimizer(masters)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"`make_optimizer` must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    _check_covers(optimizer, masters)
    setattr(model, ENGINE_ATTR, engine)
    model.no_sync = engine.no_sync  # type: ignore[assignment]
    return model, ZeroOptimizer(optimizer, engine)


def _check_covers(optimizer: Optimizer, masters: Iterable[nn.Parameter]) -> None:
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    known = {id(p) for p in masters}
    if not given <= known:
        raise ValueError(
            "`make_optimizer` must build the optimizer over the parameters it is given (the "
            "shards), not over the model's parameters"
        )


def engine_of(model: nn.Module) -> ZeroEngine:
    """The `ZeroEngine` that `prepare` attached to `model`."""
    engine = getattr(model, ENGINE_ATTR, None)
    if not isinstance(engine, ZeroEngine):
        raise ValueError("`model` was not prepared by shard_zero.prepare")
    return engine
