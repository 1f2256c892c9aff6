"""The sharding engine: builds the shards and keeps the model's parameters in sync with them.

Per step (Ψ = trainable elements, W = world size): backward moves gradients into the fp32 master
shards' `.grad` (`_reduce.Reducer`: stages 2-3 reduce-scatter each bucket while backward runs,
stage 1 at the accumulation boundary); `step()` steps the wrapped optimizer on the shards, then
stages 1-2 all-gather the updated shards into the full model parameters (at most
`GATHERS_IN_FLIGHT` buckets at a time) and stage 3 lets the next forward gather them
(`_units.Units`: per wrapping unit, freed right after use).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_zero._comm import Comm, Gather, host_group, host_readable
from shard_zero._config import ZeroConfig
from shard_zero._layout import (
    Bucket,
    Entry,
    RowShardInfo,
    local_rows,
    make_buckets,
    row_split,
    unpack_full,
)
from shard_zero._reduce import Reducer
from shard_zero._units import Unit, Units

ROW_SHARD_ATTR = "leanlm_row_shard"
# collective idents (what a collective carries, for the divergence checks and error messages);
# stage-3 units use theirs (`_units`), the replicated all-reduce 500_000 (`_reduce`)
_PARAMS_OF_BUCKET = 200_000  # + bucket index
_GRADS_OF_BUCKET = 300_000
_FINGERPRINT, CLIP_IDENT = 500_001, 500_002
GATHERS_IN_FLIGHT = 2  # stages 1-2 parameter all-gathers outstanding at once after `step()`


class ZeroEngine:
    """Owns the shards of one model and moves gradients and parameters between ranks."""

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
        self.host_group = (
            host_group(self.group, self.device, config.timeout_delta) if self.offload else None
        )
        self.sync = True
        self._released: dict[int, int] = {}  # entry -> bytes of a compute copy freed for step
        self._check_same_model(model)

        self.entries: list[Entry] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.entries.append(self._make_entry(name, p))
        self.by_param: dict[torch.Tensor, Entry] = {e.param: e for e in self.entries}
        self.sharded = [e for e in self.entries if e.sharded]
        self.replicated = [e for e in self.entries if not e.sharded]
        # stages 1-2: backward produces gradients roughly in reverse registration order
        self.buckets = make_buckets(self.sharded[::-1], config.bucket_numel, self.world)
        for i, bucket in enumerate(self.buckets):
            bucket.ident = _GRADS_OF_BUCKET + i
            first = bucket.entries[0].name
            self.comm.names[_PARAMS_OF_BUCKET + i] = f"the parameters of bucket {i} ({first!r}...)"
            self.comm.names[bucket.ident] = f"the gradients of bucket {i} ({first!r}...)"
        self.comm.names[CLIP_IDENT] = "the global gradient norm (clip_grad_norm_)"
        self.units: list[Unit] = []
        if self.stage == 3:
            self.stage3 = Units(self)
            self.units = self.stage3.units
            grad_buckets = [b for u in self.units for b in u.grad_buckets]
        else:
            grad_buckets = self.buckets
        self.reducer = Reducer(self, grad_buckets)
        for e in self.entries:
            e.param.register_post_accumulate_grad_hook(self.reducer.on_grad)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ construction
    def _check_same_model(self, model: nn.Module) -> None:
        """Raise (instead of hanging later) if ranks hold different trainable parameter sets."""
        desc = "|".join(
            f"{n}:{tuple(p.shape)}:{p.requires_grad}" for n, p in model.named_parameters()
        )
        digest = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:7], "little")
        mine = torch.tensor([digest], dtype=torch.int64, device=self.device)
        if not host_readable(mine):
            return  # fake tensors (the scale simulator): no values to compare
        every = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self.comm.names[_FINGERPRINT] = "the model fingerprint check in `prepare`"
        self.comm.wait(self.comm.all_gather(every, mine, ident=_FINGERPRINT), _FINGERPRINT)
        if bool((every != mine).any()):
            raise ValueError(
                "ranks disagree on the model's parameters (names, shapes or requires_grad): "
                f"fingerprints per rank {every.tolist()}; build the same model on every rank "
                "before `prepare`"
            )

    def _make_entry(self, name: str, p: nn.Parameter) -> Entry:
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
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ gradients
    def reduce_leftover(self) -> None:
        """Finish reduction before the optimizer reads the gradients (a collective).

        Reduces what stage-1 backwards under `no_sync()` left unreduced, and casts bf16
        accumulators (`accum_dtype`) into the fp32 master gradients.
        """
        self.reducer.reduce_leftover()
        self.reducer.materialize()
        self.wait_for_host()  # the host optimizer (or the norm) reads them next

    # ------------------------------------------------------------------ parameters
    def release_params(self) -> None:
        """Stages 1-2 under mixed precision: free the compute copies for the optimizer step.

        `push_params` right after the step rewrites every element of them, so the optimizer's
        temporaries never coexist with a full copy of the parameters (parameters whose master
        shares their memory, as in fp32, are kept).
        """
        if self.stage == 3 or self.offload:  # offload: the step holds nothing on the device
            return
        for e in self.sharded:
            p = e.param.data
            st = p.untyped_storage()
            own = p.storage_offset() == 0 and st.nbytes() == p.numel() * p.element_size()
            if own and not _same_memory(p, e.master) and e.master.dtype != p.dtype:
                self._released[id(e)] = st.nbytes()
                st.resize_(0)

    def push_params(self) -> None:
        """Make the model's compute parameters equal the (fp32) masters on every rank.

        Stages 1-2 all-gather bucket by bucket with at most `GATHERS_IN_FLIGHT` gathers outstanding
        (never a second full copy of the parameters); stage 3 frees its units (the next forward
        gathers the new values).
        """
        for e in self.replicated:
            if not _same_memory(e.param, e.master):
                e.param.data.copy_(e.master.detach())
        if self.offload:  # cast on the host: the device receives the compute dtype's bytes
            self.wait_for_host()  # no copy from the rows about to be rewritten is pending
            for e in self.sharded:
                if e.param.dtype != torch.float32:
                    if e.host_rows is None:
                        e.host_rows = self.host_empty(e.master.shape, e.param.dtype)
                    e.host_rows.copy_(e.master.detach())
        if self.stage == 3:
            self.stage3.free_all()
            return
        for e in self.sharded:
            nbytes = self._released.pop(id(e), None)
            if nbytes is not None:
                e.param.data.untyped_storage().resize_(nbytes)  # refilled by the gathers below
        in_flight: list[tuple[Gather, Bucket]] = []
        for i, bucket in enumerate(self.buckets):
            dtype = bucket.entries[0].param.dtype
            gather = Gather(self.comm, _PARAMS_OF_BUCKET + i, bucket.size, dtype)
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                first, n = local_rows(e, bucket.span(e))
                rows = self.compute_rows(e)[first : first + n].reshape(-1)
                gather.payload[off : off + rows.numel()].copy_(rows, non_blocking=True)
            in_flight.append((gather.start(), bucket))
            if len(in_flight) >= GATHERS_IN_FLIGHT:
                self._unpack(*in_flight.pop(0))
        for gather, bucket in in_flight:
            self._unpack(gather, bucket)

    @staticmethod
    def _unpack(gather: Gather, bucket: Bucket) -> None:
        out2d = gather.wait()
        for e, off in zip(bucket.entries, bucket.offsets, strict=True):
            unpack_full(out2d, off, e, e.param.data, bucket.span(e))

    def check_step(self) -> None:
        """Raise if the ranks issued different collectives since the last step (collective)."""
        self.comm.check_step()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate full gradients locally, without communicating.

        The first backward outside the context (or `optimizer.step()`) reduces the sum, so
        k-1 micro-batches under `no_sync()` plus one outside equal one k-times larger batch.
        Stages 2-3 reduce-scatter every micro-batch into the sharded fp32 accumulator anyway
        (memory does not grow with accumulation); the context changes nothing there.
        """
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` view the same storage at the same offset (no `data_ptr`: fake-safe)."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return bool(sa._cdata == sb._cdata and a.storage_offset() == b.storage_offset())


def model_device(model: nn.Module) -> torch.device:
    """The device of `model`'s parameters (CPU for a model without parameters)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"all parameters of `model` must be on one device, got {sorted(map(str, devices))}; "
            "move the model with `model.to(device)` before `prepare`"
        )
    return next(iter(devices)) if devices else torch.device("cpu")


def check_group(group: Any) -> None:
    """Raise a clear error when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard-zero needs an initialised torch.distributed process group: call "
            "`torch.distributed.init_process_group(...)` (or launch with torchrun) first"
        )
