"""Calibration statistics of Linear inputs, collected with forward pre-hooks.

For each targeted `nn.Linear` with inputs X (tokens x in_features, all batches stacked):

* Wanda needs `‖X_j‖₂²` per input feature: `sumsq[j] = Σ_t X[t, j]²` (fp32).
* SparseGPT needs the Hessian of the layer-wise squared error, `H = 2 XᵀX / tokens` (fp32).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class InputStats:
    """Running input statistics of one Linear."""

    tokens: int = 0
    """Rows (tokens) seen."""
    sumsq: Tensor | None = None
    """(in_features,) Σ_t X[t, j]² in fp32."""
    xtx: Tensor | None = None
    """(in_features, in_features) Σ_t X[t]ᵀ X[t] in fp32 (only when the Hessian is wanted)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def hessian(self) -> Tensor:
        """`2 XᵀX / tokens` (fp32)."""
        if self.xtx is None or self.tokens == 0:
            raise ValueError("no calibration inputs reached this layer; check `calibration`")
        return self.xtx * (2.0 / self.tokens)


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def collect_input_stats(
    model: nn.Module,
    modules: Mapping[str, nn.Linear],
    calibration: Iterable[Mapping[str, Any]],
    *,
    hessian: bool,
) -> dict[str, InputStats]:
    """Run `model(**batch)` over `calibration` and accumulate input statistics of `modules`.

    Args:
        model: the model, called with each batch dict as keyword arguments.
        modules: qualified name -> Linear whose inputs are recorded.
        calibration: iterable of dicts of model kwargs (`input_ids`, `attention_mask`, ...).
        hessian: also accumulate XᵀX (in_features² fp32 per module).

    Returns:
        Qualified name -> statistics.

    Raises:
        ValueError: if `calibration` yields no batch or a batch is not a mapping.
    """
    stats = {name: InputStats() for name in modules}
    handles = []

    def make_hook(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            st = stats[name]
            st.tokens += x.shape[0]
            sq = x.square().sum(0)
            st.sumsq = sq if st.sumsq is None else st.sumsq + sq
            if hessian:
                xtx = x.T @ x
                st.xtx = xtx if st.xtx is None else st.xtx + xtx

        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(make_hook(name)))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    seen = 0
    try:
        for batch in calibration:
            if not isinstance(batch, Mapping):
                raise ValueError(
                    f"`calibration` must yield dicts of model kwargs, got {type(batch).__name__}"
                )
            model(**_to_device(batch, device))
            seen += 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if seen == 0:
        raise ValueError("`calibration` yielded no batch")
    return stats
