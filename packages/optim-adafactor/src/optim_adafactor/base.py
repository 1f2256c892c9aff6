"""`FactoredOptimizer`: the optimizer skeleton shared by `Adafactor` and optim-came's `CAME`.

Both optimizers step every parameter through phases (statistics, clip, update) that a
row-sharded parameter interleaves with bucketed all-reduces, on a PyTorch path or on fused
Triton kernels. Everything that does not depend on the algorithm lives here: the preparation
of the per-parameter record of a step (`StepWork`, with `stat_dtype` and `decay_`, defined in
`_work` and re-exported here), the step loop, the row-sharding registry and the bucketed
reduction of named partial sums; the `backend=` choice, the phase modules and the workspaces
come from `_dispatch.KernelDispatch`, lossless state from `_state.LosslessState`, option
checks from `checks`. Nothing here syncs with the host in `step()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from optim_adafactor._dispatch import BACKENDS, Backend, KernelDispatch
from optim_adafactor._stochastic import copy_stochastic_, copy_stochastic_seeded
from optim_adafactor._work import StepWork, decay_, stat_dtype
from optim_adafactor.checks import STEP, GroupCheck
from optim_adafactor.dtensor import local_tensor, localize
from optim_adafactor.sharding import Bucket, RowShard, make_row_shard

__all__ = ["BACKENDS", "Backend", "FactoredOptimizer", "StepWork", "decay_", "stat_dtype"]


class FactoredOptimizer(KernelDispatch):
    """Base class of `Adafactor` and `CAME`: everything but the algorithm's phases.

    Subclasses set `_torch_path` (the module of their PyTorch phases), return their fused
    phases' module from `_kernels` (imported there, on first use: it imports Triton) and implement
    `_parse_group`, `_init_state`, `_is_factored`, `_make_work`, `_step_local` and
    `_step_sharded`; they may return a multi-tensor module from `_multi` and refine
    `_step_fused`, `_fused_supported`, `_refresh_state`, `_state_dtype`,
    `_convert_loaded_state` and `_convert_loaded_group`. `_kernels`, `_multi`, `_chunked` and
    the rest of the dispatch to the kernels or PyTorch are `_dispatch.KernelDispatch`'s.
    """

    _torch_path: ClassVar[ModuleType]
    #: Batch the fused steps of 2-D matrices into multi-tensor launches, and (`Adafactor`) the
    #: PyTorch steps of torch semantics into `torch._foreach_*` ops (False: per tensor).
    multi_tensor: bool = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        backend: Backend,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"`backend` ({backend!r}) must be one of {BACKENDS}")
        self._parse_group(defaults, GroupCheck(first=True, defaults=True))  # fail early
        self.backend: Backend = backend
        self._row_shards: dict[Tensor, RowShard] = {}
        self._workspaces: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._multi_cache: dict[tuple[object, ...], Any] = {}  # multi-tensor tables
        #: Number of collectives the last `step()` issued (row-sharded parameters only).
        self.last_step_collectives = 0
        # Base seed of the stochastic rounding: drawn from torch's global CPU generator whose
        # state is then restored, so building the optimizer leaves the global random stream as
        # it was (dropout, data order), as HF's and torch's optimizers do. The same generator
        # state gives the same seed (two optimizers built with no draw between them share it).
        with torch.random.fork_rng(devices=[]):
            self._sr_seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ subclass interface
    def _parse_group(self, group: dict[str, Any], check: GroupCheck = STEP) -> Any:
        """Abstract (each optimizer implements it): the group's checked options."""
        raise NotImplementedError

    def _init_state(self, p: Tensor, state: dict[str, Any], opts: Any) -> None:
        """Abstract: fill a parameter's empty state (statistics, momentum) at its first step."""
        raise NotImplementedError

    def _is_factored(self, p: Tensor, opts: Any) -> bool:
        """Abstract: whether `p` keeps row/column statistics (the optimizer's own rule)."""
        raise NotImplementedError

    def _make_work(self, **common: Any) -> StepWork:
        """Abstract: the optimizer's `StepWork` subclass for one parameter's step."""
        raise NotImplementedError

    def _step_local(self, w: Any) -> None:
        """Abstract: the PyTorch-path step of one unsharded parameter."""
        raise NotImplementedError

    def _step_sharded(self, works: list[Any]) -> None:
        """Abstract: the step of row-sharded parameters (statistics reduced over the group)."""
        raise NotImplementedError

    def _step_fused(self, works: list[Any]) -> None:
        """Step the unsharded parameters of the fused path, after all others.

        With a `_multi` module (and `multi_tensor`), its `eligible` works are grouped by its
        `batch_key` (same options, step, dtypes, alignment) and each group is stepped by one
        set of multi-tensor launches (`step_batch`); the others one by one (`_step_local`).
        """
        multi = self._multi() if self.multi_tensor else None
        batches: dict[tuple[object, ...], list[Any]] = {}
        for w in works:
            if multi is not None and multi.eligible(w):
                batches.setdefault(multi.batch_key(w), []).append(w)
            else:
                self._step_local(w)
        for batch in batches.values():
            assert multi is not None
            multi.step_batch(self, batch, self._multi_cache)

    def _batches_locally(self, w: Any) -> bool:
        """Whether unsharded, unfused `w` waits for `_step_local_batch` (default: never)."""
        return False

    def _step_local_batch(self, works: list[Any]) -> None:
        """Step the unsharded, unfused works that `_batches_locally` held back, together."""
        for w in works:
            self._step_local(w)

    def _fused_supported(self, p: Tensor, opts: Any) -> bool:
        """Whether the kernels implement this parameter's step (beyond dim/layout/dtype)."""
        return True

    def _refresh_state(self, p: Tensor, state: dict[str, Any], opts: Any) -> None:
        """Adapt existing state to options changed in the group since it was created."""

    def _state_dtype(self, key: str, p: Tensor, opts: Any) -> torch.dtype:
        """Dtype of state tensor `key` of `p` (statistics: `stat_dtype(p)`)."""
        return stat_dtype(p)

    def _convert_loaded_state(self, state: dict[str, Any]) -> None:
        """Rename or reshape the entries of a loaded foreign state dict, in place."""

    def init_state(self) -> None:
        """Give every parameter without state the zero state its first step would create.

        Nothing is stepped (the step count stays 0). Used to have state tensors to load a
        checkpoint into before the first step (`dtensor.distributed_state_dict`).
        """
        for group in self.param_groups:
            opts = self._parse_group(group)
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(local_tensor(p), state, opts)

    # ------------------------------------------------------------------ groups and sharding
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its options are validated like the constructor's (else not added).

        The options it takes from the constructor's defaults are `GroupCheck.inherited`: an `lr`
        given to the constructor is not one this group asked for (HF lets such a group use the
        relative step).
        """
        inherited = frozenset(self.defaults) - frozenset(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._parse_group(group, GroupCheck(first=True, inherited=inherited))
            for p in group["params"]:
                if torch.is_complex(p):
                    raise TypeError(
                        f"{type(self).__name__} does not support complex parameters (got {p.dtype})"
                    )
        except (TypeError, ValueError) as err:
            self.param_groups.pop()
            index = len(self.param_groups)
            raise type(err)(f"param group {index}: {err}") from None

    def set_row_shard(
        self, param: Tensor, *, global_shape: Sequence[int], row_offset: int, group: Any = None
    ) -> None:
        """Declare `param` as rows `[row_offset, row_offset + len(param))` of `global_shape`.

        The statistics that span rows are then all-reduced over `group` (None: the default
        group), bucketed into a fixed number of collectives per group per step. Every rank of
        `group` must step the same sharded parameters (with gradients) in the same order.
        """
        self._row_shards[param] = make_row_shard(
            param, global_shape=global_shape, row_offset=row_offset, group=group
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_row_shards", {})
        self.__dict__.setdefault("_workspaces", {})
        self.__dict__.setdefault("_generators", {})
        self.__dict__.setdefault("_multi_cache", {})
        self.__dict__.setdefault("backend", "auto")
        self.__dict__.setdefault("last_step_collectives", 0)
        self.__dict__.setdefault("_sr_seed", 0)

    # ------------------------------------------------------------------ the step
    def _prepare(self, p: Tensor, opts: Any, index: int) -> StepWork:
        name = type(self).__name__
        grad = cast(Tensor, p.grad)
        if grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients")
        if grad.shape != p.shape:
            raise ValueError(
                f"gradient shape {tuple(grad.shape)} != parameter shape {tuple(p.shape)}"
            )
        state = self.state[p]  # keyed by the parameter; a DTensor's state is local (dtensor.py)
        p, grad, shard = localize(p, grad, self._row_shards)
        if len(state) == 0:
            self._init_state(p, state, opts)
        else:
            self._refresh_state(p, state, opts)
        state["step"] += 1
        factored = self._is_factored(p, opts)
        fused = self._use_triton(p, opts, factored) and (factored or shard is None)
        shape = shard.global_shape if shard is not None else tuple(p.shape)
        p32 = p
        if not fused:  # the PyTorch path computes in fp32 (float64) copies; kernels upcast
            dtype = stat_dtype(p)
            grad = grad if grad.dtype == dtype else grad.to(dtype)
            p32 = p if p.dtype == dtype else p.to(dtype)
        return self._make_work(
            param=p,
            p32=p32,
            grad=grad,
            state=state,
            opts=opts,
            step=state["step"],
            factored=factored,
            shard=shard,
            rows=shape[-2] if len(shape) >= 2 else 1,
            numel=max(1, math.prod(shape)),
            index=index,
            fused=fused,
        )

    def _write_back(self, w: StepWork) -> None:
        """Copy the PyTorch path's compute-dtype result into a bf16/fp16 parameter."""
        p = w.param
        if w.p32 is p:
            return
        if w.opts.stochastic_rounding and p.dtype == torch.bfloat16:
            # the noise is a function of (seed, step, index), as in the kernels: nothing but the
            # seed and the step counts has to be checkpointed for a resume to continue it exactly
            seed = self._kernel_seed(w)
            if torch.compiler.is_compiling():  # the same noise, through a custom op
                copy_stochastic_seeded(p, w.p32, seed)
                return
            copy_stochastic_(p, w.p32, generator=self._generator(p.device).manual_seed(seed))
        else:
            p.copy_(w.p32)

    @staticmethod
    def _reduce(bucket: Bucket, pairs: Sequence[tuple[StepWork, Mapping[str, Tensor]]]) -> None:
        """Sum each work's named tensors over its shard group; store the sums back by name.

        One collective per process group, whatever the number of works and names.
        """
        handles = [
            (w, {k: bucket.add(cast(RowShard, w.shard).group, t) for k, t in items.items()})
            for w, items in pairs
        ]
        bucket.all_reduce()
        for w, h in handles:
            for key, handle in h.items():
                setattr(w, key, bucket.get(handle).clone())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step (no host synchronisation; `group["lr"]` untouched)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_collectives = 0
        sharded: list[StepWork] = []
        fused: list[StepWork] = []
        batched: list[StepWork] = []
        index = 0
        for group in self.param_groups:
            opts = self._parse_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = self._prepare(p, opts, index)
                index += 1
                if w.shard is not None:
                    sharded.append(w)
                elif w.fused and p.numel() > 0:
                    fused.append(w)
                elif p.numel() > 0 and self._batches_locally(w):
                    batched.append(w)
                elif p.numel() > 0:
                    self._step_local(w)
        if batched:
            self._step_local_batch(batched)
        if fused:
            self._step_fused(fused)
        if sharded:
            self._step_sharded(sharded)
        return loss
