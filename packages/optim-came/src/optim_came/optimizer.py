"""`CAME`: came-pytorch's constructor and math, no host syncs, fused kernels, row sharding."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim_adafactor.factored import copy_stochastic_
from optim_adafactor.sharding import Bucket, RowShard, make_row_shard, row_shard_of
from optim_came import _torch_path
from optim_came._options import BACKENDS, Backend, GroupOptions, parse_group
from optim_came._torch_path import Work

_STAT_KEYS = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col")


class CAME(Optimizer):
    r"""CAME (Luo et al., ACL 2023, arXiv:2307.02047), a drop-in for `came_pytorch.CAME` 0.1.3.

    By default every step equals came-pytorch 0.1.3's: fixed betas, no bias correction,
    decoupled weight decay applied before the update, factored statistics over the last two dims
    of every >= 2-D parameter, and vectors/scalars without the confidence term. Unlike
    came-pytorch, `step()` never synchronises with the host, never computes the unused `RMS`
    state, and reads each parameter far fewer times.

    For a parameter of shape (..., n, m), with means over the last two dims:

    .. code-block:: text

        r = β2 r + (1-β2) mean_j(g² + ε1)        c = β2 c + (1-β2) mean_i(g² + ε1)
        u = g · rsqrt(r / mean(r)) ⊗ rsqrt(c)    û = u / max(1, RMS(u) / clip_threshold)
        m = β1 m + (1-β1) û                      U = (û - m)² + ε2
        R = β3 R + (1-β3) mean_j(U)              C = β3 C + (1-β3) mean_i(U)
        p ← p - lr·wd·p - lr · m · rsqrt(R / mean(R)) ⊗ rsqrt(C)

    Vectors: `v = β2 v + (1-β2)(g² + ε1)`, `u = g / √v`, the same clip and momentum, and
    `p ← p - lr·wd·p - lr·m`.

    Args:
        params: Parameters or param groups (every option but `backend` may be set per group).
        lr: Learning rate (required; >= 0). came-pytorch's README suggests 0.5-0.9x AdamW's.
        eps: `(ε1, ε2)`: added to `g²` and to the instability `(û - m)²`.
        clip_threshold: Update-clipping threshold `d` on RMS(u).
        betas: `(β1, β2, β3)`: momentum, second moment, instability.
        weight_decay: Decoupled weight decay, `p -= lr · weight_decay · p` before the update.
        bias_correction: Divide `r, c, v` by `1-β2^t` and (when zero-initialised) `R, C` by
            `1-β3^t`. Off in came-pytorch.
        instability_init: Initial value of `R` and `C` (came-pytorch: 0). 1.0 (yangluo7/CAME
            PR #6) removes the ~11·lr update spike of the first steps (research note §1.7).
        state_dtype: dtype of the first moment `exp_avg`: torch.float32 (default) or
            torch.bfloat16 (2 bytes less per element; math stays fp32). Statistics stay fp32.
        stochastic_rounding: Write bf16 parameters with unbiased stochastic rounding.
        backend: "auto" (Triton on CUDA when available, PyTorch elsewhere), "torch" or
            "triton" (also on CPU under TRITON_INTERPRET=1, for tests). Vectors and
            non-contiguous parameters always take the PyTorch path.
    """

    def __init__(  # noqa: PLR0917 (came-pytorch's positional signature is the anchor)
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = False,
        instability_init: float = 0.0,
        state_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = False,
        backend: Backend = "auto",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"`backend` ({backend!r}) must be one of {BACKENDS}")
        defaults: dict[str, Any] = {
            "lr": lr,
            "eps": eps,
            "clip_threshold": clip_threshold,
            "betas": betas,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "instability_init": instability_init,
            "state_dtype": state_dtype,
            "stochastic_rounding": stochastic_rounding,
        }
        parse_group(defaults)  # fail early, naming the argument, on bad defaults
        self.backend: Backend = backend
        self._row_shards: dict[Tensor, RowShard] = {}
        self._workspaces: dict[torch.device, Tensor] = {}
        #: Number of collectives the last `step()` issued (row-sharded parameters only).
        self.last_step_collectives = 0
        # Base seed of the kernels' stochastic rounding (CPU generator: no device sync).
        self._sr_seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its options are validated like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        parse_group(group)
        for p in group["params"]:
            if torch.is_complex(p):
                raise TypeError(f"CAME does not support complex parameters (got {p.dtype})")

    def set_row_shard(
        self, param: Tensor, *, global_shape: Sequence[int], row_offset: int, group: Any = None
    ) -> None:
        """Declare `param` as rows `[row_offset, row_offset + len(param))` of `global_shape`.

        This is optim-adafactor's row-sharding protocol (the `leanlm_row_shard` tensor attribute
        works too). Statistics spanning rows are all-reduced over `group` (None: the default
        group) in three bucketed collectives per group per step: the `g²` column sums and row-EMA
        sums, `Σ u²` (the clip), and the instability column sums and row-EMA sums. Every rank of
        `group` must step the same sharded parameters (with gradients) in the same order.
        """
        self._row_shards[param] = make_row_shard(
            param, global_shape=global_shape, row_offset=row_offset, group=group
        )

    # ------------------------------------------------------------------ state handling
    def _init_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        f32: dict[str, Any] = {"dtype": torch.float32, "device": p.device}
        state["step"] = 0
        state["exp_avg"] = torch.zeros(p.shape, dtype=opts.state_dtype, device=p.device)
        if p.dim() >= 2:
            rows, cols = p.shape[:-1], p.shape[:-2] + p.shape[-1:]
            state["exp_avg_sq_row"] = torch.zeros(rows, **f32)
            state["exp_avg_sq_col"] = torch.zeros(cols, **f32)
            state["exp_avg_res_row"] = torch.full(rows, opts.instability_init, **f32)
            state["exp_avg_res_col"] = torch.full(cols, opts.instability_init, **f32)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **f32)

    def _normalise_state(self) -> None:
        """Bring loaded state (ours or came-pytorch's) to our dtypes on the parameter's device."""
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            opts = parse_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                state.pop("RMS", None)  # came-pytorch's unused parameter RMS
                step = state.get("step", 0)
                state["step"] = int(step.item()) if isinstance(step, Tensor) else int(step)
                kw: dict[str, Any] = {"device": p.device}
                for key in (*_STAT_KEYS, "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(dtype=torch.float32, **kw)
                if "exp_avg" in state:
                    state["exp_avg"] = state["exp_avg"].to(dtype=opts.state_dtype, **kw)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own or a `came_pytorch.CAME` state dict (its `RMS` entries are dropped)."""
        super().load_state_dict(state_dict)
        self._normalise_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_row_shards", {})
        self.__dict__.setdefault("_workspaces", {})
        self.__dict__.setdefault("backend", "auto")
        self.__dict__.setdefault("last_step_collectives", 0)
        self.__dict__.setdefault("_sr_seed", 0)

    def _workspace(self, like: Tensor) -> Tensor:
        """A reusable fp32 scratch buffer shaped like `like` (grown to the largest parameter)."""
        buf = self._workspaces.get(like.device)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(max(like.numel(), 1), dtype=torch.float32, device=like.device)
            self._workspaces[like.device] = buf
        return buf[: like.numel()].view(like.shape)

    # ------------------------------------------------------------------ the step
    def _use_triton(self, p: Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "auto" and p.device.type != "cuda":
            return False
        from optim_came import _kernels

        if not _kernels.available(p.device):
            if self.backend == "triton":
                raise RuntimeError(
                    f"backend='triton' but Triton cannot run on {p.device} (install the "
                    "`triton` extra, use a CUDA device, or set TRITON_INTERPRET=1 for CPU)"
                )
            return False
        return p.dim() >= 2 and p.is_contiguous()

    def _prepare(self, p: Tensor, opts: GroupOptions, index: int) -> Work:
        grad = cast(Tensor, p.grad)
        if grad.is_sparse:
            raise RuntimeError("CAME does not support sparse gradients")
        if grad.shape != p.shape:
            raise ValueError(
                f"gradient shape {tuple(grad.shape)} != parameter shape {tuple(p.shape)}"
            )
        state = self.state[p]
        if len(state) == 0:
            self._init_state(p, state, opts)
        elif state["exp_avg"].dtype != opts.state_dtype:  # `state_dtype` changed in the group
            state["exp_avg"] = state["exp_avg"].to(opts.state_dtype)
        state["step"] += 1
        fused = self._use_triton(p)
        shard = row_shard_of(p, self._row_shards)
        shape = shard.global_shape if shard is not None else tuple(p.shape)
        if not fused:  # the PyTorch path computes in fp32; the kernels upcast on load
            grad = grad if grad.dtype == torch.float32 else grad.float()
        return Work(
            param=p,
            p32=p if p.dtype == torch.float32 or fused else p.float(),
            grad=grad,
            state=state,
            opts=opts,
            step=state["step"],
            shard=shard,
            rows=shape[-2] if len(shape) >= 2 else 1,
            numel=max(1, math.prod(shape)),
            index=index,
            fused=fused,
        )

    def _phases(self, w: Work) -> Any:
        """The module implementing phases 1, 3, 4 and 6 for `w` (kernels or PyTorch)."""
        if w.fused:
            from optim_came import _kernels

            return _kernels
        return _torch_path

    def _buf(self, w: Work) -> Tensor | None:
        return None if w.fused else self._workspace(w.grad)

    def _apply(self, w: Work) -> None:
        if w.fused:
            from optim_came import _kernels

            seed = (self._sr_seed + 1_000_003 * w.step + 7919 * w.index) % (2**31 - 1)
            _kernels.apply(w, seed=seed)
            return
        _torch_path.apply(w, self._workspace(w.grad))
        p = w.param
        if w.p32 is not p:
            if w.opts.stochastic_rounding and p.dtype == torch.bfloat16:
                copy_stochastic_(p, w.p32)
            else:
                p.copy_(w.p32)

    def _step_local(self, w: Work) -> None:
        """All six phases for an unsharded parameter (no collectives)."""
        phases, buf = self._phases(w), self._buf(w)
        phases.grad_stats(w, buf)
        _torch_path.grad_factors(w)
        usq = phases.update_sumsq(w, buf, gsq_in_buf=True)
        phases.momentum(w, usq, buf, u_in_buf=True)
        _torch_path.instability_factors(w)
        self._apply(w)

    def _step_sharded(self, works: list[Work]) -> None:
        """The phases of row-sharded parameters, with 3 bucketed all-reduces per process group."""
        bucket = Bucket()

        def reduce(pairs: list[tuple[Work, dict[str, Tensor]]]) -> None:
            handles = [
                (w, {k: bucket.add(cast(RowShard, w.shard).group, t) for k, t in items.items()})
                for w, items in pairs
            ]
            bucket.all_reduce()
            for w, h in handles:
                for key, handle in h.items():
                    setattr(w, key, bucket.get(handle).clone())

        pairs: list[tuple[Work, dict[str, Tensor]]] = []
        for w in works:  # phase 1; reduce g² column sums and row-EMA sums (2-D tensors)
            self._phases(w).grad_stats(w, self._buf(w))
            items = {}
            if w.reduce_factors:
                items = {"colsum": cast(Tensor, w.colsum), "rowema_sum": w.rowema_sum}
            pairs.append((w, cast(dict[str, Tensor], items)))
        reduce(pairs)
        usqs: list[tuple[Work, dict[str, Tensor]]] = []
        for w in works:  # phases 2-3; reduce Σ u²
            _torch_path.grad_factors(w)
            usq = self._phases(w).update_sumsq(w, self._buf(w), gsq_in_buf=False)
            usqs.append((w, {"clip": usq}))
        reduce(usqs)  # `w.clip` holds the reduced Σ u² until phase 4 turns it into the scale
        pairs = []
        for w in works:  # phase 4; reduce the instability column sums and row-EMA sums
            self._phases(w).momentum(w, cast(Tensor, w.clip), self._buf(w), u_in_buf=False)
            items = {}
            if w.reduce_factors:
                items = {"res_colsum": w.res_colsum, "res_rowema_sum": w.res_rowema_sum}
            pairs.append((w, cast(dict[str, Tensor], items)))
        reduce(pairs)
        for w in works:  # phases 5-6
            _torch_path.instability_factors(w)
            self._apply(w)
        self.last_step_collectives = bucket.collectives

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step (no host synchronisation; `group["lr"]` untouched)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_collectives = 0
        sharded: list[Work] = []
        index = 0
        for group in self.param_groups:
            opts = parse_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = self._prepare(p, opts, index)
                index += 1
                if w.shard is not None:
                    sharded.append(w)
                elif p.numel() > 0:
                    self._step_local(w)
        if sharded:
            self._step_sharded(sharded)
        return loss
