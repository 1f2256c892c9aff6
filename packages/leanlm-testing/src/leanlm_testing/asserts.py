"""Tensor comparisons that explain themselves when they fail."""

from __future__ import annotations

import torch


def assert_verbose_allclose(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    name: str = "tensor",
    max_report: int = 5,
) -> None:
    """Assert `|actual - expected| <= atol + rtol * |expected|` elementwise, comparing in fp64.

    On failure the message gives the number of mismatches, the largest absolute and relative
    errors and the first `max_report` offending indices with both values, which is what one needs
    to tell a tolerance problem from a bug.

    Raises:
        AssertionError: if shapes differ or any element is outside the tolerance.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    diff = (a - e).abs()
    bad = (diff > atol + rtol * e.abs()) | nan_mismatch
    bad &= ~(torch.isnan(a) & torch.isnan(e))
    if not bool(bad.any()):
        return
    rel = diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    where = bad.nonzero()[:max_report]
    lines = []
    for index in where:
        at = tuple(index.tolist())
        lines.append(f"  at {at}: actual={a[at].item():.8g} expected={e[at].item():.8g}")
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {bad.numel()} elements differ beyond "
        f"atol={atol}, rtol={rtol}; max abs err {diff[bad].max().item():.3g}, "
        f"max rel err {rel[bad].max().item():.3g}\n" + "\n".join(lines)
    )


def update_error(
    init: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> float:
    """The worst norm-relative error of the training update over every tensor of a state dict.

    For each key: `‖(got - init) - (ref - init)‖ / ‖ref - init‖` in fp64 (`got` cast to `ref`'s
    dtype first), so the error is measured on what training changed, not on the weights, whose
    size would hide it. Returns the largest over the keys of `ref`.
    """
    worst = 0.0
    for key, final in ref.items():
        d_ref = (final - init[key]).double()
        d_got = (got[key].to(final.dtype) - init[key]).double()
        worst = max(worst, float((d_got - d_ref).norm() / d_ref.norm().clamp_min(1e-12)))
    return worst
