"""`prepare`: shard a model and build its optimizer over the shards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from shard_zero._config import ZeroConfig
from shard_zero._deferred import fill, is_deferred, make_placeholders
from shard_zero._engine import ZeroEngine, check_group
from shard_zero._generate import install as install_generate
from shard_zero._optimizer import ZeroOptimizer
from shard_zero._shards import model_device

ENGINE_ATTR = "_shard_zero_engine"
M = TypeVar("M", bound=nn.Module)


def prepare(
    model: M,
    make_optimizer: Callable[[list[nn.Parameter]], Optimizer],
    config: ZeroConfig | None = None,
    *,
    group: Any = None,
    init: Callable[[nn.Module], Any] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> tuple[M, ZeroOptimizer]:
    """Shard `model` over the data-parallel `group` and build its optimizer over the shards.

    The model is modified in place (hooks installed, parameters cast to `config.param_dtype`,
    stage 3 frees the full parameters) and returned; it gains a `no_sync()` context manager,
    and its `zero_grad()` also clears the gradients the optimizer steps (as
    `optimizer.zero_grad()` does). At stage 3 over more than one rank, the `generate` of a
    Hugging Face model (and of its submodules that have one) defaults to `synced_gpus=True`:
    a rank whose sequences finish first keeps running forwards until every rank's have.
    Every rank must call this with the same model structure.

    Args:
        model: the model, identical on every rank (same initial values).
        make_optimizer: `make_optimizer(params) -> Optimizer`, called with the fp32 master
            shards (each a block of whole rows; row shards carry `leanlm_row_shard`). It runs
            with rank 0's CPU random stream on every rank (what it draws is alike).
        config: the ZeRO options (default `ZeroConfig()`: stage 2, fp32).
        group: the data-parallel process group (None: the default group).
        init: deferred initialisation of a model built on the `meta` device: called as
            `init(module)` on every module in `model.apply` order, with that module's own
            parameters and buffers materialised on `device`; only this rank's rows are kept.
            Same seed, same values as `model.apply(init)` on a model built normally. With
            `checkpoint`, it only initialises buffers the checkpoint lacks.
        checkpoint: deferred initialisation from a Hugging Face checkpoint folder
            (`model.safetensors` or `model.safetensors.index.json`, tensor names = the model's
            parameter names): each rank reads only its rows of every sharded parameter.
        device: where a `meta` model is materialised (required with `init` / `checkpoint`).

    Returns:
        `(model, optimizer)`: the same model object and a `ZeroOptimizer` to use as usual.

    Every buffer shard-zero allocates lives on the model's device (CPU with gloo, CUDA with
    NCCL). With `config.timeout` this creates a process group (a collective over the default
    group: every rank must call `prepare`, in the same order).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the model was already prepared, its parameters are on several devices,
            ranks disagree on its parameters, `config.timeout` is set with a `group`
            smaller than the world, or `init` / `checkpoint` / `device` do not match whether
            the model is on the meta device.
        TypeError: `make_optimizer` did not return a `torch.optim.Optimizer`.
    """
    check_group(group)
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"`config` must be a ZeroConfig, got {type(config).__name__}")
    if hasattr(model, ENGINE_ATTR):
        raise ValueError("`model` was already prepared by shard-zero; prepare it once")
    deferred = is_deferred(model)
    _check_deferred(deferred, init, checkpoint, device)
    if deferred:
        dtypes = make_placeholders(
            model,
            device=torch.device(device),  # type: ignore[arg-type]
            stage=config.stage,
            param_dtype=config.param_dtype,
        )
    model_device(model)  # raises ValueError unless every parameter is on one device
    _cast_frozen(model, config.param_dtype)
    engine = ZeroEngine(model, config, group)
    if deferred:
        fill(model, engine, dtypes, init=init, checkpoint=checkpoint)
    masters = [e.master for e in engine.entries]
    with engine.rank0_random():  # what it draws is alike on every rank
        optimizer = make_optimizer(masters)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"`make_optimizer` must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    _check_covers(optimizer, masters)
    engine.comm.clear_counts()  # the first step's counts are its own, not `prepare`'s checks
    setattr(model, ENGINE_ATTR, engine)
    model.no_sync = engine.no_sync  # type: ignore[assignment]
    model.zero_grad = engine.model_zero_grad  # type: ignore[method-assign]
    if engine.stage == 3:  # every forward gathers with the other ranks
        install_generate(model, engine.group, engine.world, engine.device)
    return model, ZeroOptimizer(optimizer, engine)


def _check_deferred(
    deferred: bool, init: Any, checkpoint: Any, device: torch.device | str | None
) -> None:
    if deferred:
        if init is None and checkpoint is None:
            raise ValueError(
                "`model` has tensors on the meta device: pass `init` (an init function) or "
                "`checkpoint` (a Hugging Face safetensors folder) to materialise its shards"
            )
        if device is None:
            raise ValueError("`device` is required for a model on the meta device")
        if init is not None and not callable(init):
            raise TypeError(f"`init` must be callable, got {init!r}")
    else:
        for name, value in (("init", init), ("checkpoint", checkpoint), ("device", device)):
            if value is not None:
                raise ValueError(
                    f"`{name}` is only for a model built on the meta device; this model is "
                    "already materialised (move it with `model.to(device)`)"
                )


def _cast_frozen(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast frozen floating-point parameters to `param_dtype` (trainable ones: the engine)."""
    if dtype is None:
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


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
