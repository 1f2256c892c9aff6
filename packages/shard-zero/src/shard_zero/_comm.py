"""Collectives used by shard-zero: a version shim, counters, a timeout group and divergence checks.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single` (same arguments); older torch has only the former.
Every collective goes through `Comm`, which counts calls and bytes per kind so that tests and
benchmarks can check communication volume in code (gloo emulates reduce-scatter with all-reduce,
so CPU timings say nothing about volume).

Divergence (ranks that run different code, e.g. a rank that skips a stage-3 unit) would otherwise
pair unrelated collectives: silently wrong data when sizes match, a hang, or a gloo abort. `Comm`
keeps a rolling hash of the collectives issued since the last `step()` (kind, bytes, what they
carry). With `check_consistency`, every all-gather of a bucket or unit (`Gather`) prepends a
16-byte tag per rank, `(ident, rolling hash)`, compared on receipt (on CPU at once; on other
devices once per step, to avoid a host sync per gather); `check_step` broadcasts rank 0's count
and hash once per step. At world 1 there is no other rank: `Gather` neither tags nor communicates
(the payload is the result) and `check_step` does nothing. A failed or timed-out collective is
re-raised with the likely cause.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TAG_BYTES = 16  # (ident, rolling hash) as two int64 per rank
_HASH_MOD = 2**61 - 1
_KIND_IDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_MAX_DEFERRED = 64  # non-CPU devices: read the tags back at least every this many gathers

_CAUSE = (
    "the likely cause is that ranks ran different code: a rank skipped a wrapped module (stage 3) "
    "or ran a different number of forward/backward passes or optimizer steps, a parameter got a "
    "gradient on some ranks only, or another rank failed or is stuck (look for its error). Every "
    "rank must run the same modules in the same order"
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _averages(group: Any) -> bool:
    """Whether `group`'s backend has `ReduceOp.AVG` for reduce-scatter (gloo from torch 2.8).

    NCCL's AVG of floating-point values pre-multiplies by 1 / world; gloo's divides the sum.
    """
    backend = dist.get_backend(group)
    if backend == "gloo":
        return tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)
    return backend in ("nccl", "fake")


def host_readable(t: torch.Tensor) -> bool:
    """Whether `t` holds data the host can read (False for fake tensors: shapes only).

    Under `FakeTensorMode` (the scale simulator) every value read (`.tolist()`, `bool(t)`)
    raises; shard-zero's checks that read values skip themselves there.
    """
    return not is_fake(t)


def _timeout_group(group: Any, timeout: datetime.timedelta) -> Any:
    """A new process group over `group`'s ranks and backend with `timeout` (a collective)."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            "`timeout` is supported with the default process group only: `group` has "
            f"{dist.get_world_size(group)} of {dist.get_world_size()} ranks. Create that group "
            "with `torch.distributed.new_group(ranks, timeout=...)` and leave `timeout=None`"
        )
    return dist.new_group(timeout=timeout, backend=dist.get_backend(group))


def host_group(group: Any, device: torch.device, timeout: datetime.timedelta | None) -> Any:
    """The group for collectives on host tensors (`offload_optimizer`'s row-shard statistics).

    `group` itself when it can carry CPU tensors (gloo) or the model is not on CUDA; else a new
    gloo group over the same ranks (a collective over the default group).
    """
    if device.type != "cuda" or dist.get_backend(group) == "gloo":
        return group
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            "`offload_optimizer` (True) on CUDA with a non-gloo `group` of "
            f"{dist.get_world_size(group)} of {dist.get_world_size()} ranks is not supported: "
            "the host optimizer's collectives need a gloo group over the same ranks, which "
            "shard-zero creates for the default group only. Use the default group, or a gloo "
            "`group`, or `offload_optimizer=False`"
        )
    return dist.new_group(backend="gloo", timeout=timeout)


