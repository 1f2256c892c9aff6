"""`Adafactor`: HF-compatible constructor and math, presets for torch/T2T, no host syncs."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from optim_adafactor import _foreach_path, _torch_path, quant
from optim_adafactor._options import GroupOptions, Semantics, parse_group
from optim_adafactor._torch_path import Work
from optim_adafactor.base import Backend, FactoredOptimizer, StepWork, stat_dtype
from optim_adafactor.checks import STEP, GroupCheck, Scalar
from optim_adafactor.dtensor import local_tensor
from optim_adafactor.sharding import Bucket

#: `torch.optim.Adafactor`'s param-group options and ours (`Adafactor.from_torch_args`).
TORCH_GROUP_KEYS = {"beta2_decay": "decay_rate", "d": "clip_threshold"}


class Adafactor(FactoredOptimizer):
    r"""Adafactor (Shazeer & Stern, 2018, arXiv:1804.04235) with the HF constructor and defaults.

    With the default `semantics="hf"` every step equals `transformers.optimization.Adafactor`'s
    (relative step, parameter-RMS scaling, update clipping by RMS, momentum on the lr-scaled
    update, factored second moment over the last two dims of every >=2-D parameter, full second
    moment for vectors). Unlike HF's, `step()` never synchronises with the host (HF's does
    with `scale_parameter=True`) and `load_state_dict` restores the fp32 statistics of bf16/fp16
    parameters bit-exact.

    For a parameter of shape (..., n, m) at step t (1-based), with `β2_t = 1 - t^decay_rate`:

    .. code-block:: text

        r = β2_t r + (1-β2_t) mean_j(g² + ε1)        c = β2_t c + (1-β2_t) mean_i(g² + ε1)
        u = g · rsqrt(r / mean(r)) ⊗ rsqrt(c)        û = u / max(1, RMS(u) / clip_threshold)
        lr_t = rho_t · max(ε2, RMS(p))  (scale_parameter)   rho_t = lr or min(1e-2, 1/√t)
        m = β1 m + (1-β1) lr_t û  (beta1 given)      p ← p - wd·lr_t·p - (m or lr_t û)

    Args:
        params: Parameters or param groups (dicts; every option below may be set per group).
        lr: External learning rate (a float, or a one-element tensor used without host sync);
            must be None with `relative_step=True` (HF rule).
        eps: `(ε1, ε2)`: ε1 is added to `g²`; ε2 floors the parameter RMS.
        clip_threshold: Update-clipping threshold `d` on RMS(u); None disables clipping.
        decay_rate: Exponent of `β2_t = 1 - t^decay_rate` (<= 0).
        beta1: Momentum coefficient, or None for no first moment (no `exp_avg` state).
        weight_decay: Decoupled weight decay, `p -= weight_decay · lr_t · p`.
        scale_parameter: Multiply the step size by `max(ε2, RMS(p))`.
        relative_step: Use the time-dependent step `min(1e-2, 1/√t)` instead of `lr`.
        warmup_init: With `relative_step`, use `min(1e-6·t, 1/√t)`.
        semantics: "hf" (default), "t2t" (paper / Tensor2Tensor: relative step only, x 0.05
            without parameter scaling, no weight decay, only 2-D tensors factored) or "torch"
            (`torch.optim.Adafactor`: lr caps rho_t, ε1 clamps instead of adding,
            `p *= 1 - lr·wd`, no momentum; see `Adafactor.from_torch_args`).
        backend: "auto" (Triton on CUDA when available, PyTorch elsewhere), "torch" or "triton".
        stochastic_rounding: Write bf16 parameters, and int8 `exp_avg` codes, with unbiased
            stochastic rounding.
        maximize: Ascend instead of descend.
        state_dtype: Storage of the momentum `exp_avg` (needs `beta1`): torch.float32
            (default) or torch.int8 (factored parameters: blockwise 8-bit codes plus one fp32
            scale per 128 elements of a row, see `optim_adafactor.quant`; unfactored ones keep
            fp32). Math and statistics stay fp32; the parameter steps by the fp32 momentum
            before it is quantized.
    """

    _torch_path: ClassVar[ModuleType] = _torch_path

    def _kernels(self) -> ModuleType:
        from optim_adafactor import _triton_path

        return _triton_path

    def _multi(self) -> ModuleType | None:
        from optim_adafactor import _multi_kernels

        return _multi_kernels

    def __init__(  # noqa: PLR0917 (HF's positional signature is the anchor)
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor | None = None,
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
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
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
            "state_dtype": state_dtype,
        }
        # lr_t of each parameter's last step: a value, or (table, row) of a multi-tensor step
        self._step_sizes: dict[Tensor, Scalar | tuple[Tensor, int]] = {}
        super().__init__(params, defaults, backend=backend)

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
        foreach: bool | None = None,
        maximize: bool = False,
        backend: Backend = "auto",
        stochastic_rounding: bool = False,
    ) -> Adafactor:
        """An `Adafactor` with `torch.optim.Adafactor`'s signature, defaults and semantics.

        `foreach=False` sets `multi_tensor = False` (one parameter at a time); None or True
        keep the default, the multi-tensor PyTorch step off the CPU.
        """
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"`foreach` must be a bool or None, got {foreach!r}")
        opt = cls(
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
        if foreach is False:
            opt.multi_tensor = False
        return opt

    # ------------------------------------------------------------------ FactoredOptimizer hooks
    def _parse_group(self, group: dict[str, Any], check: GroupCheck = STEP) -> GroupOptions:
        return parse_group(group, check)

    def _is_factored(self, p: Tensor, opts: GroupOptions) -> bool:
        """HF / torch factor every >= 2-D tensor; Tensor2Tensor factors only 2-D ones."""
        return p.dim() == 2 if opts.semantics == "t2t" else p.dim() >= 2

    def _fused_supported(self, p: Tensor, opts: GroupOptions) -> bool:
        return opts.semantics != "torch"

    def _chunked(self, w: StepWork) -> bool:
        """Torch semantics keeps `u` in a whole-tensor workspace from phase 3 to the update."""
        return w.factored and w.opts.semantics != "torch"

    def _batches_locally(self, w: Work) -> bool:
        """Torch semantics step unsharded tensors as `_foreach_path` batches (`multi_tensor`)."""
        return self.multi_tensor and w.opts.semantics == "torch" and _foreach_path.wanted(w)

    def _step_local_batch(self, works: list[Work]) -> None:
        batches: dict[tuple[object, ...], list[Work]] = {}
        for w in works:
            batches.setdefault(_foreach_path.batch_key(w), []).append(w)
        for batch in batches.values():
            stepped, lr_ts = _foreach_path.step(batch)
            for w, lr_t in zip(stepped, lr_ts, strict=True):
                self._step_sizes[w.param] = lr_t
                self._write_back(w)

    def _init_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        kw: dict[str, Any] = {"dtype": stat_dtype(p), "device": p.device}
        state["step"] = 0
        if opts.beta1 is not None:
            m_dtype = self._state_dtype("exp_avg", p, opts)
            state["exp_avg"] = torch.zeros(p.shape, dtype=m_dtype, device=p.device)
            if m_dtype == torch.int8:
                state["exp_avg_scale"] = torch.zeros(quant.scale_shape(p.shape), **kw)
        if self._is_factored(p, opts):
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], **kw)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], **kw)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **kw)

    def _state_dtype(self, key: str, p: Tensor, opts: GroupOptions) -> torch.dtype:
        """Statistics: fp32 (float64 for float64 params); `exp_avg`: int8 if asked and factored."""
        if key == "exp_avg" and opts.state_dtype == torch.int8 and self._is_factored(p, opts):
            return torch.int8
        return stat_dtype(p)

    def _refresh_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        """Momentum enabled later: a zero `exp_avg`; `state_dtype` changed: convert it."""
        if opts.beta1 is not None and "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(p.shape, dtype=stat_dtype(p), device=p.device)
        if "exp_avg" in state:
            quant.convert_(p, state, self._state_dtype("exp_avg", p, opts))

    def _adapt_loaded_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        """A loaded `exp_avg` in another form than the group's `state_dtype`: convert it."""
        if isinstance(state.get("exp_avg"), Tensor):
            quant.convert_(local_tensor(p), state, self._state_dtype("exp_avg", p, opts))

    def _convert_loaded_state(self, state: dict[str, Any]) -> None:
        """HF's and torch.optim.Adafactor's state dicts: drop / rename their own entries."""
        state.pop("RMS", None)  # HF's cached parameter RMS: recomputed every step
        if "row_var" in state:  # torch.optim.Adafactor keeps keepdim factors
            state["exp_avg_sq_row"] = state.pop("row_var").squeeze(-1)
            state["exp_avg_sq_col"] = state.pop("col_var").squeeze(-2)
        if "variance" in state:
            state["exp_avg_sq"] = state.pop("variance")

    def _convert_loaded_group(self, group: dict[str, Any]) -> None:
        """torch.optim.Adafactor's group options `beta2_decay` and `d`: our names for them.

        They are `decay_rate` and `clip_threshold` (`from_torch_args`); renamed, not filled in
        from the constructor, the resumed step uses the checkpoint's options as torch's does.
        A group that holds both names (a state dict saved after loading torch's one into an
        older version, which kept both) keeps ours, the values its steps used.
        """
        for theirs, ours in TORCH_GROUP_KEYS.items():
            if theirs in group:
                value = group.pop(theirs)
                group.setdefault(ours, value)

    def _make_work(self, **common: Any) -> StepWork:
        p, opts = common["param"], common["opts"]
        eps1 = opts.eps1 if opts.eps1 is not None else torch.finfo(p.dtype).eps
        w = Work(**common, eps1=eps1)
        if "exp_avg" in w.state:
            quant.prepare(self, w)
        return w

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_step_sizes", {})

    # ------------------------------------------------------------------ HF compatibility
    def _get_lr(self, param_group: dict[str, Any], param_state: dict[str, Any]) -> float:
        """The step size `lr_t` of the group's last step, as HF's `_get_lr`.

        HF's `AdafactorSchedule` reports it to the Trainer. It reads a device value: call it
        outside `step()`. A float step size (no parameter scaling) is recomputed from the group
        and the step count, as HF's is.
        """
        for p in param_group["params"]:
            key = local_tensor(p)  # the step runs on (and keys) a DTensor's local shard
            if self.state.get(p) is param_state and key in self._step_sizes:
                value = self._step_sizes[key]
                if isinstance(value, tuple):  # the multi-tensor step's per-matrix scalars
                    table, row = value
                    return float(table[row, 3].item())
                return float(value.item()) if isinstance(value, Tensor) else float(value)
        opts = self._parse_group(param_group)
        step = max(1, int(param_state.get("step", 0)))
        return float(opts.relative_step_size(step))

    # ------------------------------------------------------------------ the step
    def _apply(self, w: Work, usq: Tensor | None, *, u_in_buf: bool) -> None:
        if isinstance(w.lr_t, Tensor):
            self._step_sizes[w.param] = w.lr_t
        else:  # a float (no parameter scaling): `_get_lr` recomputes it, as HF's does. Kept,
            # it is an output of a compiled step, and inductor burnt a scheduled `lr` into that
            # output (step 3's, reported ever after) and recompiled once more for it
            self._step_sizes.pop(w.param, None)
        if w.fused:
            self._kernels().apply(w, usq, seed=self._kernel_seed(w))
            return
        _torch_path.apply(w, usq, cast(Tensor, self._buf(w)), u_in_buf=u_in_buf)
        self._write_back(w)

    def _step_local(self, w: Work) -> None:
        """All four phases for an unsharded parameter (no collectives)."""
        phases, buf = self._phases(w), self._buf(w)
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
        pairs: list[tuple[StepWork, dict[str, Tensor]]] = []
        for w in works:  # phase 1; reduce Σp², g² column sums and row-EMA sums
            self._phases(w).local_stats(w, self._buf(w))
            items = {} if w.psq is None else {"psq": w.psq}
            if w.reduce_factors:
                assert w.colsum is not None
                assert w.rowema_sum is not None
                items |= {"colsum": w.colsum, "rowema_sum": w.rowema_sum}
            pairs.append((w, items))
        self._reduce(bucket, pairs)
        pairs = []
        for w in works:  # phases 2-3; reduce Σu²
            _torch_path.finish_stats(w)
            if w.opts.clip_threshold is not None:
                usq = self._phases(w).update_sumsq(w, self._buf(w), gsq_in_buf=False)
                pairs.append((w, {"usq": usq}))
        self._reduce(bucket, pairs)
        for w in works:  # phase 4
            self._apply(w, w.usq, u_in_buf=False)
        self.last_step_collectives = bucket.collectives
