"""Gradient reduction: from the model's parameters to the fp32 master shards' `.grad`.

Stages 2-3 reduce-scatter each gradient bucket while backward still runs (a post-accumulate-grad
hook packs the gradient and frees `param.grad`), so communication overlaps compute and memory does
not grow with the number of micro-batches; stage 1 (as DDP) reduces `param.grad` at the
accumulation boundary. Buckets launch in one rank-invariant order, and the end of backward
launches every bucket left, with or without a gradient on this rank, so ranks always issue the
same collectives; at stage 3 a unit's buckets also launch once its backward is over on every
rank (`_unit_progress`), so ranks issue them between the same all-gathers. `accum_dtype`,
`offload_accum` and `offload_optimizer` only change where, and in which dtype, the reduced rows
accumulate (`materialize`, `_add_on_host`, `_offload`). At
world 1 a packed bucket is already the reduced one: no collective runs, no scaling by 1, and
its fp32 rows become the master gradients as they are (views of the bucket's buffer).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from shard_zero._comm import host_readable
from shard_zero._layout import Bucket, Entry, local_piece, local_rows, pack_full
from shard_zero._offload import OffloadGrads
from shard_zero._shards import Shards
from shard_zero._units import Units

MAX_IN_FLIGHT = 1  # reduce-scatters left outstanding after a launch (plus the one being packed)
REPLICATED_IDENT = 500_000


class Reducer(OffloadGrads):
    """Owns the gradient buckets of one engine and reduces them into the master gradients."""

    def __init__(self, engine: Shards, buckets: list[Bucket], units: Units | None) -> None:
        self.engine = engine
        self.buckets = buckets  # every gradient bucket (stage 3: of every unit)
        self.units = units  # stage 3
        self._bucket_of = {id(e): b for b in buckets if b.rows is None for e in b.entries}
        self._pieces_of: dict[int, list[Bucket]] = {}  # entries that travel in pieces
        for b in buckets:
            if b.rows is not None:
                self._pieces_of.setdefault(id(b.entries[0]), []).append(b)
        # stage 1 reduces at the boundary with every full gradient alive: buckets of small
        # parameters first, so that their freed full gradients make room for the big ones' shards
        self._boundary_order = sorted(
            buckets, key=lambda b: max(e.param.numel() for e in b.entries)
        )
        self._offset_of = {
            id(e): o for b in buckets for e, o in zip(b.entries, b.offsets, strict=True)
        }
        self._unit_of = {id(e): u for u in (units.units if units else []) for e in u.entries}
        # stage 3: a wrapped unit's buckets, launched once complete or once its backward is
        # over on every rank (`launch_done`); the root unit's once complete
        self._wrapped_of = {
            id(b): u for u in (units.units[1:] if units else []) for b in u.grad_buckets
        }
        self._done: set[Any] = set()
        self._launched: set[int] = set()  # buckets launched in this backward (stage 3)
        self._pending: deque[tuple[Any, torch.Tensor, torch.Tensor, Bucket]] = deque()
        self._order: list[Bucket] = []
        self._cursor = 0
        self._callback_queued = False
        self._contributed: set[int] = set()  # entries that had a gradient on this rank
        self._fresh: set[int] = set()  # entries whose master `.grad` this reduction created
        self._host_fresh: set[int] = set()  # entries whose host rows this reduction started
        self._host_new: set[int] = set()  # offload: host gradients made of this reduction only
        self.unreduced = False  # stage 1: a backward under no_sync() left gradients unreduced
        # fp32 reductions over a power-of-two world average in the collective (as FSDP2): the
        # reduced rows are the master gradients as they are. Dividing by 2^k is exact, so this
        # equals the sum times 1/world bit for bit; other worlds (sum / 3 is not sum * (1/3))
        # and bf16 (one rounding, in fp32) scale the summed rows afterwards
        world = engine.world
        self.averages = (
            world > 1
            and world & (world - 1) == 0
            and engine.comm.averages
            and engine.reduce_dtype == torch.float32
        )
        engine.comm.names[REPLICATED_IDENT] = (
            "the gradients of the replicated (small) parameters and the per-parameter "
            "gradient flags"
        )

    # ------------------------------------------------------------------ backward hooks
    def queue_callback(self) -> None:
        """Queue the end-of-backward callback once per backward and fix the launch order."""
        if self._callback_queued:
            return
        self._callback_queued = True
        if self.units is not None:
            self._order = self.units.launch_order()
        else:
            self._order = list(self.buckets if self.engine.stage == 2 else self._boundary_order)
        self._cursor = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of every trainable parameter."""
        self.queue_callback()
        if self.engine.stage == 1:
            return  # stays in `p.grad` (autograd accumulates) until the boundary
        g = p.grad
        p.grad = None
        if g is None:
            return
        e = self.engine.by_param[p]
        if not e.sharded:
            e.acc = g.to(torch.float32) if e.acc is None else e.acc.add_(g)
            return
        unit = self._unit_of.get(id(e))
        if unit is not None:
            unit.grads_left -= 1
            if unit.grads_left == 0:
                unit.free()  # its last gradient is here: the gathered parameters go first
        self._contributed.add(id(e))
        pieces = self._pieces_of.get(id(e))
        if pieces is not None:  # packed piece by piece at launch, then released
            if any(id(piece) in self._launched for piece in pieces):
                raise _late(e)
            e.held = g
            for piece in pieces:
                piece.pending = 0
        else:
            bucket = self._bucket_of[id(e)]
            if id(bucket) in self._launched:
                raise _late(e)
            if bucket.buf is None:
                bucket.buf = self._new_buffer(bucket)
            pack_full(bucket.buf, self._offset_of[id(e)], e, g)
            e.ready = True
            bucket.pending -= 1
            if bucket.pending:
                return
        del g
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the buckets at the head of the order that may go (never one out of order).

        A bucket may go once complete, or (stage 3) once its unit's backward is over on every
        rank: that is where a rank whose unit left a parameter without gradient (an expert no
        token reached) launches it, between the same all-gathers as the ranks that completed
        it during that unit's backward.
        """
        order = self._order
        while self._cursor < len(order) and (
            order[self._cursor].pending == 0
            or self._wrapped_of.get(id(order[self._cursor])) in self._done
        ):
            self._launch(order[self._cursor])
            self._launched.add(id(order[self._cursor]))
            self._cursor += 1

    def launch_done(self, done: set[Any]) -> None:
        """Stage 3: the wrapped units whose backward is over on every rank (`Units._done`)."""
        self._done = done
        self._launch_ready()

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._done = set()
        self._launched.clear()
        engine = self.engine
        if self.units is not None:
            self.units.free_all()  # also units some of whose parameters got no gradient
        if engine.stage >= 2 or engine.sync:
            # every bucket, in the same order on every rank, whether or not its parameters got
            # gradients here: ranks whose gradients differ still issue the same collectives
            for bucket in self._order[self._cursor :]:
                self._launch(bucket)
            self._cursor = len(self._order)
            self._finish()
            self.unreduced = False
        else:
            self.unreduced = True

    def reduce_leftover(self) -> None:
        """Reduce the gradients a stage-1 backward under `no_sync()` left in `param.grad`.

        Whether to reduce depends only on what every rank ran (a backward under `no_sync()`
        since the last reduction), not on which gradients this rank has, so ranks agree.
        """
        if not self.unreduced:
            return
        self.unreduced = False
        for bucket in self._boundary_order:
            self._launch(bucket)
        self._finish()

    # ------------------------------------------------------------------ buckets
    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        engine = self.engine
        return torch.empty(
            engine.world, bucket.size, dtype=engine.reduce_dtype, device=engine.device
        )

    def _launch(self, bucket: Bucket) -> None:
        """Start the reduce-scatter of `bucket` (packing what is missing), bounded in flight."""
        engine = self.engine
        buf = bucket.buf if bucket.buf is not None else self._new_buffer(bucket)
        bucket.buf = None
        for e, off in zip(bucket.entries, bucket.offsets, strict=True):
            if e.ready:
                continue  # packed when its gradient arrived
            span = bucket.span(e)
            g = e.held if e.held is not None else e.param.grad if engine.stage == 1 else None
            pack_full(buf, off, e, g, span)  # zeros without a gradient
            if g is not None:
                self._contributed.add(id(e))
            if span[1] == e.chunk:  # its last piece: the full gradient is released
                e.held = None
                if engine.stage == 1:
                    e.param.grad = None
            del g
        for e in bucket.entries:
            e.ready = False
        bucket.pending = len(bucket.entries)
        if engine.world == 1:  # the packed buffer is the reduced one: no collective, no copy
            self._pending.append((None, buf, buf.view(-1), bucket))
        else:
            out = torch.empty(bucket.size, dtype=engine.reduce_dtype, device=engine.device)
            work = engine.comm.reduce_scatter(
                out, buf.view(-1), ident=bucket.ident, average=self.averages
            )
            self._pending.append((work, buf, out, bucket))
        while len(self._pending) > MAX_IN_FLIGHT:
            self._retire()

    def _retire(self) -> None:
        """Wait for the oldest reduce-scatter and add its output into the master gradients."""
        work, buf, out, bucket = self._pending.popleft()
        engine = self.engine
        if work is not None:
            engine.comm.wait(work, bucket.ident)
        del buf  # the input is released once its reduction completed (world 1: `out` is it)
        scale = 1.0 if self.averages else 1.0 / engine.world
        low = engine.accum_dtype != torch.float32
        to_host = engine.offload_accum and not engine.sync
        offload = engine.offload and engine.sync  # complete gradients go to the host now
        for e, off in zip(bucket.entries, bucket.offsets, strict=True):
            # a rank without rows gets an empty gradient, so that it still steps the parameter
            # (row-shard optimizers all-reduce their statistics over every rank)
            span = bucket.span(e)
            piece = local_piece(out, off, e, span)
            if to_host:
                self._add_on_host(e, piece, span, scale)
                continue
            acc = e.low_acc if low else self._device_grad(e)
            if acc is None:
                self._fresh.add(id(e))
                if bucket.rows is None:  # the whole local gradient in one piece
                    self._set_acc(e, _scaled(piece, scale, engine.accum_dtype), low)
                    if offload:
                        self._offload(e)
                    continue
                # the first piece: the others fill the remaining rows
                acc = torch.empty(e.master.shape, dtype=engine.accum_dtype, device=engine.device)
                self._set_acc(e, acc, low)
            first, n = local_rows(e, span)
            rows = acc[first : first + n]
            if id(e) in self._fresh and low:
                rows.copy_(piece.to(torch.float32) * scale)  # one rounding to bf16
            elif id(e) in self._fresh:
                rows.copy_(piece)
                if scale != 1.0:
                    rows.mul_(scale)
            else:
                rows.add_(piece, alpha=scale)
            if offload and span[1] == e.chunk:  # its last piece: the gradient is complete
                self._offload(e)

    def materialize(self) -> None:
        """Add the side accumulators into the fp32 master gradients.

        Those are the bf16 accumulators (`accum_dtype`) and the host buffers (`offload_accum`,
        copied back asynchronously; each buffer is free for the next micro-batch after that).
        """
        engine = self.engine
        for e in engine.sharded:
            if engine.offload:
                if e.dev_grad is not None or e.low_acc is not None or e.host_has:
                    self._offload(e)
                continue
            if e.low_acc is not None:
                g, e.low_acc = e.low_acc, None
                if e.master.grad is None:
                    e.master.grad = g.to(torch.float32)
                else:
                    e.master.grad.add_(g)
                del g
            if e.host_has and e.host_acc is not None:
                e.host_has = False
                g = e.host_acc.to(engine.device, torch.float32, non_blocking=True, copy=True)
                if e.master.grad is None:
                    e.master.grad = g
                else:
                    e.master.grad.add_(g)
                del g

    def _finish(self) -> None:
        """All-reduce the replicated gradients and the gradient flags, then wait for all.

        Only parameters for which some rank had a gradient keep one (the sum over ranks,
        missing gradients counting as zero).
        """
        engine = self.engine
        rep = engine.replicated
        full = [_full_grad(e) for e in rep]
        parts = [
            (g if g is not None else torch.zeros(e.shape, device=engine.device)).reshape(-1)
            for e, g in zip(rep, full, strict=True)
        ]
        mine = [
            1.0 if (id(e) in self._contributed if e.sharded else g is not None) else 0.0
            for e, g in zip(engine.entries, _all_full(engine, rep, full), strict=True)
        ]
        parts.append(torch.tensor(mine, dtype=torch.float32, device=engine.device))
        flat = torch.cat([t.to(torch.float32) for t in parts]).to(engine.reduce_dtype)
        del parts, full
        alone = engine.world == 1  # the sum is this rank's own: no collective, no host read
        if not alone:
            engine.comm.all_reduce(flat, ident=REPLICATED_IDENT)
        flat = flat.to(torch.float32)
        n_rep = flat.numel() - len(engine.entries)
        # fake tensors (the scale simulator) have no values: use this rank's own flags
        flags = flat[n_rep:].tolist() if host_readable(flat) and not alone else mine
        got = {id(e) for e, f in zip(engine.entries, flags, strict=True) if f > 0}
        grads = flat[:n_rep] if alone else flat[:n_rep].mul_(1.0 / engine.world)
        offset = 0
        for e in rep:
            n = e.master.numel()
            if id(e) in got:
                self._put_replicated(e, grads[offset : offset + n].view(e.master.shape))
            offset += n
            e.acc = None
            e.param.grad = None
        while self._pending:
            self._retire()
        for e in engine.sharded:
            if id(e) in self._fresh and id(e) not in got:
                # no rank had a gradient: none, as in one process
                self._set_acc(e, None, engine.accum_dtype != torch.float32)
                if id(e) in self._host_new:  # already copied to the host
                    e.master.grad = None
            if id(e) in self._host_fresh and id(e) not in got:
                e.host_has = False
        self._contributed.clear()
        self._fresh.clear()
        self._host_fresh.clear()
        self._host_new.clear()
        if engine.sync:  # the accumulation boundary: activations are gone
            self.materialize()


def _scaled(piece: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`piece * scale` in fp32, then in `dtype`, as a new accumulator: one pass where possible.

    At world 1, or averaged by the collective (`scale` 1), an fp32 piece is taken as it is (a
    view of its bucket's reduced buffer, which lives until its last piece is dropped);
    multiplying by 1 would copy it unchanged.
    """
    if scale == 1.0:
        return piece if piece.dtype == dtype else piece.to(dtype)
    if piece.dtype == torch.float32 and dtype == torch.float32:
        return piece * scale
    return piece.to(torch.float32, copy=True).mul_(scale).to(dtype)


def _full_grad(e: Entry) -> torch.Tensor | None:
    """A replicated parameter's unreduced gradient: its fp32 accumulator or (stage 1) `.grad`."""
    return e.acc if e.acc is not None else e.param.grad


def _all_full(
    engine: Shards, rep: list[Entry], full: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """`full` for the replicated entries, None for the sharded ones, in `engine.entries` order."""
    by_id = {id(e): g for e, g in zip(rep, full, strict=True)}
    return [by_id.get(id(e)) for e in engine.entries]


def _late(e: Entry) -> RuntimeError:
    return RuntimeError(
        f"shard-zero stage 3: the gradient of {e.name!r} arrived after its unit's backward "
        "was taken as over (the unit's parameters are used again after the forward of a later "
        "unit): its reduction has started without it. Put such a parameter outside the "
        "wrapped modules (`wrap_policy`) or use stage 2"
    )
