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
    """How `prepare` shards a model and its optimizer.

    Attributes:
        stage: 1 shards optimizer state (and fp32 master weights); 2 also shards gradients
            (reduce-scattered during backward); 3 also shards parameters at rest (gathered per
            wrapping unit in forward and backward, freed after use).
        param_dtype: dtype of the compute parameters the model runs with (e.g. `torch.bfloat16`
            for mixed precision), applied to every floating-point parameter, frozen ones
            included (buffers keep theirs). None keeps the model's dtype. Master weights,
            gradient accumulation and optimizer inputs are always fp32. `torch.float16` raises
            `ValueError`: fp16 gradients need a loss scaler, which shard-zero does not have.
        reduce_dtype: dtype gradients are communicated in: `torch.float32` (None, the default:
            4 bytes per element of every reduce-scatter and all-reduce) or `torch.bfloat16`
            (2 bytes: half the gradient traffic; the fp32 accumulators are rounded to bf16
            before the sum, and the sum over ranks is done in bf16). `torch.float16` raises
            `ValueError` (overflow above 65504 and underflow without a loss scaler).
        accum_dtype: stages 2-3: dtype of the sharded gradient accumulator that holds the
            reduced gradients between backwards (`no_sync()` micro-batches). `torch.float32`
            (None, the default: 4 bytes per local element) or `torch.bfloat16` (2 bytes: half
            the accumulator, as DeepSpeed's `grad_accum_dtype`; each backward's reduced
            gradient is rounded to bf16 when it is added, so even one micro-batch's gradient
            carries bf16 rounding). The accumulator is cast to the fp32 master gradients at the
            end of the first backward outside `no_sync()` (or by `step()` /
            `clip_grad_norm_()`), when activations are gone; the optimizer always reads fp32.
            Stage 1 accumulates in `param.grad` (the compute dtype, as DDP) and rejects it.
        offload_accum: stages 2-3: keep the sharded gradient accumulator in host memory
            (pinned when the model is on CUDA) between backwards run under `no_sync()`, so
            that accumulating micro-batches costs no accelerator memory. Each such backward's
            reduced gradient rows are copied to the host as their reduce-scatter completes
            (the first micro-batch) or read back, added on the device and copied back (later
            ones), and read once more at the boundary: k - 1 buffer sizes each way for k
            micro-batches (4 bytes per local element, 2 with `accum_dtype=torch.bfloat16`),
            asynchronous copies on the current stream, without a host sync. The
            backward outside `no_sync()` accumulates on the device as without offload, and
            the host part is added into the fp32 master gradients at its end (or by `step()`
            / `clip_grad_norm_()`). One host buffer per sharded parameter (this rank's rows,
            `accum_dtype`) is allocated at the first backward under `no_sync()` and kept.
            Stage 1 rejects it (it accumulates full gradients in `param.grad`).
        offload_optimizer: ZeRO-Offload (stages 1-3): keep the fp32 master shards, their
            gradients and the optimizer's state in host memory (pinned when the model is on
            CUDA; on a CPU model, separate CPU tensors) and step the wrapped optimizer there, on
            the CPU. `make_optimizer` gets the host masters, so any optimizer that runs on CPU
            tensors works (torch's AdamW, optim-came / optim-adafactor's PyTorch paths).
            Reduction is unchanged on the device; in the backward outside `no_sync()` each
            parameter's reduced gradient rows are copied to the host as soon as its last
            bucket's reduce-scatter completes (asynchronous copies on the current stream on
            CUDA), and `step()` waits for them, steps on the host, then copies the updated
            rows to the device in the compute dtype (cast on the host) for the parameter
            all-gathers. The device keeps only the compute parameters and the gradient
            accumulator until the boundary backward: no fp32 masters, no optimizer state.
            On a model on CUDA with a non-gloo group, row-sharded optimizers (Adafactor, CAME)
            all-reduce their host statistics over a gloo group over the same ranks that
            `prepare` creates (a collective; a `group` smaller than the world raises
            `ValueError`).
        min_shard_numel: parameters with fewer elements than this (and 0-dim ones) are not
            sharded: every rank keeps and steps a full replica, with gradients all-reduced.
        bucket_numel: most elements of one flat gradient or parameter communication buffer,
            over all ranks (the reduce-scatter input / all-gather output of stages 1-2; at
            stage 3 each unit's gradients are reduced in buckets of this size, in backward
            order, while its parameters are gathered in one buffer). A parameter larger than
            that travels in pieces of whole rows. The default (2**24: 64 MiB of fp32
            gradients) keeps each call large enough for NCCL's bandwidth while bounding the
            reduce-scatter inputs in flight; Llama-3-70B on 64 ranks then takes 4286
            reduce-scatters per step (simulated; FSDP2 81), and 2**28 takes 328 for a 1.041x
            higher stage-3 peak (benchmarks/RESULTS.md, run 4).
        wrap_policy: stage 3 only: `policy(name, module) -> bool` marks the modules whose
            parameters are gathered and freed together. None wraps every child of every
            `nn.ModuleList` (the decoder layers of a Hugging Face model). Parameters outside
            every unit belong to the root unit, gathered once per step.
        prefetch: stage 3 only: start gathering the next unit (forward) / previous unit
            (backward) while the current one computes.
        timeout: how long a shard-zero collective may wait for the other ranks before it fails
            (a `datetime.timedelta`, or seconds as a number). None uses the process group's own
            timeout (torch's defaults: 30 min for gloo, 10 min for NCCL). When set, `prepare`
            creates a process group over the same ranks and backend with this timeout (a
            collective: every rank of the default group must call `prepare` with the same
            config) and runs every shard-zero collective on it.
        check_consistency: detect ranks that diverge (a rank that skips a wrapped unit or runs
            a different number of forward/backward passes) and raise a `RuntimeError` naming the
            likely cause instead of exchanging mismatched data. Each all-gather carries a 16-byte
            tag per rank, and `step()` adds one 16-byte broadcast (on GPU it also reads the tags
            back to the host once per step).
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
