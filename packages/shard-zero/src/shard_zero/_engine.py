"""The sharding engine: builds the shards, installs the hooks and moves gradients and weights.

Data flow per step (Ψ = trainable elements, W = world size):

* backward: each parameter's gradient is moved by a post-accumulate-grad hook into an fp32
  accumulator (`Entry.acc`) and `param.grad` is released. Stage 1 stops there; stages 2-3 pack
  the accumulators of a bucket (stage 3: of a wrapping unit) as soon as all of them arrived and
  start an async reduce-scatter, so communication overlaps the rest of backward. A callback
  queued on the autograd engine flushes incomplete buckets (unused parameters count as zero)
  and waits for everything at the end of backward. Under `no_sync()` nothing is communicated.
* step: leftover accumulators (stage 1, or micro-batches run under `no_sync()`) are
  reduce-scattered, the wrapped optimizer steps the fp32 row shards, then stages 1-2 all-gather
  the updated shards into the full model parameters; stage 3 lets the next forward gather them.
* stage 3 forward/backward: a unit's parameters are views into one flat buffer whose storage is
  resized to 0 at rest; a pre-forward hook (and a hook on the unit's output gradient) gathers it,
  prefetching the next unit, and it is freed after the unit's forward and after its gradients.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shard_zero._comm import Comm, Gather
from shard_zero._config import ZeroConfig
from shard_zero._layout import (
    Bucket,
    Entry,
    RowShardInfo,
    local_piece,
    make_buckets,
    pack_full,
    row_split,
    unpack_full,
)

ROW_SHARD_ATTR = "leanlm_row_shard"
_FREE, _GATHERING, _READY = 0, 1, 2
# collective idents (what a collective carries, for the divergence checks and error messages)
_GRADS_OF_UNIT = 100_000  # + unit index; a unit's parameter gather is its index
_PARAMS_OF_BUCKET = 200_000  # + bucket index
_GRADS_OF_BUCKET = 300_000
_MASTERS_OF_BUCKET = 400_000
_REPLICATED, _FINGERPRINT, CLIP_IDENT = 500_000, 500_001, 500_002


class Unit:
    """Stage 3: parameters gathered and freed together, stored as views of one flat buffer."""

    def __init__(
        self,
        name: str,
        entries: list[Entry],
        dtype: torch.dtype,
        root: bool,
        *,
        ident: int,
        device: torch.device,
    ) -> None:
        self.name = name
        self.root = root
        self.ident = ident
        self.bucket = Bucket(entries, ident=_GRADS_OF_UNIT + ident)
        numel = sum(e.param.numel() for e in entries)
        self.full = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.state = _READY
        self.gather: Gather | None = None

    def free(self) -> None:
        """Release the gathered storage (the parameters' views stay, pointing at 0 bytes)."""
        if self.state == _READY:
            self.full.untyped_storage().resize_(0)
            self.state = _FREE


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
        self.sync = True
        self._callback_queued = False
        self._pending: list[tuple[Any, torch.Tensor, Bucket]] = []
        self._check_same_model(model)

        self.entries: list[Entry] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.entries.append(self._make_entry(name, p))
        self.by_param: dict[torch.Tensor, Entry] = {e.param: e for e in self.entries}
        self.sharded = [e for e in self.entries if e.sharded]
        self.replicated = [e for e in self.entries if not e.sharded]
        # backward produces gradients roughly in reverse registration order
        self.buckets = make_buckets(self.sharded[::-1], config.bucket_numel)
        for i, bucket in enumerate(self.buckets):
            bucket.ident = _GRADS_OF_BUCKET + i
            first = bucket.entries[0].name
            self.comm.names[_PARAMS_OF_BUCKET + i] = f"the parameters of bucket {i} ({first!r}...)"
            self.comm.names[bucket.ident] = f"the gradients of bucket {i} ({first!r}...)"
        self.comm.names[_REPLICATED] = "the gradients of the replicated (small) parameters"
        self.comm.names[CLIP_IDENT] = "the global gradient norm (clip_grad_norm_)"
        self.units: list[Unit] = []
        self._unit_of: dict[int, Unit] = {}
        self._fwd_order: list[Unit] = []
        if self.stage == 3:
            self._build_units()
        for e in self.entries:
            e.param.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ construction
    def _check_same_model(self, model: nn.Module) -> None:
        """Raise (instead of hanging later) if ranks hold different trainable parameter sets."""
        desc = "|".join(
            f"{n}:{tuple(p.shape)}:{p.requires_grad}" for n, p in model.named_parameters()
        )
        digest = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:7], "little")
        mine = torch.tensor([digest], dtype=torch.int64, device=self.device)
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
        aliased = self.stage < 3 and p.dtype == torch.float32 and compute == torch.float32
        if sharded:
            chunk, start, end = row_split(shape[0], self.world, self.rank)
            rows = p.data[start:end]
            master = nn.Parameter(rows if aliased else rows.to(torch.float32, copy=True))
            info = RowShardInfo(global_shape=shape, row_offset=start, group=self.group)
            setattr(master, ROW_SHARD_ATTR, info)
        else:
            chunk, start, end = 1, 0, shape[0] if shape else 1
            data = p.data if aliased else p.data.to(torch.float32, copy=True)
            master = nn.Parameter(data)
        row_numel = p[0].numel() if p.dim() >= 1 and shape[0] > 0 else 1
        if p.dtype != compute:
            p.data = p.data.to(compute)
        return Entry(name, p, master, sharded, shape, start, end, chunk, row_numel)

    def _build_units(self) -> None:
        policy = self.config.wrap_policy or _default_wrap_policy(self.model)
        assigned: set[torch.Tensor] = set()
        groups: list[tuple[str, list[Entry], nn.Module]] = []
        for name, module in self.model.named_modules():
            if module is self.model or not policy(name, module):
                continue
            members = [
                self.by_param[p]
                for p in module.parameters()
                if p in self.by_param and self.by_param[p].sharded and p not in assigned
            ]
            assigned.update(e.param for e in members)
            if members:
                groups.append((name, members, module))
        rest = [e for e in self.sharded if e.param not in assigned]
        for name, members, module in [("", rest, self.model), *groups]:
            dtypes = {e.param.dtype for e in members}
            if len(dtypes) > 1:
                raise ValueError(
                    f"stage 3 unit {name or '<root>'!r} mixes parameter dtypes "
                    f"{sorted(map(str, dtypes))}; set `param_dtype` or use a `wrap_policy` "
                    "with uniform dtypes"
                )
            dtype = next(iter(dtypes)) if dtypes else torch.float32
            ident = len(self.units)
            unit = Unit(
                name, members, dtype, root=module is self.model, ident=ident, device=self.device
            )
            label = f"stage-3 unit {name or '<root>'!r}"
            self.comm.names[ident] = label
            self.comm.names[unit.bucket.ident] = f"the gradients of {label}"
            offset = 0
            for e in members:
                view = unit.full[offset : offset + e.param.numel()].view(e.shape)
                view.copy_(e.param.data)
                e.param.data = view
                offset += e.param.numel()
            unit.free()
            self.units.append(unit)
            self._unit_of[id(module)] = unit
            if unit.root:
                module.register_forward_pre_hook(self._root_pre_forward)
            else:
                module.register_forward_pre_hook(self._unit_pre_forward)
                module.register_forward_hook(self._unit_post_forward)

    # ------------------------------------------------------------------ stage 3 gathering
    def _gather_start(self, unit: Unit) -> None:
        if unit.state != _FREE:
            return
        b = unit.bucket
        unit.full.untyped_storage().resize_(unit.nbytes)
        gather = Gather(self.comm, unit.ident, b.size, unit.full.dtype)
        for e, off in zip(b.entries, b.offsets, strict=True):
            gather.payload[off : off + e.local_numel].copy_(e.master.detach().reshape(-1))
        unit.gather = gather.start()
        unit.state = _GATHERING

    def _gather_wait(self, unit: Unit) -> None:
        self._gather_start(unit)
        if unit.state == _GATHERING:
            assert unit.gather is not None
            gather, unit.gather = unit.gather, None
            out = gather.wait()
            for e, off in zip(unit.bucket.entries, unit.bucket.offsets, strict=True):
                unpack_full(out, off, e, e.param.data)
            unit.state = _READY

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._fwd_order = []
        self._gather_wait(self._unit_of[id(module)])

    def _unit_pre_forward(self, module: nn.Module, args: Any) -> None:
        unit = self._unit_of[id(module)]
        self._gather_wait(unit)
        self._fwd_order.append(unit)
        if self.config.prefetch:
            index = self.units.index(unit)
            if index + 1 < len(self.units):
                self._gather_start(self.units[index + 1])

    def _unit_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        unit = self._unit_of[id(module)]
        unit.free()
        if not torch.is_grad_enabled():
            return
        position = len(self._fwd_order) - 1
        tensors = output if isinstance(output, tuple | list) else (output,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(  # type: ignore[no-untyped-call]
                    lambda grad, u=unit, i=position: self._pre_backward(u, i)
                )

    def _pre_backward(self, unit: Unit, position: int) -> None:
        self._queue_callback()
        self._gather_wait(unit)
        if self.config.prefetch and position > 0 and position - 1 < len(self._fwd_order):
            self._gather_start(self._fwd_order[position - 1])

    # ------------------------------------------------------------------ gradients
    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        e = self.by_param[p]
        self._queue_callback()
        g = p.grad
        p.grad = None
        if g is None:
            return
        if e.acc is None:
            e.acc = g if g.dtype == torch.float32 else g.to(torch.float32)
        else:
            e.acc.add_(g)
        e.ready = True
        if not self.sync or not e.sharded or self.stage == 1:
            return
        bucket = self._unit_of_entry(e).bucket if self.stage == 3 else self._bucket_of(e)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_reduce(bucket)
            if self.stage == 3:
                unit = self._unit_of_entry(e)
                if not unit.root:
                    unit.free()

    def _bucket_of(self, e: Entry) -> Bucket:
        if not hasattr(self, "_bucket_index"):
            self._bucket_index = {id(x): b for b in self.buckets for x in b.entries}
        return self._bucket_index[id(e)]

    def _unit_of_entry(self, e: Entry) -> Unit:
        if not hasattr(self, "_entry_unit"):
            self._entry_unit = {id(x): u for u in self.units for x in u.bucket.entries}
        return self._entry_unit[id(e)]

    def _launch_reduce(self, bucket: Bucket) -> None:
        buf = torch.empty(self.world, bucket.size, dtype=self.reduce_dtype, device=self.device)
        for e, off in zip(bucket.entries, bucket.offsets, strict=True):
            pack_full(buf, off, e, e.acc)
            e.acc = None
        out = torch.empty(bucket.size, dtype=self.reduce_dtype, device=self.device)
        work = self.comm.reduce_scatter(out, buf.view(-1), ident=bucket.ident)
        bucket.launched = True
        self._pending.append((work, out, bucket))

    def _reduce_replicated(self) -> None:
        if not self.replicated:
            return
        flat = torch.cat(
            [
                (
                    e.acc
                    if e.acc is not None
                    else torch.zeros(e.shape, dtype=torch.float32, device=self.device)
                ).reshape(-1)
                for e in self.replicated
            ]
        ).to(self.reduce_dtype)
        self.comm.all_reduce(flat, ident=_REPLICATED)
        flat = flat.to(torch.float32).mul_(1.0 / self.world)
        offset = 0
        for e in self.replicated:
            n = e.master.numel()
            _add_grad(e.master, flat[offset : offset + n].view(e.master.shape))
            offset += n
            e.acc = None

    def _wait_pending(self) -> None:
        for work, out, bucket in self._pending:
            self.comm.wait(work, bucket.ident)
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                piece = local_piece(out, off, e).to(torch.float32).mul_(1.0 / self.world)
                _add_grad(e.master, piece)
            bucket.launched = False
            bucket.pending = len(bucket.entries)
        self._pending.clear()

    def _all_buckets(self) -> list[Bucket]:
        return [u.bucket for u in self.units] if self.stage == 3 else self.buckets

    def _end_backward(self) -> None:
        self._callback_queued = False
        if self.sync and self.stage >= 2:
            for bucket in self._all_buckets():
                if not bucket.launched and any(e.ready for e in bucket.entries):
                    self._launch_reduce(bucket)
            if any(e.ready for e in self.replicated):
                self._reduce_replicated()
            self._wait_pending()
        for e in self.entries:
            e.ready = False
        for unit in self.units:
            unit.free()

    def reduce_leftover(self) -> None:
        """Reduce every gradient still held in a full-size accumulator (stage 1, `no_sync`)."""
        if any(e.acc is not None for e in self.sharded):
            for bucket in self._all_buckets():
                self._launch_reduce(bucket)
            self._wait_pending()
        if any(e.acc is not None for e in self.replicated):
            self._reduce_replicated()

    # ------------------------------------------------------------------ parameters
    def push_params(self) -> None:
        """Make the model's compute parameters equal the (fp32) masters on every rank."""
        for e in self.replicated:
            if e.param.data_ptr() != e.master.data_ptr():
                e.param.data.copy_(e.master.detach())
        if self.stage == 3:
            for unit in self.units:
                unit.free()  # the next forward gathers the new values
            return
        gathers = []
        for i, bucket in enumerate(self.buckets):
            dtype = bucket.entries[0].param.dtype
            gather = Gather(self.comm, _PARAMS_OF_BUCKET + i, bucket.size, dtype)
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                gather.payload[off : off + e.local_numel].copy_(e.master.detach().reshape(-1))
            gathers.append((gather.start(), bucket))
        for gather, bucket in gathers:
            out2d = gather.wait()
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                unpack_full(out2d, off, e, e.param.data)

    def gather_masters(self) -> dict[nn.Parameter, torch.Tensor]:
        """Full fp32 copies of every trainable parameter (a collective: call on every rank)."""
        result: dict[nn.Parameter, torch.Tensor] = {}
        for i, bucket in enumerate(make_buckets(self.sharded, self.config.bucket_numel)):
            ident = _MASTERS_OF_BUCKET + i
            self.comm.names[ident] = f"the master weights of bucket {i} (full_state_dict)"
            gather = Gather(self.comm, ident, bucket.size, torch.float32)
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                gather.payload[off : off + e.local_numel].copy_(e.master.detach().reshape(-1))
            out2d = gather.start().wait()
            for e, off in zip(bucket.entries, bucket.offsets, strict=True):
                full = torch.empty(e.shape, dtype=torch.float32, device=self.device)
                unpack_full(out2d, off, e, full)
                result[e.param] = full
        for e in self.replicated:
            result[e.param] = e.master.detach().clone()
        return result

    def check_step(self) -> None:
        """Raise if the ranks issued different collectives since the last step (collective)."""
        self.comm.check_step()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (fp32, full size) without communicating.

        The first backward outside the context (or `optimizer.step()`) reduces the sum, so
        k-1 micro-batches under `no_sync()` plus one outside equal one k-times larger batch.
        """
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def _add_grad(master: torch.Tensor, piece: torch.Tensor) -> None:
    if master.grad is None:
        master.grad = piece.clone()
    else:
        master.grad.add_(piece)


def _default_wrap_policy(model: nn.Module) -> Any:
    children = {
        id(child)
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for child in module
    }
    return lambda name, module: id(module) in children


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
