"""`FactoredOptimizer`: the optimizer skeleton shared by `Adafactor` and optim-came's `CAME`.

Both optimizers step every parameter through phases (statistics, clip, update) that a
row-sharded parameter interleaves with bucketed all-reduces, on a PyTorch path or on fused
Triton kernels. This module holds everything that does not depend on the algorithm:

- option checks shared by the two `parse_group`s (`check_number`, `check_bool`, `check_lr`);
- the per-parameter record of a step in flight (`StepWork`), its construction (`_prepare`:
  gradient checks, state creation, compute dtype, row shard, path) and the step loop;
- the choice between the PyTorch path and the kernels (`backend=`);
- lossless state: statistics are kept in fp32 (float64 for float64 parameters) and
  `load_state_dict` restores them bit-exact, undoing `torch.optim.Optimizer`'s cast of every
  state tensor to the parameter's dtype;
- the stochastic-rounding randomness (a seed for the kernels and one `torch.Generator` per
  device for the PyTorch path), saved in and restored from the state dict;
- the row-sharding registry and the bucketed reduction of named partial sums.

Nothing here synchronises with the host inside `step()`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal, cast, get_args

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim_adafactor._stochastic import copy_stochastic_
from optim_adafactor.dtensor import localize
from optim_adafactor.sharding import Bucket, RowShard, make_row_shard

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)

#: Top-level state-dict key holding the stochastic-rounding seed and generator states.
RNG_STATE_KEY = "stochastic_rounding_rng"

Scalar = Tensor | float


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else a `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_number(name: str, value: object) -> float:
    """`value` as a finite float, else a `TypeError`/`ValueError` naming `name`."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"`{name}` ({number}) must be finite")
    return number


def check_lr(value: object, *, check_value: bool) -> Scalar:
    """A learning rate: a non-negative real number or a one-element floating-point tensor.

    A tensor is used as is (on its device, no host sync in `step()`); its value is checked only
    when `check_value` (at construction), because reading it synchronises with the device.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(
                f"`lr` as a tensor must hold one floating-point value, got shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        if check_value:
            number = float(value.detach().cpu().reshape(()).item())
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"`lr` ({number}) must be finite and >= 0")
        return value.reshape(())
    lr = check_number("lr", value)
    if lr < 0:
        raise ValueError(f"`lr` ({lr}) must be >= 0")
    return lr


def stat_dtype(param: Tensor) -> torch.dtype:
    """Dtype of the statistics and of the math: float64 for float64 params, else fp32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def decay_(p: Tensor, weight_decay: float, lr: Scalar) -> None:
    """`p ← p - weight_decay·lr·p` in the references' form (HF, came-pytorch).

    `p.add_(p, alpha=-wd·lr)` keeps the decay exact to fp32 rounding of the product; the form
    `p.mul_(1 - wd·lr)` rounds `1 - wd·lr` to fp32 (spacing 2^-24 below 1) and is off by up to
    0.3% near wd·lr = 1e-5, always in the same direction. A tensor `lr` stays on the device
    (no host sync).
    """
    if isinstance(lr, Tensor):
        p.addcmul_(p, lr.to(p.dtype) * -weight_decay)
    else:
        p.add_(p, alpha=-weight_decay * lr)


@dataclass(slots=True, kw_only=True)
class StepWork:
    """One parameter's step in flight: inputs, resolved constants and shared phase results."""

    param: Tensor
    p32: Tensor  # the parameter itself, or a copy in the compute dtype (bf16/fp16 params)
    grad: Tensor  # compute-dtype gradient on the PyTorch path; the raw gradient when fused
    state: dict[str, Any]
    opts: Any
    step: int
    factored: bool
    shard: RowShard | None
    rows: int  # global size of dim -2 (the column-mean divisor) of factored tensors
    numel: int  # global number of elements
    index: int  # position in the step (seeds stochastic rounding)
    fused: bool = False  # the phases run as Triton kernels
    colsum: Tensor | None = None
    rowema_sum: Tensor | None = None
    rf: Tensor | None = None
    cf: Tensor | None = None

    @property
    def reduce_factors(self) -> bool:
        """Whether column sums and row-EMA sums are reduced over the shard group (2-D only).

        For >= 3-D tensors dim 0 is a batch dim, so the factored dims are local to a rank.
        """
        return self.shard is not None and self.factored and self.param.dim() == 2


