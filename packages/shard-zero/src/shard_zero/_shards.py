"""The shards of one model: each trainable parameter's fp32 master rows on this rank (`Entry`).

`Shards` is the state the gradient reducer (`_reduce`), the stage-3 units (`_units`) and the
engine (`_engine`) share; it imports none of them, so imports point one way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shard_zero._comm import Comm, host_group, host_readable
from shard_zero._config import ZeroConfig
from shard_zero._layout import Entry, RowShardInfo, row_split

ROW_SHARD_ATTR = "leanlm_row_shard"
_FINGERPRINT = 500_001  # collective ident of the model fingerprint check
_RANDOM_STATE = 500_003  # collective ident of rank 0's random state (`rank0_random`)


class Shards:
    """This rank's fp32 master rows of every trainable parameter, and where they communicate."""

    def __init__(self, model: nn.Module, config: ZeroConfig, group: Any) -> None:
        self.model = model
        self.config = config
        self.device = model_device(model)
        self.comm = Comm(
            group,
            device=self.device,
            timeout=config.timeout_delta,
            check=config.check_consistency,
        )
        # every collective (also the row-shard declaration's and the checkpoints' barriers) runs
        # on `comm.group`: the caller's group, or a copy of it with `config.timeout`
        self.group = self.comm.group
        self.world = self.comm.world_size
        self.rank = self.comm.rank
        self.stage = config.stage
        self.reduce_dtype = config.reduce_dtype or torch.float32
        self.accum_dtype = config.accum_dtype or torch.float32
        self.offload_accum = config.offload_accum
        # ZeRO-Offload: masters, their gradients and the optimizer state in host memory
        self.offload = config.offload_optimizer
        self.pinned = self.device.type == "cuda"  # host buffers: pinned for async copies
        # offload on CUDA: the gradients' copies to the host run here, beside backward's kernels
        self.copy_stream: torch.cuda.Stream | None = None
        if self.offload and self.pinned:
            self.copy_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.host_group = (
            host_group(self.group, self.device, config.timeout_delta) if self.offload else None
        )
        self.sync = True  # False inside `no_sync()`
        self._check_same_model(model)

        self.entries: list[Entry] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.entries.append(self._make_entry(name, p))
        self.by_param: dict[torch.Tensor, Entry] = {e.param: e for e in self.entries}
        self.sharded = [e for e in self.entries if e.sharded]
        self.replicated = [e for e in self.entries if not e.sharded]

    def _check_same_model(self, model: nn.Module) -> None:
        """Raise (instead of hanging later) if ranks hold different trainable parameter sets."""
        desc = "|".join(
            f"{n}:{tuple(p.shape)}:{p.requires_grad}" for n, p in model.named_parameters()
        )
        digest = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:7], "little")
        mine = torch.tensor([digest], dtype=torch.int64, device=self.device)
        if not host_readable(mine) or self.world == 1:
            return  # fake tensors (the scale simulator): no values; world 1: nothing to compare
        every = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self.comm.names[_FINGERPRINT] = "the model fingerprint check in `prepare`"
        self.comm.wait(self.comm.all_gather(every, mine, ident=_FINGERPRINT), _FINGERPRINT)
        if bool((every != mine).any()):
            raise ValueError(
                "ranks disagree on the model's parameters (names, shapes or requires_grad): "
                f"fingerprints per rank {every.tolist()}; build the same model on every rank "
                "before `prepare`"
            )

    @contextmanager
    def rank0_random(self) -> Iterator[None]:
        """Inside: the global CPU generator continues rank 0's stream on every rank (a collective).

        `prepare` builds the optimizer in here, so what it draws at construction (optim-came's
        and optim-adafactor's stochastic-rounding seed) is alike on every rank, also when each
        rank seeded itself differently: the replicated parameters, which every rank steps on its
        own copy, stay identical. Rank 0 draws from its own stream as without shard-zero; on the
        other ranks the stream is restored on exit (their draws are rank 0's, not their own).
        """
        probe = torch.empty(0, device=self.device)
        if self.world == 1 or not host_readable(probe):  # fake tensors: nothing to draw alike
            yield
            return
        state = torch.get_rng_state()
        every = torch.empty(self.world * state.numel(), dtype=torch.uint8, device=self.device)
        self.comm.names[_RANDOM_STATE] = "rank 0's random state for `make_optimizer`"
        work = self.comm.all_gather(every, state.to(self.device), ident=_RANDOM_STATE)
        self.comm.wait(work, _RANDOM_STATE)
        if self.rank == 0:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(every[: state.numel()].cpu())
            yield

    def _make_entry(self, name: str, p: nn.Parameter) -> Entry:
        if p.dtype == torch.float64 or p.is_complex():
            raise TypeError(
                f"parameter {name!r} is {p.dtype}: shard-zero keeps fp32 master rows and "
                "reduces gradients in at most fp32, so it would train in fp32 (a complex one "
                "would lose its imaginary part); convert the model (e.g. `model.float()`) or "
                "freeze the parameter before `prepare`"
            )
        # e.g. channels_last: the gathers write row-major rows (stage 3 always made them views
        # of a flat buffer); not deferred init's stride-0 placeholders, which hold no memory
        if not p.is_contiguous() and 0 not in p.stride():
            p.data = p.data.contiguous()
        shape = tuple(p.shape)
        sharded = p.dim() >= 1 and p.numel() > 0 and p.numel() >= self.config.min_shard_numel
        compute = self.config.param_dtype or p.dtype
        aliased = (
            self.stage < 3
            and p.dtype == torch.float32
            and compute == torch.float32
            and not self.offload
        )
        if sharded:
            chunk, start, end = row_split(shape[0], self.world, self.rank)
            rows = p.data[start:end]
            master = nn.Parameter(rows if aliased else self._master_copy(rows))
            group = self.host_group if self.offload else self.group
            info = RowShardInfo(global_shape=shape, row_offset=start, group=group)
            setattr(master, ROW_SHARD_ATTR, info)
        else:
            chunk, start, end = 1, 0, shape[0] if shape else 1
            master = nn.Parameter(p.data if aliased else self._master_copy(p.data))
        row_numel = p[0].numel() if p.dim() >= 1 and shape[0] > 0 else 1
        if p.dtype != compute:
            p.data = p.data.to(compute)
        return Entry(name, p, master, sharded, shape, start, end, chunk, row_numel)

    def _master_copy(self, data: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of `data`: on the device, or in host memory with `offload_optimizer`."""
        if not self.offload:
            return data.to(torch.float32, copy=True)
        return self.host_empty(data.shape, torch.float32).copy_(data)

    def host_empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor (pinned when the model is on CUDA)."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned)

    def compute_rows(self, e: Entry) -> torch.Tensor:
        """This rank's rows of `e` as the parameter all-gathers read them.

        The fp32 master (cast while packed), or with `offload_optimizer` and a compute dtype
        other than fp32 its host copy in that dtype (`host_rows`, refreshed by `push_params`).
        """
        return e.host_rows if e.host_rows is not None else e.master.detach()

    def wait_for_host(self) -> None:
        """`offload_optimizer` on CUDA: wait until the gradients copied to the host arrived."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).synchronize()
            self.copy_stream.synchronize()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)` from the device into pinned host memory, off the compute stream.

        On CUDA the copy waits for what the current stream has queued (the gradient's last
        reduction), runs on `copy_stream` while backward goes on, and `src`'s memory is not
        reused before it finished (`record_stream`); `wait_for_host` waits for it. On the CPU
        a plain copy.
        """
        stream = self.copy_stream
        if stream is None:
            dst.copy_(src, non_blocking=True)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)

    def from_host(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A device copy of a host tensor `to_host` may still be writing (ordered after it)."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        return src.to(self.device, dtype, non_blocking=True, copy=True)


def model_device(model: nn.Module) -> torch.device:
    """The device of `model`'s parameters (CPU for a model without parameters)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"all parameters of `model` must be on one device, got {sorted(map(str, devices))}; "
            "move the model with `model.to(device)` before `prepare`"
        )
    return next(iter(devices)) if devices else torch.device("cpu")
