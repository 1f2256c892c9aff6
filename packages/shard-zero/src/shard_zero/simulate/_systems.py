"""The systems the simulator runs: shard-zero stages, FSDP2 and a plain replica (DDP's grads).

Each builder takes a fresh model built under `FakeTensorMode` and returns a `Built`: the model,
its optimizer, how to run one micro-batch without gradient synchronisation, and what the memory
tracker should call masters and gradients.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shard_zero import ZeroConfig, prepare
from shard_zero._api import engine_of

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Built:
    """A model prepared by one system, ready to step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    masters: Sequence[torch.Tensor]
    grads: Callable[[], Iterable[torch.Tensor | None]]
    sync: Callable[[bool], contextlib.AbstractContextManager[None]]
    extra: dict[str, Any] = field(default_factory=dict)
    host: Callable[[], list[torch.Tensor]] = list  # buffers in host memory (not on the device)
    host_optimizer: torch.optim.Optimizer | None = None  # an optimizer that steps on the host


def make_optimizer(
    name: str | OptimizerFactory, *, foreach: bool, kwargs: Mapping[str, Any] | None = None
) -> OptimizerFactory:
    """The optimizer factory for `name`: `adamw`, a `module:Class` spec, or a given factory.

    `adamw` is `torch.optim.AdamW(lr=1e-4, weight_decay=0.1, foreach=foreach)`. A spec such as
    `optim_came:CAME` or `optim_adafactor:Adafactor` imports `Class` from `module` and builds it
    as `Class(params, **kwargs)` (default kwargs: `lr=1e-4`); shard-zero depends on no optimizer
    package, the spec names one that is installed. A spec that does not resolve raises
    `ValueError`.
    """
    if callable(name):
        return name
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=foreach)
    module_name, sep, class_name = name.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"`optimizer` ({name!r}) must be 'adamw', a 'module:Class' spec (e.g. "
            "'optim_came:CAME') or a callable"
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"`optimizer` ({name!r}): cannot import {class_name!r} from {module_name!r} ({exc})"
        ) from exc
    options = dict(kwargs) if kwargs is not None else {"lr": 1e-4}
    return lambda ps: _real_mode(lambda: cls(ps, **options))


def optimizer_name(name: str | OptimizerFactory) -> str:
    """A short lower-case name: `adamw`, the class of a `module:Class` spec, or `custom`."""
    if callable(name):
        return "custom"
    return name.rpartition(":")[2].lower()


def _real_mode(make: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """Build an optimizer outside fake mode; its steps then run on fake tensors.

    Some constructors read tensor values on the host (optim-adafactor draws a random seed with
    `.item()`), which fake tensors refuse.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return make()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The children of every `nn.ModuleList` (a Hugging Face model's decoder layers)."""
    return [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]


def build_shard_zero(
    model: nn.Module,
    *,
    stage: int,
    param_dtype: torch.dtype,
    optimizer: OptimizerFactory,
    accum_dtype: torch.dtype | None = None,
    offload_accum: bool = False,
    offload_optimizer: bool = False,
    bucket_numel: int | None = None,
) -> Built:
    """shard-zero at `stage` (consistency check off: no host reads on fake tensors)."""
    config = ZeroConfig(
        stage=stage,  # type: ignore[arg-type]
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        accum_dtype=accum_dtype,
        offload_accum=offload_accum,
        offload_optimizer=offload_optimizer,
        check_consistency=False,
        bucket_numel=ZeroConfig.bucket_numel if bucket_numel is None else bucket_numel,
    )
    model, opt = prepare(model, optimizer, config)
    engine = engine_of(model)
    params = {id(p.untyped_storage()) for p in model.parameters()}
    masters = [e.master for e in engine.entries if id(e.master.untyped_storage()) not in params]
    if offload_optimizer:
        masters = []  # host memory: labelled `host`

    def grads() -> Iterator[torch.Tensor | None]:
        for e in engine.entries:
            yield e.master.grad
            yield e.param.grad
            yield e.acc
            yield e.low_acc
            yield e.dev_grad

    def sync(on: bool) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if on else engine.no_sync()

    extra = {
        "unit_bytes": [u.nbytes for u in engine.units],  # the root unit first
        "bucket_numel": config.bucket_numel,
    }

    def host() -> list[torch.Tensor]:
        out = [e.host_acc for e in engine.entries if e.host_acc is not None]
        if offload_optimizer:
            out += [e.master for e in engine.entries]
            out += [t for e in engine.entries for t in (e.host_grad, e.host_rows) if t is not None]
            for state in opt.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    inner = opt.optimizer if offload_optimizer else None
    return Built(model, opt, masters, grads, sync, extra, host, inner)


def build_fsdp2(
    model: nn.Module,
    *,
    mesh: Any,
    reshard: bool,
    param_dtype: torch.dtype,
    optimizer: OptimizerFactory,
) -> Built:
    """FSDP2: `fully_shard` per decoder layer and the root, `MixedPrecisionPolicy(p, fp32)`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=torch.float32,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    opt = optimizer(list(model.parameters()))
    masters = list(model.parameters())  # the sharded parameters (DTensors)

    def grads() -> Iterator[torch.Tensor | None]:
        for p in model.parameters():
            yield p.grad

    @contextlib.contextmanager
    def sync(on: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(on)  # type: ignore[operator]
        yield

    return Built(model, opt, masters, grads, sync)


def build_replica(model: nn.Module, *, param_dtype: torch.dtype) -> Built:
    """A plain replica in the compute dtype: forward and backward only (DDP's gradients)."""
    model.to(param_dtype)

    def grads() -> Iterator[torch.Tensor | None]:
        for p in model.parameters():
            yield p.grad

    return Built(model, None, [], grads, lambda on: contextlib.nullcontext())