class Comm:
    """The process group plus per-kind counters of calls and bytes, and divergence checks.

    Bytes are counted as the size of the full (gathered / pre-scatter / reduced) buffer, i.e. the
    logical volume one rank contributes to and receives from, as in the ZeRO paper's 2Ψ / 3Ψ.

    Attributes:
        group: the process group every shard-zero collective runs on (a new one with `timeout`
            when it is set, else the group given to `prepare`).
        device: where communication buffers live (the model's device).
        check: whether all-gathers carry tags and `check_step` runs.
        names: `ident -> description` of what each ident'd collective carries (for messages).
    """

    def __init__(
        self,
        group: Any,
        *,
        device: torch.device,
        timeout: datetime.timedelta | None = None,
        check: bool = True,
    ) -> None:
        self.group = group if timeout is None else _timeout_group(group, timeout)
        self.timeout = timeout
        self.device = device
        self.check = check
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.averages = _averages(self.group)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.last_step: dict[str, dict[str, int]] = {}
        self.names: dict[int, str] = {}
        self.seq = 0  # rolling hash of the collectives issued since the last check_step
        self._issued = 0  # and how many
        self._deferred: list[tuple[int, int, torch.Tensor]] = []

    # ------------------------------------------------------------------ bookkeeping
    def count(self, kind: str, nbytes: int, ident: int) -> None:
        """Count one collective of `kind` and fold `(kind, ident, nbytes)` into the hash."""
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        code = (_KIND_IDS[kind] * 1_000_003 + ident) * 1_000_033 + nbytes
        self.seq = (self.seq * 1_000_000_007 + code) % _HASH_MOD
        self._issued += 1

    def clear_counts(self) -> None:
        """Forget the calls and bytes counted so far (the divergence hash is kept)."""
        self.calls.clear()
        self.bytes.clear()

    def name(self, ident: int) -> str:
        """What the collective `ident` carries, for messages."""
        return self.names.get(ident, f"collective #{ident}")

    def wait(self, work: Any, ident: int) -> None:
        """Wait for `work`, turning a failure (e.g. the timeout) into an error with its cause."""
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._failed(self.name(ident), exc) from exc

    def _failed(self, what: str, exc: BaseException) -> RuntimeError:
        limit = "" if self.timeout is None else f" (`ZeroConfig.timeout` {self.timeout})"
        return RuntimeError(
            f"shard-zero: the collective for {what} failed on rank {self.rank}{limit}: {exc}. "
            f"{_CAUSE}."
        )

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, ident: int) -> Any:
        """Start `out` (world * n,) <- concatenation of every rank's `inp` (n,), untagged."""
        self.count("all_gather", _nbytes(out), ident)
        return _all_gather(out, inp, group=self.group, async_op=True)

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, *, ident: int, average: bool = False
    ) -> Any:
        """Start `out` (n,) <- sum over ranks of this rank's chunk of `inp` (world * n,).

        With `average` (only where `self.averages`) the collective divides the sum by the
        world size itself (`ReduceOp.AVG`), as FSDP2 does: no separate pass over `out`.
        """
        self.count("reduce_scatter", _nbytes(inp), ident)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        return _reduce_scatter(out, inp, op=op, group=self.group, async_op=True)

    def all_reduce(self, t: torch.Tensor, *, ident: int, op: Any = None) -> None:
        """In-place all-reduce of `t` (SUM unless `op` is given), waited for."""
        self.count("all_reduce", _nbytes(t), ident)
        work = dist.all_reduce(
            t, op=dist.ReduceOp.SUM if op is None else op, group=self.group, async_op=True
        )
        self.wait(work, ident)

    # ------------------------------------------------------------------ divergence checks
    def check_tags(self, ident: int, seq: int, tags: torch.Tensor) -> None:
        """Compare gathered `(ident, hash)` tags (world, 2) with this rank's `(ident, seq)`."""
        if not host_readable(tags):
            return
        if tags.device.type == "cpu":
            self._raise_on_mismatch(ident, seq, tags)
            return
        self._deferred.append((ident, seq, tags))
        if len(self._deferred) >= _MAX_DEFERRED:
            self.flush_deferred()

    def flush_deferred(self) -> None:
        """Check the tags of gathers on a non-CPU device (one host transfer for all of them)."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        every = torch.stack([tags for _, _, tags in deferred]).cpu()
        for (ident, seq, _), tags in zip(deferred, every, strict=True):
            self._raise_on_mismatch(ident, seq, tags)

    def _raise_on_mismatch(self, ident: int, seq: int, tags: torch.Tensor) -> None:
        rows = tags.tolist()
        if all(row == [ident, seq] for row in rows):
            return
        for rank, (other, _) in enumerate(rows):
            if other != ident:
                raise RuntimeError(
                    f"shard-zero: ranks ran different modules: rank {rank} gathered "
                    f"{self.name(other)} while rank {self.rank} gathered {self.name(ident)}. "
                    f"{_CAUSE}."
                )
        rank = next(r for r, row in enumerate(rows) if row[1] != seq)
        raise RuntimeError(
            f"shard-zero: ranks ran different collectives before gathering {self.name(ident)}: "
            f"rank {rank}'s sequence since the last step differs from rank {self.rank}'s. "
            f"{_CAUSE}."
        )

    def check_step(self) -> None:
        """Raise if this rank issued other collectives than rank 0 since the last check."""
        self.flush_deferred()
        if not self.check or self.world_size == 1:  # no other rank to disagree with
            return
        mine = [self._issued, self.seq]
        t = torch.tensor(mine, dtype=torch.int64, device=self.device)
        self.calls["check"] += 1
        self.bytes["check"] += _nbytes(t)
        # a broadcast never pairs with an all-gather / reduce-scatter / all-reduce in gloo (it
        # times out instead of exchanging mismatched data), unlike an all-gather or all-reduce
        root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        try:
            dist.broadcast(t, src=root, group=self.group)
        except RuntimeError as exc:
            raise self._failed("the per-step consistency check", exc) from exc
        theirs = t.tolist() if host_readable(t) else mine
        if theirs != mine:
            same = " (as many, but different ones)" if theirs[0] == mine[0] else ""
            raise RuntimeError(
                f"shard-zero: ranks ran different code in this step: rank 0 issued {theirs[0]} "
                f"collectives since the last step and rank {self.rank} {mine[0]}{same}. "
                f"{_CAUSE}."
            )

    def end_step(self) -> None:
        """Snapshot the counters as `last_step` and reset them (called after each step)."""
        self.last_step = {
            kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in self.calls
        }
        self.calls.clear()
        self.bytes.clear()
        self.seq = 0
        self._issued = 0


class Gather:
    """An all-gather of one bucket / unit: (world, size) values of `dtype`, tagged when checking.

    Fill `payload` (size,), call `start()`, then `wait()` returns the gathered (world, size) view.
    """

    def __init__(self, comm: Comm, ident: int, size: int, dtype: torch.dtype) -> None:
        self.comm = comm
        self.ident = ident
        alone = comm.world_size == 1  # the payload is the result: no tags, no collective
        self.tag = _TAG_BYTES // dtype.itemsize if comm.check and not alone else 0
        # rows padded to whole tags, so that every rank's tag is int64-aligned
        self.row = self.tag + (-(-size // self.tag) * self.tag if self.tag else size)
        self.size = size
        self.out = torch.empty(comm.world_size * self.row, dtype=dtype, device=comm.device)
        # in place, as FSDP2: this rank's row of the output is the input (no send buffer)
        self.inp = self.out[comm.rank * self.row : (comm.rank + 1) * self.row]
        self.payload = self.inp[self.tag : self.tag + size]
        self.work: Any = None
        self.seq = 0

    def start(self) -> Gather:
        """Launch the all-gather (asynchronous; at world 1 nothing to do)."""
        comm = self.comm
        if comm.world_size == 1:
            return self
        comm.count("all_gather", _nbytes(self.out), self.ident)
        self.seq = comm.seq
        if self.tag:
            # scalar fills: no host-to-device copy (and so no host sync) on accelerators
            words = self.inp[: self.tag].view(torch.int64)
            words[0].fill_(self.ident)
            words[1].fill_(self.seq)
        self.work = _all_gather(self.out, self.inp, group=comm.group, async_op=True)
        return self

    def wait(self) -> torch.Tensor:
        """Finish the all-gather, check the tags and return the gathered (world, size) values."""
        if self.work is not None:
            self.comm.wait(self.work, self.ident)
        out2d = self.out.view(self.comm.world_size, -1)
        if self.tag:
            # a compact copy (never a view that would keep `out` alive while deferred)
            tags = out2d[:, : self.tag].reshape(-1).clone().view(torch.int64).view(-1, 2)
            self.comm.check_tags(self.ident, self.seq, tags)
        return out2d[:, self.tag : self.tag + self.size]
