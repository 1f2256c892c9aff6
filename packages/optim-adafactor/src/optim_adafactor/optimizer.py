"""`Adafactor`: HF-compatible constructor and math, presets for torch/T2T, no host syncs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from optim_adafactor import _torch_path
from optim_adafactor._options import BACKENDS, Backend, GroupOptions, Semantics, parse_group
from optim_adafactor._stochastic import copy_stochastic_
from optim_adafactor._torch_path import Work
from optim_adafactor.sharding import Bucket, RowShard, make_row_shard, row_shard_of

_STATE_KEYS = ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")


class Adafactor(Optimizer):
    r"""Adafactor (Shazeer & Stern, 2018, arXiv:1804.04235) with the HF constructor and defaults.

    With the default `semantics="hf"` every step equals `transformers.optimization.Adafactor`'s
    (relative step, parameter-RMS scaling, update clipping by RMS, momentum on the lr-scaled
    update, factored second moment over the last two dims of every >=2-D parameter, full second
    moment for vectors), minus its defects: `group["lr"]` is never written, `step()` makes no
    host synchronisation, and the state is fp32 whatever the parameter dtype.

    For a parameter of shape (..., n, m) at step t (1-based), with `β2_t = 1 - t^decay_rate`:

    .. code-block:: text

        r = β2_t r + (1-β2_t) mean_j(g² + ε1)        c = β2_t c + (1-β2_t) mean_i(g² + ε1)
        u = g · rsqrt(r / mean(r)) ⊗ rsqrt(c)        û = u / max(1, RMS(u) / clip_threshold)
        lr_t = rho_t · max(ε2, RMS(p))  (scale_parameter)   rho_t = lr or min(1e-2, 1/√t)
        m = β1 m + (1-β1) lr_t û  (beta1 given)      p ← p - wd·lr_t·p - (m or lr_t û)

    Args:
        params: Parameters or param groups (dicts; every option below may be set per group).
        lr: External learning rate; must be None with `relative_step=True` (HF rule).
        eps: `(ε1, ε2)`: ε1 is added to `g²`; ε2 floors the parameter RMS.
        clip_threshold: Update-clipping threshold `d` on RMS(u); None disables clipping.
        decay_rate: Exponent of `β2_t = 1 - t^decay_rate` (<= 0).
        beta1: Momentum coefficient, or None for no first moment (no `exp_avg` state).
        weight_decay: Decoupled weight decay, `p -= weight_decay · lr_t · p`.
        scale_parameter: Multiply the step size by `max(ε2, RMS(p))`.
        relative_step: Use the time-dependent step `min(1e-2, 1/√t)` instead of `lr`.
        warmup_init: With `relative_step`, use `min(1e-6·t, 1/√t)`.
        semantics: "hf" (default), "t2t" (paper / Tensor2Tensor: relative step only, x 0.05
            without parameter scaling, no weight decay) or "torch" (`torch.optim.Adafactor`: lr
            caps rho_t, ε1 clamps instead of adding, `p *= 1 - lr·wd`, no momentum; see
            `Adafactor.from_torch_args`).
        backend: "auto" (Triton on CUDA when available, PyTorch elsewhere), "torch" or "triton".
        stochastic_rounding: Write bf16 parameters with stochastic rounding (unbiased).
        maximize: Ascend instead of descend.
    """

    def __init__(  # noqa: PLR0917 (HF's positional signature is the anchor)
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        eps: tuple[float | None, float] = (1e-30, 1e-3),
        clip_threshold: float | None = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        *,
        semantics: Semantics = "hf",
        backend: Backend = "auto",
        stochastic_rounding: bool = False,
        maximize: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"`backend` ({backend!r}) must be one of {BACKENDS}")
        defaults: dict[str, Any] = {
            "lr": lr,
            "eps": eps,
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": relative_step,
            "warmup_init": warmup_init,
            "semantics": semantics,
            "stochastic_rounding": stochastic_rounding,
            "maximize": maximize,
        }
        parse_group(defaults)  # fail early, with the argument's name, on bad defaults
        self.backend: Backend = backend
        self._row_shards: dict[Tensor, RowShard] = {}
        self._workspaces: dict[torch.device, Tensor] = {}
        #: Number of collectives the last `step()` issued (row-sharded parameters only).
        self.last_step_collectives = 0
        # Base seed of the kernels' stochastic rounding (CPU generator: no device sync).
        self._sr_seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).item())
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_torch_args(  # noqa: PLR0917 (torch's positional signature is the anchor)
        cls,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        backend: Backend = "auto",
        stochastic_rounding: bool = False,
    ) -> Adafactor:
        """An `Adafactor` with `torch.optim.Adafactor`'s signature, defaults and semantics."""
        return cls(
            params,
            lr=lr,
            eps=eps,
            clip_threshold=d,
            decay_rate=beta2_decay,
            weight_decay=weight_decay,
            semantics="torch",
            backend=backend,
            stochastic_rounding=stochastic_rounding,
            maximize=maximize,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its options are validated like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        parse_group(group)
        for p in group["params"]:
            if torch.is_complex(p):
                raise TypeError("Adafactor does not support complex parameters")

    def set_row_shard(
        self, param: Tensor, *, global_shape: Sequence[int], row_offset: int, group: Any = None
    ) -> None:
        """Declare `param` as rows `[row_offset, row_offset + len(param))` of `global_shape`.

        The statistics that span rows (column means and the row-statistic mean of 2-D tensors,
        the update and parameter RMS) are then all-reduced over `group` (None: default group),
        bucketed into two collectives per group per step. Every rank of `group` must step the
        same sharded parameters (with gradients) in the same order.
        """
        self._row_shards[param] = make_row_shard(
            param, global_shape=global_shape, row_offset=row_offset, group=group
        )

    # ------------------------------------------------------------------ state handling
    def _init_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        kw: dict[str, Any] = {"dtype": torch.float32, "device": p.device}
        state["step"] = 0
        if opts.beta1 is not None:
            state["exp_avg"] = torch.zeros(p.shape, **kw)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], **kw)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], **kw)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **kw)

    def _normalise_state(self) -> None:
        """Bring loaded state (ours, HF's or torch's) to fp32 on the parameter's device."""
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            parse_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                state.pop("RMS", None)  # HF's cached parameter RMS: recomputed every step
                if "row_var" in state:  # torch.optim.Adafactor keeps keepdim factors
                    state["exp_avg_sq_row"] = state.pop("row_var").squeeze(-1)
                    state["exp_avg_sq_col"] = state.pop("col_var").squeeze(-2)
                if "variance" in state:
                    state["exp_avg_sq"] = state.pop("variance")
                step = state.get("step", 0)
                state["step"] = int(step.item()) if isinstance(step, Tensor) else int(step)
                for key in _STATE_KEYS:
                    if key in state:
                        state[key] = state[key].to(device=p.device, dtype=torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own, HF `Adafactor`'s or `torch.optim.Adafactor`'s state dict."""
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
    def _use_triton(self, p: Tensor, opts: GroupOptions) -> bool:
        """Fused kernels for factored (>=2-D, contiguous) params with hf/t2t semantics."""
        if self.backend == "torch":
            return False
        if self.backend == "auto" and p.device.type != "cuda":
            return False
        from optim_adafactor import _kernels

        if not _kernels.available(p.device):
            if self.backend == "triton":
                raise RuntimeError(
                    f"backend='triton' but Triton cannot run on {p.device} (install the "
                    "`triton` extra, use a CUDA device, or set TRITON_INTERPRET=1 for CPU)"
                )
            return False
        # Vectors, non-contiguous params and torch semantics take the PyTorch path.
        return p.dim() >= 2 and p.is_contiguous() and opts.semantics != "torch"

    def _prepare(self, p: Tensor, opts: GroupOptions, index: int, fused: bool) -> Work:
        grad = cast(Tensor, p.grad)
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")
        if grad.shape != p.shape:
            raise ValueError(
                f"gradient shape {tuple(grad.shape)} != parameter shape {tuple(p.shape)}"
            )
        state = self.state[p]
        if len(state) == 0:
            self._init_state(p, state, opts)
        elif opts.beta1 is not None and "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["step"] += 1
        shard = row_shard_of(p, self._row_shards)
        shape = shard.global_shape if shard is not None else tuple(p.shape)
        factored = p.dim() >= 2
        eps1 = opts.eps1 if opts.eps1 is not None else torch.finfo(p.dtype).eps
        if not fused:  # the PyTorch path computes in fp32 copies; the kernels upcast on load
            grad = grad if grad.dtype == torch.float32 else grad.float()
        return Work(
            param=p,
            p32=p if p.dtype == torch.float32 or fused else p.float(),
            grad=grad,
            state=state,
            opts=opts,
            step=state["step"],
            factored=factored,
            shard=shard,
            eps1=eps1,
            rows=shape[-2] if factored else 1,
            numel=max(1, _numel(shape)),
            index=index,
            fused=fused,
        )

    def _write_back(self, w: Work) -> None:
        p = w.param
        if w.p32 is p:
            return
        if w.opts.stochastic_rounding and p.dtype == torch.bfloat16:
            copy_stochastic_(p, w.p32)
        else:
            p.copy_(w.p32)

    def _phases(self, w: Work) -> Any:
        """The module implementing phases 1, 3 and 4 for `w` (kernels or PyTorch)."""
        if w.fused:
            from optim_adafactor import _kernels

            return _kernels
        return _torch_path

    def _apply(self, w: Work, usq: Tensor | None, *, u_in_buf: bool) -> None:
        phases = self._phases(w)
        buf = None if phases is not _torch_path else self._workspace(w.grad)
        if phases is _torch_path:
            _torch_path.apply(w, usq, cast(Tensor, buf), u_in_buf=u_in_buf)
        else:
            seed = (self._sr_seed + 1_000_003 * w.step + 7919 * w.index) % (2**31 - 1)
            phases.apply(w, usq, seed=seed)
        self._write_back(w)

    def _step_local(self, w: Work) -> None:
        """All four phases for an unsharded parameter (no collectives)."""
        phases = self._phases(w)
        buf = self._workspace(w.grad) if phases is _torch_path else None
        phases.local_stats(w, buf)
        _torch_path.finish_stats(w)
        usq = None
        if w.opts.clip_threshold is not None:
            usq = phases.update_sumsq(w, buf, gsq_in_buf=True)
        u_in_buf = usq is not None and (not w.factored or w.opts.semantics == "torch")
        self._apply(w, usq, u_in_buf=u_in_buf)

    def _step_sharded(self, works: list[Work]) -> None:
        """Phases with two bucketed all-reduces per process group for row-sharded parameters."""
        bucket = Bucket()
        handles: list[dict[str, tuple[int, int]]] = []
        for w in works:
            assert w.shard is not None
            phases = self._phases(w)
            phases.local_stats(w, self._workspace(w.grad) if phases is _torch_path else None)
            h: dict[str, tuple[int, int]] = {}
            if w.psq is not None:
                h["psq"] = bucket.add(w.shard.group, w.psq)
            if w.reduce_factors:
                assert w.colsum is not None
                assert w.rowema_sum is not None
                h["colsum"] = bucket.add(w.shard.group, w.colsum)
                h["rowema_sum"] = bucket.add(w.shard.group, w.rowema_sum)
            handles.append(h)
        bucket.all_reduce()
        clip_handles: list[tuple[int, int] | None] = []
        for w, h in zip(works, handles, strict=True):
            assert w.shard is not None
            for key, handle in h.items():
                setattr(w, key, bucket.get(handle).clone())
            _torch_path.finish_stats(w)
            if w.opts.clip_threshold is None:
                clip_handles.append(None)
                continue
            phases = self._phases(w)
            buf = self._workspace(w.grad) if phases is _torch_path else None
            usq = phases.update_sumsq(w, buf, gsq_in_buf=False)
            clip_handles.append(bucket.add(w.shard.group, usq))
        bucket.all_reduce()
        for w, ch in zip(works, clip_handles, strict=True):
            self._apply(w, None if ch is None else bucket.get(ch), u_in_buf=False)
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
                w = self._prepare(p, opts, index, fused=self._use_triton(p, opts))
                index += 1
                if w.shard is not None:
                    sharded.append(w)
                elif p.numel() > 0:
                    self._step_local(w)
        if sharded:
            self._step_sharded(sharded)
        return loss


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
