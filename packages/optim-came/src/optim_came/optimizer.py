"""`CAME`: came-pytorch's constructor and math, no host syncs, fused kernels, row sharding."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any, ClassVar, cast

import torch
from torch import Tensor

from optim_adafactor import quant
from optim_adafactor.base import Backend, FactoredOptimizer, StepWork, stat_dtype
from optim_adafactor.checks import STEP, GroupCheck
from optim_adafactor.dtensor import local_tensor
from optim_adafactor.sharding import Bucket
from optim_came import _torch_path
from optim_came._options import GroupOptions, parse_group
from optim_came._torch_path import Work


class CAME(FactoredOptimizer):
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
        lr: Learning rate (required; >= 0; a float, or a one-element tensor used without host
            sync; None only when every param group gives its own). came-pytorch's README
            suggests 0.5-0.9x AdamW's.
        eps: `(ε1, ε2)`: added to `g²` and to the instability `(û - m)²`.
        clip_threshold: Update-clipping threshold `d` on RMS(u).
        betas: `(β1, β2, β3)`: momentum, second moment, instability.
        weight_decay: Decoupled weight decay, `p -= lr · weight_decay · p` before the update.
        bias_correction: Divide `r, c, v` by `1-β2^t` and (when zero-initialised) `R, C` by
            `1-β3^t`. Off in came-pytorch.
        instability_init: Initial value of `R` and `C` (came-pytorch: 0). 1.0 (yangluo7/CAME
            PR #6) removes the ~11·lr update spike of the first steps.
        state_dtype: storage of the first moment `exp_avg`: torch.float32 (default),
            torch.bfloat16 (2 bytes less per element) or torch.int8 (>= 2-D parameters:
            blockwise 8-bit codes plus one fp32 scale per 128 elements of a row, ~1.03 bytes
            per element, see `optim_adafactor.quant`; vectors keep fp32). Math and statistics
            stay fp32.
        stochastic_rounding: Write bf16 parameters, and int8 `exp_avg` codes, with unbiased
            stochastic rounding.
        backend: "auto" (Triton on CUDA when available, PyTorch elsewhere), "torch" or
            "triton" (also on CPU under TRITON_INTERPRET=1, for tests). Vectors and
            non-contiguous parameters always take the PyTorch path.
    """

    _torch_path: ClassVar[ModuleType] = _torch_path

    def _kernels(self) -> ModuleType:
        from optim_came import _kernels

        return _kernels

    def _multi(self) -> ModuleType | None:
        from optim_came import _multi_kernels

        return _multi_kernels

    def __init__(  # noqa: PLR0917 (came-pytorch's positional signature is the anchor)
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor | None,
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
        super().__init__(params, defaults, backend=backend)

    # ------------------------------------------------------------------ FactoredOptimizer hooks
    def _parse_group(self, group: dict[str, Any], check: GroupCheck = STEP) -> GroupOptions:
        return parse_group(group, check)

    def _is_factored(self, p: Tensor, opts: GroupOptions) -> bool:
        return p.dim() >= 2

    def _init_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        kw: dict[str, Any] = {"dtype": stat_dtype(p), "device": p.device}
        state["step"] = 0
        m_dtype = self._state_dtype("exp_avg", p, opts)
        state["exp_avg"] = torch.zeros(p.shape, dtype=m_dtype, device=p.device)
        if m_dtype == torch.int8:
            state["exp_avg_scale"] = torch.zeros(quant.scale_shape(p.shape), **kw)
        if p.dim() >= 2:
            rows, cols = p.shape[:-1], p.shape[:-2] + p.shape[-1:]
            state["exp_avg_sq_row"] = torch.zeros(rows, **kw)
            state["exp_avg_sq_col"] = torch.zeros(cols, **kw)
            state["exp_avg_res_row"] = torch.full(rows, opts.instability_init, **kw)
            state["exp_avg_res_col"] = torch.full(cols, opts.instability_init, **kw)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **kw)

    def _state_dtype(self, key: str, p: Tensor, opts: GroupOptions) -> torch.dtype:
        """Statistics: fp32 (float64 for float64 params); `exp_avg`: `state_dtype` if not fp32.

        int8 applies to >= 2-D parameters only (blocks inside rows); vectors keep fp32.
        """
        if key == "exp_avg" and opts.state_dtype == torch.bfloat16:
            return opts.state_dtype
        if key == "exp_avg" and opts.state_dtype == torch.int8 and p.dim() >= 2:
            return torch.int8
        return stat_dtype(p)

    def _refresh_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        """Convert `exp_avg` when `state_dtype` changed in the group (or in a loaded state)."""
        quant.convert_(p, state, self._state_dtype("exp_avg", p, opts))

    def _adapt_loaded_state(self, p: Tensor, state: dict[str, Any], opts: GroupOptions) -> None:
        """A loaded `exp_avg` in another form than the group's `state_dtype`: convert it."""
        if isinstance(state.get("exp_avg"), Tensor):
            self._refresh_state(local_tensor(p), state, opts)

    def _convert_loaded_state(self, state: dict[str, Any]) -> None:
        state.pop("RMS", None)  # came-pytorch's unused parameter RMS

    def _make_work(self, **common: Any) -> StepWork:
        w = Work(**common)
        quant.prepare(self, w)
        return w

    # ------------------------------------------------------------------ the step
    def _apply(self, w: Work) -> None:
        if w.fused:
            self._kernels().apply(w, seed=self._kernel_seed(w))
            return
        _torch_path.apply(w, cast(Tensor, self._buf(w)))
        self._write_back(w)

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
        pairs: list[tuple[Work, dict[str, Tensor]]] = []
        for w in works:  # phase 1; reduce g² column sums and row-EMA sums (2-D tensors)
            self._phases(w).grad_stats(w, self._buf(w))
            items = {}
            if w.reduce_factors:
                items = {"colsum": cast(Tensor, w.colsum), "rowema_sum": w.rowema_sum}
            pairs.append((w, cast(dict[str, Tensor], items)))
        self._reduce(bucket, pairs)
        usqs: list[tuple[Work, dict[str, Tensor]]] = []
        for w in works:  # phases 2-3; reduce Σ u²
            _torch_path.grad_factors(w)
            usq = self._phases(w).update_sumsq(w, self._buf(w), gsq_in_buf=False)
            usqs.append((w, {"clip": usq}))
        self._reduce(bucket, usqs)  # `w.clip`: the reduced Σ u² until phase 4 makes it the scale
        pairs = []
        for w in works:  # phase 4; reduce the instability column sums and row-EMA sums
            self._phases(w).momentum(w, cast(Tensor, w.clip), self._buf(w), u_in_buf=False)
            items = {}
            if w.reduce_factors:
                items = {"res_colsum": w.res_colsum, "res_rowema_sum": w.res_rowema_sum}
            pairs.append((w, cast(dict[str, Tensor], items)))
        self._reduce(bucket, pairs)
        for w in works:  # phases 5-6
            _torch_path.instability_factors(w)
            self._apply(w)
        self.last_step_collectives = bucket.collectives