class FactoredOptimizer(Optimizer):
    """Base class of `Adafactor` and `CAME`: everything but the algorithm's phases.

    Subclasses set `_torch_path` (the module of their PyTorch phases) and `_kernels_module` (the
    dotted name of their fused phases' module, imported on first use) and implement
    `_parse_group`, `_init_state`, `_is_factored`, `_make_work`, `_step_local` and
    `_step_sharded`; they may refine `_step_fused`, `_fused_supported`, `_refresh_state`,
    `_state_dtype` and `_convert_loaded_state`.
    """

    _torch_path: ClassVar[ModuleType]
    _kernels_module: ClassVar[str]
    #: Module of the multi-tensor fused step (`eligible`, `batch_key`, `step_batch`), or None.
    _multi_module: ClassVar[str | None] = None
    #: Batch the fused steps of 2-D matrices into multi-tensor launches (False: per tensor).
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
        self._parse_group(defaults, first=True)  # fail early, naming the argument
        self.backend: Backend = backend
        self._row_shards: dict[Tensor, RowShard] = {}
        self._workspaces: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._multi_cache: dict[tuple[object, ...], Any] = {}  # multi-tensor tables
        #: Number of collectives the last `step()` issued (row-sharded parameters only).
        self.last_step_collectives = 0
        # Base seed of the stochastic rounding (drawn from torch's global CPU generator once).
        self._sr_seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ subclass interface
    def _parse_group(self, group: dict[str, Any], *, first: bool = False) -> Any:
        raise NotImplementedError

    def _init_state(self, p: Tensor, state: dict[str, Any], opts: Any) -> None:
        raise NotImplementedError

    def _is_factored(self, p: Tensor, opts: Any) -> bool:
        raise NotImplementedError

    def _make_work(self, **common: Any) -> StepWork:
        raise NotImplementedError

    def _step_local(self, w: Any) -> None:
        raise NotImplementedError

    def _step_sharded(self, works: list[Any]) -> None:
        raise NotImplementedError

    def _step_fused(self, works: list[Any]) -> None:
        """Step the unsharded parameters of the fused path, after all others.

        With a `_multi_module` (and `multi_tensor`), its `eligible` works are grouped by its
        `batch_key` (same options, step, dtypes, alignment) and each group is stepped by one
        set of multi-tensor launches (`step_batch`); the others one by one (`_step_local`).
        """
        multi = None
        if self._multi_module is not None and self.multi_tensor:
            multi = importlib.import_module(self._multi_module)
        batches: dict[tuple[object, ...], list[Any]] = {}
        for w in works:
            if multi is not None and multi.eligible(w):
                batches.setdefault(multi.batch_key(w), []).append(w)
            else:
                self._step_local(w)
        for batch in batches.values():
            assert multi is not None
            multi.step_batch(self, batch, self._multi_cache)

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

    # ------------------------------------------------------------------ groups and sharding
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its options are validated like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._parse_group(group, first=True)
        for p in group["params"]:
            if torch.is_complex(p):
                raise TypeError(
                    f"{type(self).__name__} does not support complex parameters (got {p.dtype})"
                )

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

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus the stochastic-rounding seed and generator states."""
        sd = super().state_dict()
        sd[RNG_STATE_KEY] = {
            "seed": self._sr_seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict without losing precision.

        `torch.optim.Optimizer.load_state_dict` casts every state tensor to its parameter's
        dtype (bf16/fp16 state loses bits; fp16 can flush small statistics to zero). The state
        tensors are therefore taken from `state_dict` as saved and converted once, to the
        dtypes `step()` keeps them in. The stochastic-rounding randomness is restored when the
        state dict carries it.
        """
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        saved_state = state_dict["state"]
        raw = {pid: dict(saved_state[pid]) for pid in saved_ids if pid in saved_state}
        super().load_state_dict(state_dict)  # validates the groups, fills self.state
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in raw:
                state = self.state[p]
                for key, value in raw[pid].items():
                    if isinstance(value, Tensor) and key != "step":
                        state[key] = value  # as saved: converted below, exactly once
        self._normalise_state()
        self._load_rng(state_dict.get(RNG_STATE_KEY))

    def _normalise_state(self) -> None:
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            opts = self._parse_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                self._convert_loaded_state(state)
                step = state.get("step", 0)
                state["step"] = int(step.item()) if isinstance(step, Tensor) else int(step)
                for key, value in state.items():
                    if isinstance(value, Tensor) and key != "step":
                        dtype = self._state_dtype(key, p, opts)
                        state[key] = value.to(device=p.device, dtype=dtype)

    def _load_rng(self, saved: dict[str, Any] | None) -> None:
        self._generators = {}
        if saved is None:
            return
        self._sr_seed = int(saved["seed"])
        for name, rng_state in saved.get("generators", {}).items():
            self._generator(torch.device(name)).set_state(rng_state.cpu())

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_row_shards", {})
        self.__dict__.setdefault("_workspaces", {})
        self.__dict__.setdefault("_generators", {})
        self.__dict__.setdefault("_multi_cache", {})
        self.__dict__.setdefault("backend", "auto")
        self.__dict__.setdefault("last_step_collectives", 0)
        self.__dict__.setdefault("_sr_seed", 0)

    # ------------------------------------------------------------------ resources
    def _generator(self, device: torch.device) -> torch.Generator:
        """This optimizer's generator for stochastic rounding on `device` (seeded lazily)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._sr_seed)
            self._generators[device] = gen
        return gen

    def _kernel_seed(self, w: StepWork) -> int:
        """Seed of the kernels' stochastic rounding for `w` (a function of seed, step, index)."""
        return (self._sr_seed + 1_000_003 * w.step + 7919 * w.index) % (2**31 - 1)

    def _workspace(self, like: Tensor) -> Tensor:
        """A reusable scratch buffer shaped like `like` (grown to the largest parameter)."""
        key = (like.device, like.dtype)
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(max(like.numel(), 1), dtype=like.dtype, device=like.device)
            self._workspaces[key] = buf
        return buf[: like.numel()].view(like.shape)

    def _kernels(self) -> ModuleType:
        return importlib.import_module(self._kernels_module)

    def _phases(self, w: StepWork) -> Any:
        """The module implementing the element-wise phases of `w`: the kernels or PyTorch."""
        return self._kernels() if w.fused else self._torch_path

    def _buf(self, w: StepWork) -> Tensor | None:
        """The PyTorch path's workspace for `w` (None on the fused path)."""
        return None if w.fused else self._workspace(w.grad)

    # ------------------------------------------------------------------ the step
    def _use_triton(self, p: Tensor, opts: Any, factored: bool) -> bool:
        """Fused kernels for factored, contiguous, non-float64 parameters (`backend` allowing).

        Unfactored parameters only where the multi-tensor module batches them (`_fuses_vector`).
        """
        if self.backend == "torch":
            return False
        if self.backend == "auto" and p.device.type != "cuda":
            return False
        if not self._kernels().available(p.device):
            if self.backend == "triton":
                raise RuntimeError(
                    f"backend='triton' but Triton cannot run on {p.device} (install the "
                    "`triton` extra, use a CUDA device, or set TRITON_INTERPRET=1 for CPU)"
                )
            return False
        if not factored:  # small unfactored tensors: the batched vector step, where there is one
            return self._fuses_vector(p) and self._fused_supported(p, opts)
        return (
            p.is_contiguous()
            and p.dtype != torch.float64  # the kernels accumulate in fp32
            and self._fused_supported(p, opts)
        )

    def _fuses_vector(self, p: Tensor) -> bool:
        """Whether the multi-tensor module steps unfactored `p` (`fuse_vector`; unsharded)."""
        if self._multi_module is None or not self.multi_tensor:
            return False
        from optim_adafactor.sharding import row_shard_of

        if (
            type(p) not in (Tensor, torch.nn.Parameter)
            or row_shard_of(p, self._row_shards) is not None
        ):
            return False
        multi = importlib.import_module(self._multi_module)
        return bool(multi.fuse_vector(p))

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
            copy_stochastic_(p, w.p32, generator=self._generator(p.device))
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
                elif p.numel() > 0:
                    self._step_local(w)
        if fused:
            self._step_fused(fused)
        if sharded:
            self._step_sharded(sharded)
        return loss
