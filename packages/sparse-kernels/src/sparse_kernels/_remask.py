"""Re-masking a Linear whose weight a sharding engine may hold: read it whole, write it back.

A schedule that re-masks during training (`GradualPruning`) scores the current weights, so it
needs their full values. Two engines hold something else between steps:

* a ZeRO-3-style engine (shard-zero's stage 3, DeepSpeed's stage 3) leaves placeholders in the
  model outside forward (shard-zero: a stride-0 view of one NaN element per parameter; others:
  an empty or `meta` tensor, or a released storage). Scoring those would build a mask from NaN,
  and writing into them fails. `check_weight` refuses them before anything is changed.
* FSDP2 (`fully_shard`) keeps each parameter as a `DTensor` sharded over its mesh. That one is
  supported: `full_weight` gathers it (`full_tensor()`, a collective: every rank must call the
  schedule's `step()`, as the training loop does), and `set_mask_` zeroes each rank's own rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sparse_kernels.sparsify import apply_mask_, get_mask, stored_weight


def _dtensor_type() -> type | None:
    """`torch.distributed.tensor.DTensor`, or None in a torch built without distributed."""
    if not torch.distributed.is_available():  # pragma: no cover - every CI build has it
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _unmaterialised(weight: Tensor, shape: tuple[int, int]) -> str | None:
    """Why `weight` holds no real values (a placeholder), or None; `shape`: the Linear's."""
    if tuple(weight.shape) != shape:
        return f"has shape {tuple(weight.shape)}, not the Linear's {shape}"
    if weight.device.type == "meta":
        return "is on the meta device"
    if weight.numel() and weight.untyped_storage().nbytes() == 0:
        return "has no storage (released)"
    if any(st == 0 and n > 1 for st, n in zip(weight.stride(), weight.shape, strict=True)):
        return f"is a stride-0 view {tuple(weight.stride())} of its shape {tuple(weight.shape)}"
    if weight.numel() and weight.untyped_storage().nbytes() < weight.numel() * weight.itemsize:
        return "is backed by fewer elements than its shape holds"
    return None


def check_weight(owner: str, name: str, linear: nn.Module, step: int) -> None:
    """Raise unless `linear`'s stored weight can be scored and written as it is now.

    Raises:
        RuntimeError: naming `owner` (the schedule), `name` (the module) and `step`, when the
            weight is a placeholder (not materialised) or not finite; nothing has been changed.
    """
    weight = stored_weight(linear).detach()
    if _is_dtensor(weight):
        return  # FSDP2: `full_weight` gathers it
    assert isinstance(linear, nn.Linear)
    why = _unmaterialised(weight, (linear.out_features, linear.in_features))
    if why is None and not bool(torch.isfinite(weight).all()):
        why = "holds NaN or inf"
    if why is None:
        return
    raise RuntimeError(
        f"{owner}: cannot re-mask {name} at step {step}: its weight {why}, not the full "
        "trained values. A ZeRO-3-style engine (shard-zero's stage 3, DeepSpeed's stage 3) "
        "leaves such placeholders in the model outside forward: call `step()` where the full "
        "weights are present, on every rank, e.g. inside "
        "`with shard_zero.gathered(model, writeback=True): schedule.step()`; shard-zero "
        "stages 1-2 and FSDP2 need nothing. Nothing was changed (masks, weights and step "
        "counter are as before)"
    )


def full_weight(linear: nn.Module) -> Tensor:
    """The effective (masked) weight of `linear` in full: gathered when it is an FSDP2 DTensor."""
    weight = stored_weight(linear).detach()
    if _is_dtensor(weight):
        dtensor: Any = weight
        full: Tensor = dtensor.full_tensor()
        mask = get_mask(linear)
        return full if mask is None else full * mask.to(full.device)
    effective = linear.weight
    assert isinstance(effective, Tensor)
    return effective.detach()


@torch.no_grad()
def set_mask_(linear: nn.Linear, mask: Tensor) -> None:
    """`apply_mask_` that also handles an FSDP2-sharded (DTensor) weight with a mask attached."""
    weight = stored_weight(linear)
    current = get_mask(linear)
    if not _is_dtensor(weight) or current is None:
        apply_mask_(linear, mask)
        return
    from torch.distributed.tensor import distribute_tensor

    dtensor: Any = weight
    current.copy_(mask.to(device=current.device, dtype=torch.bool))
    # every rank holds the same full mask: each takes its own shard, no communication
    local_mask = distribute_tensor(
        current.to(weight.dtype),
        dtensor.device_mesh,
        dtensor.placements,
        src_data_rank=None,
    )
    weight.mul_(local_mask)
