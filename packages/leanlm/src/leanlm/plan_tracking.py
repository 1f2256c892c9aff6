"""The plan's measuring tools: models built from a config, fake tensors, a phase-aware MemTracker.

Below `leanlm.plan` and `leanlm.plan_scoring`, which both measure with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def build(cfg: Any, dtype: torch.dtype) -> Any:
    """A causal LM from `cfg` in `dtype` (no KV cache)."""
    from transformers import AutoModelForCausalLM

    cfg.use_cache = False
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def checkpoint_dtype(cfg: Any) -> torch.dtype:
    """The dtype `cfg`'s checkpoint was saved in (fp32 when it does not say)."""
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def nbytes(tensors: Any) -> int:
    """Bytes of `tensors`' data."""
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """Fake tensors; transformers' attention masks as for the real windows.

    transformers checks on the host whether `position_ids` pack several sequences; on fake
    tensors it cannot, assumes they may and builds a (batch, 1, seq, seq) mask. The plan's
    windows are single sequences (0..seq-1), for which the real check says no and attention
    runs without a mask (SDPA's causal kernel): the check gives that answer here.
    """
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import masking_utils

    single = mock.patch.object(masking_utils, "find_packed_sequence_indices", return_value=None)
    with FakeTensorMode(allow_non_fake_inputs=True), single:
        yield


class _NoHandle:
    def remove(self) -> None:
        pass


_NO_HANDLE = _NoHandle()


def measure(step: Callable[[Any], None], tracked: list[Any]) -> dict[str, dict[str, int]]:
    """Run `step(tracker)` under a `MemTracker`; each phase's peak bytes by kind.

    `step` names the phase it is in with `tracker.phase = ...`.
    """
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    kinds = {
        "weights": (_MemRefType.PARAM,),
        "gradients": (_MemRefType.GRAD,),
        "optimizer_state": (_MemRefType.OPT,),
        "activations": (_MemRefType.ACT, _MemRefType.TEMP),
        "other": (_MemRefType.BUFFER, _MemRefType.OTH),
    }

    class PhaseTracker(MemTracker):  # type: ignore[no-untyped-call]
        """Keeps the largest snapshot of every phase (called after every op)."""

        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.peaks: dict[str, dict[str, int]] = {}

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            # a module called again in a forward (the calibration passes call each layer once
            # per batch) starts its per-module stats afresh: only the totals are read here
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module, None)  # type: ignore[no-untyped-call]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # (not MemTracker's per-module peaks, which deep-copy snapshots: unused here)
            snap = next(iter(self._curr_mem_snap.values()), None)
            best = self.peaks.get(self.phase, {}).get("total", -1)
            if snap is not None and snap[_TOTAL_KEY] > best:
                out = {name: sum(int(snap.get(k, 0)) for k in keys) for name, keys in kinds.items()}
                self.peaks[self.phase] = out | {"total": int(snap[_TOTAL_KEY])}

    tracker = PhaseTracker()
    tracker.track_external(*tracked)
    # MemTracker hooks every parameter's gradient; a frozen one (the teacher's) cannot take a
    # hook: mark those as hooked already, with handles that remove nothing
    for module in tracked:
        if isinstance(module, torch.nn.Module):
            for param in module.parameters():
                if not param.requires_grad:
                    tracker._param_to_grad_hook_handles[param] = (_NO_HANDLE, _NO_HANDLE)
    with tracker:
        step(tracker)
    return tracker.peaks
