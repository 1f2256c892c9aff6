"""`ZeroConfig`: what to shard, in which dtypes, and how to bucket communication."""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How `prepare` shards a model and its optimizer (the README's "How it works" has the detail).

    Attributes:
        stage: 1 shards optimizer state (and fp32 master weights); 2 also shards gradients
            (reduce-scattered during backward); 3 also shards parameters at rest (gathered per
            wrapping unit in forward and backward, freed after use).
        param_dtype: dtype the model computes in (e.g. `torch.bfloat16`), applied to every
            floating-point parameter, frozen ones included (buffers keep theirs); None keeps the
            model's. Masters, gradient accumulation and optimizer inputs stay fp32. fp16 raises
            `ValueError`: its gradients need a loss scaler, which shard-zero does not have.
        reduce_dtype: dtype gradients travel and are summed over ranks in: fp32 (None) or
            `torch.bfloat16` (half the gradient traffic, rounded before the sum). fp16 raises.
        accum_dtype: stages 2-3: dtype of the sharded gradient accumulator kept between
            backwards: fp32 (None) or `torch.bfloat16` (half its bytes, as DeepSpeed's
            `grad_accum_dtype`; every reduced gradient is rounded when added). It is added into
            the fp32 master gradients at the accumulation boundary, so the optimizer reads fp32.
            Stage 1 (which accumulates in `param.grad`, as DDP) raises `ValueError` for bf16.
        offload_accum: stages 2-3: keep that accumulator in host memory between backwards run
            under `no_sync()`, so accumulating micro-batches costs no accelerator memory
            (asynchronous copies, k - 1 buffer sizes each way for k micro-batches). Stage 1
            raises `ValueError` for it.
        offload_optimizer: ZeRO-Offload (stages 1-3): the fp32 masters, their gradients and the
            optimizer state live in host memory and the wrapped optimizer steps there, so the
            device holds no masters and no state. `make_optimizer` gets the host masters: any
            optimizer that runs on CPU tensors works. See the README's "ZeRO-Offload".
        min_shard_numel: parameters with fewer elements than this (and 0-dim ones) are not
            sharded: every rank keeps and steps a full replica, with gradients all-reduced.
        bucket_numel: most elements of one flat gradient or parameter communication buffer over
            all ranks (stage 3: of each unit's gradient buckets); a larger parameter travels in
            pieces of whole rows. The default, 2**24 (64 MiB of fp32 gradients), keeps each call
            large for NCCL's bandwidth while bounding the reduce-scatter inputs in flight
            (simulated call counts: `benchmarks/RESULTS.md`).
        wrap_policy: stage 3 only: `policy(name, module) -> bool` marks the modules whose
            parameters are gathered and freed together. None wraps every child of every
            `nn.ModuleList` (the decoder layers of a Hugging Face model). Parameters outside
            every unit belong to the root unit, gathered once per step.
        prefetch: stage 3 only: start gathering the next unit (forward) / previous unit
            (backward) while the current one computes.
        timeout: how long a shard-zero collective may wait for the other ranks (a
            `datetime.timedelta`, or seconds). None keeps the process group's own timeout. When
            set, `prepare` creates a process group over the same ranks with it (a collective).
        check_consistency: detect ranks that diverge (a skipped unit, an extra forward or
            backward) and raise a `RuntimeError` naming the likely cause instead of exchanging
            mismatched data: a 16-byte tag per rank on each all-gather and one 16-byte broadcast
            per `step()`.
    """

    stage: Literal[1, 2, 3] = 2
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    accum_dtype: torch.dtype | None = None
    offload_accum: bool = False
    offload_optimizer: bool = False
    min_shard_numel: int = 16384
    bucket_numel: int = 2**24
    wrap_policy: Callable[[str, nn.Module], bool] | None = None
    prefetch: bool = True
    timeout: datetime.timedelta | float | None = None
    check_consistency: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            raise ValueError(f"`stage` ({self.stage!r}) must be 1, 2 or 3")
        for name in ("param_dtype", "reduce_dtype", "accum_dtype"):
            value = getattr(self, name)
            if value == torch.float16:
                raise ValueError(
                    f"`{name}` (torch.float16) is not supported: fp16 gradients need dynamic "
                    "loss scaling, which shard-zero does not implement; use torch.bfloat16 "
                    "(same memory and traffic, no scaler needed)"
                )
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"`{name}` ({value!r}) must be None, torch.float32 or torch.bfloat16"
                )
        if self.stage == 1 and self.accum_dtype not in (None, torch.float32):
            raise ValueError(
                f"`accum_dtype` ({self.accum_dtype!r}) applies to stages 2-3 only: stage 1 "
                "accumulates in `param.grad`, in the compute dtype (`param_dtype`), as DDP does"
            )
        if self.stage == 1 and self.offload_accum is True:
            raise ValueError(
                "`offload_accum` (True) applies to stages 2-3 only: stage 1 accumulates full "
                "gradients in `param.grad`, as DDP does"
            )
        for name in ("min_shard_numel", "bucket_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"`{name}` must be an int, got {value!r}")
        if self.min_shard_numel < 0:
            raise ValueError(f"`min_shard_numel` ({self.min_shard_numel}) must be >= 0")
        if self.bucket_numel < 1:
            raise ValueError(f"`bucket_numel` ({self.bucket_numel}) must be >= 1")
        if self.wrap_policy is not None and not callable(self.wrap_policy):
            raise TypeError(f"`wrap_policy` must be callable or None, got {self.wrap_policy!r}")
        for name in ("prefetch", "check_consistency", "offload_accum", "offload_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        if self.timeout is not None:
            seconds = timeout_seconds(self.timeout)
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(
                    f"`timeout` ({self.timeout!r}) must be > 0 seconds and finite, or None for "
                    "the process group's own timeout"
                )

    @property
    def timeout_delta(self) -> datetime.timedelta | None:
        """`timeout` as a `datetime.timedelta` (None when unset)."""
        if self.timeout is None:
            return None
        return datetime.timedelta(seconds=timeout_seconds(self.timeout))


def timeout_seconds(timeout: object) -> float:
    """Seconds in a `timeout` value (a `datetime.timedelta` or a real number); TypeError else."""
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"`timeout` must be a datetime.timedelta, a number of seconds or None, got {timeout!r}"
        )
    return float(timeout)
