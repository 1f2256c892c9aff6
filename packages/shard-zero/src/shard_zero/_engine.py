"""The sharding engine: keeps the model's parameters in sync with its shards (`_shards.Shards`).

Per step: backward moves gradients into the fp32 master shards' `.grad` (`_reduce.Reducer`:
stages 2-3 reduce-scatter each bucket while backward runs, stage 1 at the accumulation boundary);
`step()` steps the wrapped optimizer on the shards, then stages 1-2 all-gather the updated shards
into the full model parameters (at most `GATHERS_IN_FLIGHT` buckets at a time) and stage 3 lets
the next forward gather them (`_units.Units`: per wrapping unit, freed right after use).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_zero._comm import Gather
from shard_zero._config import ZeroConfig
from shard_zero._layout import Bucket, copy_pairs, local_rows, make_buckets, unpack_pairs
from shard_zero._model_hooks import ModelHooks
from shard_zero._reduce import Reducer
from shard_zero._shards import Shards
from shard_zero._units import Unit, Units

# collective idents (what a collective carries, for the divergence checks and error messages);
# stage-3 units use theirs (`_units`), the replicated all-reduce 500_000 (`_reduce`), the model
# fingerprint 500_001 (`_shards`)
_PARAMS_OF_BUCKET = 200_000  # + bucket index
_GRADS_OF_BUCKET = 300_000
CLIP_IDENT = 500_002
GATHERS_IN_FLIGHT = 2  # stages 1-2 parameter all-gathers outstanding at once after `step()`


class ZeroEngine(Shards):
    """Owns the shards of one model and moves gradients and parameters between ranks."""

    def __init__(self, model: nn.Module, config: ZeroConfig, group: Any) -> None:
        super().__init__(model, config, group)
        self._released: dict[int, int] = {}  # entry -> bytes of a compute copy freed for step
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
            self.reducer = Reducer(self, grad_buckets, self.stage3)
            self.stage3.before_backward = self.reducer.queue_callback
            self.stage3.launch_done = self.reducer.launch_done
        else:
            self.reducer = Reducer(self, self.buckets, None)
        for e in self.entries:
            e.param.register_post_accumulate_grad_hook(self.reducer.on_grad)  # type: ignore[no-untyped-call]
        # `model.load_state_dict` reaches the masters; stage 3 guards `model.state_dict`
        self.model_hooks = ModelHooks(self, self.stage3 if self.stage == 3 else None)

    # ------------------------------------------------------------------ gradients
    def reduce_leftover(self) -> None:
        """Finish reduction before the optimizer reads the gradients (a collective).

        Reduces what stage-1 backwards under `no_sync()` left unreduced, and casts bf16
        accumulators (`accum_dtype`) into the fp32 master gradients.
        """
        self.reducer.reduce_leftover()
        self.reducer.materialize()
        self.wait_for_host()  # the host optimizer (or the norm) reads them next

    def clear_grads(self) -> None:
        """Drop the gradients accumulated outside the masters' `.grad` (and `param.grad`)."""
        self.wait_for_host()  # offload: no copy into the host gradients is pending
        for e in self.entries:
            e.acc = None
            e.low_acc = None
            e.dev_grad = None
            e.host_has = False
            e.param.grad = None

    def model_zero_grad(self, set_to_none: bool = True) -> None:
        """`model.zero_grad()` after `prepare`: also clear the gradients the optimizer steps.

        The model class's own `zero_grad` runs first (frozen parameters, stage-1 gradients),
        then the masters' gradients are cleared as `Optimizer.zero_grad(set_to_none)` clears
        them, with every accumulator, so that the model's and the optimizer's `zero_grad` are
        interchangeable, as under DDP and FSDP2.
        """
        type(self.model).zero_grad(self.model, set_to_none)
        self.wait_for_host()
        for e in self.entries:
            g = e.master.grad
            if g is None:
                continue
            if set_to_none:
                e.master.grad = None
            else:
                g.requires_grad_(False)
                g.zero_()
        self.clear_grads()

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
        (never a second full copy of the parameters), or at world 1 copy the masters straight
        into the parameters (one foreach cast-copy); stage 3 frees its units (the next forward
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
        if self.world == 1:  # every row is here: one cast-copy, no buckets, no collective
            pairs = [(e.param.data, self.compute_rows(e)) for e in self.sharded]
            pairs = [(p, m) for p, m in pairs if not _same_memory(p, m)]
            copy_pairs(pairs, from_host=self.offload)
            return
        in_flight: list[tuple[Gather, Bucket]] = []
        for i, bucket in enumerate(self.buckets):
            dtype = bucket.entries[0].param.dtype  # one dtype per bucket (`make_buckets`)
            gather = Gather(self.comm, _PARAMS_OF_BUCKET + i, bucket.size, dtype)
            pairs = []
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                first, n = local_rows(e, bucket.span(e))
                rows = self.compute_rows(e)[first : first + n].reshape(-1)
                pairs.append((gather.payload[off : off + rows.numel()], rows))
            copy_pairs(pairs, from_host=self.offload)
            in_flight.append((gather.start(), bucket))
            if len(in_flight) >= GATHERS_IN_FLIGHT:
                self._unpack(*in_flight.pop(0))
        for gather, bucket in in_flight:
            self._unpack(gather, bucket)

    @staticmethod
    def _unpack(gather: Gather, bucket: Bucket) -> None:
        out2d = gather.wait()
        copy_pairs(
            [
                pair
                for e, off in zip(bucket.entries, bucket.offsets, strict=True)
                for pair in unpack_pairs(out2d, off, e, e.param.data, bucket.span(e))
            ]
        )

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


def check_group(group: Any) -> None:
    """Raise a clear error when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard-zero needs an initialised torch.distributed process group: call "
            "`torch.distributed.init_process_group(...)` (or launch with torchrun) first"
        )
