"""Where the reducer stores gradients, and ZeRO-Offload's path to the host (`offload_optimizer`).

Without offload a sharded parameter's reduced gradient accumulates in `master.grad` (fp32, on
the device) or `low_acc` (bf16). With `offload_optimizer` the master is a host tensor: the fp32
device accumulator is `Entry.dev_grad` instead, and `_offload` copies the complete gradient
into the host `master.grad` (after adding the bf16 and host accumulators on the device, as
`Reducer.materialize` does without offload) and drops the device copy; on CUDA the copy runs on
a side stream (`Shards.to_host`), overlapped with the rest of backward. A gradient already on
the host that a later backward adds to is first copied back (`_device_grad`), so every sum runs
on the device, in the same order as without offload.
"""

from __future__ import annotations

import torch

from shard_zero._layout import Entry, local_rows
from shard_zero._shards import Shards


class OffloadGrads:
    """The `Reducer`'s gradient stores (a mixin: it sets `engine` and the sets below)."""

    engine: Shards
    _fresh: set[int]  # entries whose device accumulator this reduction created
    _host_new: set[int]  # offload: host gradients made of this reduction only
    _host_fresh: set[int]  # entries whose host rows this reduction started

    def _set_acc(self, e: Entry, acc: torch.Tensor | None, low: bool) -> None:
        """Store a sharded parameter's device accumulator (`low_acc`, `dev_grad`, `master.grad`).

        `low_acc` with a bf16 `accum_dtype`, else `dev_grad` with `offload_optimizer`.
        """
        if low:
            e.low_acc = acc
        elif self.engine.offload:
            e.dev_grad = acc
        else:
            e.master.grad = acc

    def _device_grad(self, e: Entry) -> torch.Tensor | None:
        """The fp32 gradient on the device: `master.grad`, or with offload `dev_grad`.

        With `offload_optimizer`, a gradient already on the host is first copied back to the
        device (and dropped there), so that what follows adds into it as without offload.
        """
        if not self.engine.offload:
            return e.master.grad
        if e.dev_grad is None and e.master.grad is not None:
            e.dev_grad = self.engine.from_host(e.master.grad)
            e.master.grad = None
        return e.dev_grad

    def _offload(self, e: Entry) -> None:
        """Copy `e`'s complete gradient into its host `master.grad` (`offload_optimizer`).

        Its bf16 and host accumulators are first added into its device gradient, as
        `materialize` does without offload; the device copy is then dropped.
        """
        engine = self.engine
        if id(e) in self._fresh and e.master.grad is None and not e.host_has:
            self._host_new.add(id(e))  # dropped again if no rank had a gradient (`_finish`)
        g = self._device_grad(e)
        if e.low_acc is not None:
            low, e.low_acc = e.low_acc, None
            g = low.to(torch.float32) if g is None else g.add_(low)
            del low
        if e.host_has and e.host_acc is not None:
            e.host_has = False
            part = e.host_acc.to(engine.device, torch.float32, non_blocking=True, copy=True)
            g = part if g is None else g.add_(part)
            del part
        e.dev_grad = None
        if g is None:
            return
        if e.host_grad is None:
            e.host_grad = engine.host_empty(e.master.shape, torch.float32)
        engine.to_host(e.host_grad, g)  # off the compute stream on CUDA
        e.master.grad = e.host_grad

    def _put_replicated(self, e: Entry, piece: torch.Tensor) -> None:
        """Add a replicated parameter's reduced gradient into its `master.grad`.

        With `offload_optimizer` the sum is formed on the device, then copied to the host.
        """
        if self.engine.offload:
            g = self._device_grad(e)
            self._set_acc(e, piece.clone() if g is None else g.add_(piece), False)
            self._offload(e)
        elif e.master.grad is None:
            e.master.grad = piece.clone()
        else:
            e.master.grad.add_(piece)

    def _add_on_host(
        self, e: Entry, piece: torch.Tensor, span: tuple[int, int], scale: float
    ) -> None:
        """`offload_accum`, a backward under `no_sync()`: add `piece * scale` into host rows.

        Every transfer is an asynchronous copy on the current stream (the host buffer is
        pinned on CUDA), ordered after the reduce-scatter it reads and before the next copy
        of the same rows; the host never reads the buffer itself, so nothing waits for it.
        """
        engine = self.engine
        if e.host_acc is None:
            e.host_acc = torch.empty(
                e.master.shape,
                dtype=engine.accum_dtype,
                device="cpu",
                pin_memory=engine.device.type == "cuda",
            )
        first, n = local_rows(e, span)
        rows = e.host_acc[first : first + n]
        if not e.host_has or id(e) in self._host_fresh:  # its first rows since the boundary
            e.host_has = True
            self._host_fresh.add(id(e))
            total = piece.to(torch.float32, copy=True)
            if scale != 1.0:
                total.mul_(scale)
        else:
            total = rows.to(engine.device, copy=True, non_blocking=True)
            total.add_(piece, alpha=scale)
        rows.copy_(total, non_blocking=True)  # one rounding to `accum_dtype`
