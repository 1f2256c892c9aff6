"""Calibration statistics of Linear inputs, collected with forward pre-hooks.

For each targeted `nn.Linear` with inputs X (tokens x in_features, all batches stacked):

* Wanda needs `‖X_j‖₂²` per input feature: `sumsq[j] = Σ_t X[t, j]²` (fp32).
* SparseGPT needs the Hessian of the layer-wise squared error, `H = 2 XᵀX / tokens` (fp32).

Padding is left out: when a batch has a 2-D `attention_mask` (batch, seq), a Linear whose input
is (batch, seq, features) contributes only the positions where the mask is nonzero, so a padded
batch gives the statistics of its sequences unpadded. Inputs of other shapes count every row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
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


@dataclass
class TokenMask:
    """The real positions of the batch being run, shared with the recording hooks."""

    current: Tensor | None = None
    """(batch, seq) bool (True = a real token), or None: every position counts."""


def real_tokens(batch: Mapping[str, Any]) -> Tensor | None:
    """(batch, seq) bool of the positions a 2-D `attention_mask` marks real, else None."""
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return mask != 0
    return None


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """`batch` with its tensors moved to `device`."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@contextmanager
def record_input_stats(
    modules: Mapping[str, nn.Module], *, hessian: bool, tokens: TokenMask | None = None
) -> Iterator[dict[str, InputStats]]:
    """Accumulate the input statistics of `modules` while the block runs (forward pre-hooks).

    Args:
        modules: qualified name -> Linear whose inputs are recorded.
        hessian: also accumulate XᵀX (in_features² fp32 per module).
        tokens: the real positions of the batch being run (set by the caller per batch); an
            input (batch, seq, features) of that mask's shape contributes those rows only.

    Yields:
        Qualified name -> statistics, filled by every forward call inside the block.
    """
    stats = {name: InputStats() for name in modules}

    def make_hook(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            real = None if tokens is None else tokens.current
            if real is not None and x.shape[:-1] == real.shape:
                x = x[real.to(x.device)]  # padded positions are not calibration data
            x = x.reshape(-1, x.shape[-1]).float()
            st = stats[name]
            st.tokens += x.shape[0]
            sq = x.square().sum(0)
            st.sumsq = sq if st.sumsq is None else st.sumsq + sq
            if hessian:  # in place after the first batch: no second in² temporary
                st.xtx = x.T @ x if st.xtx is None else st.xtx.addmm_(x.T, x)

        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in modules.items()]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def check_batch(batch: object) -> Mapping[str, Any]:
    """`batch` itself, or a ValueError when it is not a dict of model kwargs."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"`calibration` must yield dicts of model kwargs, got {type(batch).__name__}"
        )
    return batch


@torch.no_grad()
def collect_input_stats(
    model: nn.Module,
    modules: Mapping[str, nn.Linear],
    calibration: Iterable[Mapping[str, Any]],
    *,
    hessian: bool,
) -> dict[str, InputStats]:
    """Run `model(**batch)` over `calibration` and accumulate input statistics of `modules`.

    Every module's statistics are held at once (see `sequential.py` for one layer at a time).

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
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    seen = 0
    tokens = TokenMask()
    try:
        with record_input_stats(modules, hessian=hessian, tokens=tokens) as stats:
            for batch in calibration:
                kwargs = to_device(check_batch(batch), device)
                tokens.current = real_tokens(kwargs)
                model(**kwargs)
                seen += 1
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError("`calibration` yielded no batch")
    return stats
