"""Where a step's work runs: the backend choice, the phase modules and their scratch memory.

`KernelDispatch` (a base class of `base.FactoredOptimizer`) decides, per parameter, whether its
step runs on the fused Triton kernels or on the PyTorch path (`backend=`, the device, the
layout, `_fused_supported` and, for unfactored tensors, the multi-tensor module), hands out the
module implementing the phases of a `StepWork`, the reusable workspaces of the PyTorch path and
the stochastic-rounding seed of each step. Subclasses override `_kernels`, `_multi` and
`_chunked` here; the rest of the optimizer skeleton is in `base`.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from optim_adafactor._state import LosslessState
from optim_adafactor._work import StepWork
from optim_adafactor.factored import chunk_shape
from optim_adafactor.sharding import RowShard

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class KernelDispatch(LosslessState):
    """The fused-or-PyTorch choice, the phase modules and the workspaces of a step.

    `FactoredOptimizer` sets `backend`, `_row_shards`, `_workspaces` and `_sr_seed` in its
    constructor, and `_torch_path` and `multi_tensor` as class attributes; it provides
    `_fused_supported`.
    """

    _torch_path: ClassVar[ModuleType]
    multi_tensor: bool
    backend: Backend
    _row_shards: dict[Tensor, RowShard]
    _workspaces: dict[tuple[torch.device, torch.dtype, int], Tensor]

    if TYPE_CHECKING:

        def _fused_supported(self, p: Tensor, opts: Any) -> bool: ...

    def _kernel_seed(self, w: StepWork) -> int:
        """Seed of the stochastic rounding of `w` (a function of seed, step and index).

        The kernels and the PyTorch path both draw their noise from it (different generators,
        so their noise differs), which makes the noise reproducible from the state dict.
        """
        return (self._sr_seed + 1_000_003 * w.step + 7919 * w.index) % (2**31 - 1)

    def _workspace(
        self,
        like: Tensor,
        *,
        dtype: torch.dtype | None = None,
        slot: int = 0,
        shape: torch.Size | None = None,
    ) -> Tensor:
        """A reusable scratch buffer on `like`'s device (grown to the largest request).

        `dtype`: the buffer's (default: `like`'s); `slot`: which of several buffers of that
        device and dtype (a step that needs two at once asks for slots 0 and 1); `shape`: the
        view's (default: `like`'s).
        """
        dtype = like.dtype if dtype is None else dtype
        shape = like.shape if shape is None else shape
        numel = math.prod(shape)
        key = (like.device, dtype, slot)
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=like.device)
            self._workspaces[key] = buf
        return buf[:numel].view(shape)

    def _chunked(self, w: StepWork) -> bool:
        """Whether the PyTorch path runs `w`'s phases by chunks of rows (`factored.row_chunks`)."""
        return w.factored

    def _buf_shape(self, w: StepWork) -> torch.Size:
        """Shape of `w`'s PyTorch-path workspaces: one chunk of rows where it is chunked."""
        return chunk_shape(w.grad) if self._chunked(w) else w.grad.shape

    def _kernels(self) -> ModuleType:
        """The module of the fused phases (a subclass imports it here: it imports Triton)."""
        raise NotImplementedError

    def _multi(self) -> ModuleType | None:
        """The multi-tensor fused step's module, imported on first use, or None.

        It provides `eligible`, `batch_key`, `step_batch` and `fuse_vector`; without it the
        fused parameters step one by one.
        """
        return None

    def _phases(self, w: StepWork) -> Any:
        """The module implementing the element-wise phases of `w`: the kernels or PyTorch."""
        return self._kernels() if w.fused else self._torch_path

    def _buf(self, w: StepWork) -> Tensor | None:
        """The PyTorch path's workspace for `w` (None on the fused path)."""
        return None if w.fused else self._workspace(w.grad, shape=self._buf_shape(w))

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
        multi = self._multi() if self.multi_tensor else None
        if multi is None:
            return False
        from optim_adafactor.sharding import row_shard_of

        if (
            type(p) not in (Tensor, torch.nn.Parameter)
            or row_shard_of(p, self._row_shards) is not None
        ):
            return False
        return bool(multi.fuse_vector(p))
