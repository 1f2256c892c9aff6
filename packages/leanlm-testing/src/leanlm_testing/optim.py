"""Helpers for optimizer tests: stepping, exact-resume checks and float64-yardstick parity."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

GradFn = Callable[[int, int, torch.Tensor], torch.Tensor]


def seeded_grad(step: int, index: int, p: torch.Tensor) -> torch.Tensor:
    """A fresh gradient for parameter `index` at `step`, in `p`'s dtype (deterministic)."""
    gen = torch.Generator().manual_seed(10_000 * step + index)
    scale = 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    return (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def run_steps(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    steps: range,
    grad_fn: GradFn = seeded_grad,
) -> None:
    """Set `grad_fn(step, index, p)` as every parameter's gradient and step, for each step."""
    for step in steps:
        for index, p in enumerate(params):
            p.grad = grad_fn(step, index, p)
        opt.step()


def clone_params(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf copies of `params` (same values, dtypes and devices)."""
    return [p.detach().clone().requires_grad_() for p in params]


def assert_same_state(
    a_opt: torch.optim.Optimizer,
    a_params: Sequence[torch.Tensor],
    b_opt: torch.optim.Optimizer,
    b_params: Sequence[torch.Tensor],
) -> None:
    """Parameters and every state entry equal bit for bit, with the same dtypes and keys."""
    for i, (a, b) in enumerate(zip(a_params, b_params, strict=True)):
        assert a.dtype == b.dtype, (i, a.dtype, b.dtype)
        assert torch.equal(a, b), f"param {i}: max diff {(a.double() - b.double()).abs().max()}"
        sa, sb = a_opt.state[a], b_opt.state[b]
        assert sa.keys() == sb.keys(), (i, sorted(sa), sorted(sb))
        for key, value in sa.items():
            other = sb[key]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype, (i, key, value.dtype, other.dtype)
                assert torch.equal(other, value), f"param {i} {key} differs"
            else:
                assert value == other, (i, key, value, other)


def through_file(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` after `torch.save` and `torch.load(weights_only=True)`, as a checkpoint."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


def check_exact_resume(
    make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    *,
    before: int = 6,
    after: int = 8,
    grad_fn: GradFn = seeded_grad,
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """Save, load into a fresh optimizer, go on: equal to the uninterrupted run bit for bit.

    Saves after `before` steps, loads into a fresh optimizer and parameters and goes on for
    `after` steps; parameters and every state entry must equal the uninterrupted run's.
    The state dict goes through `torch.save`/`torch.load` like a checkpoint.

    Returns the uninterrupted optimizer and parameters.
    """
    ref_params = clone_params(params)
    ref = make_opt(ref_params)
    run_steps(ref, ref_params, range(before), grad_fn)
    saved = through_file(copy.deepcopy(ref.state_dict()))
    resumed_params = clone_params(ref_params)
    resumed = make_opt(resumed_params)
    resumed.load_state_dict(saved)
    assert_same_state(ref, ref_params, resumed, resumed_params)  # the load itself is lossless
    run_steps(ref, ref_params, range(before, before + after), grad_fn)
    run_steps(resumed, resumed_params, range(before, before + after), grad_fn)
    assert_same_state(ref, ref_params, resumed, resumed_params)
    return ref, ref_params


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Max |actual - truth| / max |truth|, in float64."""
    scale = truth.double().abs().max().clamp_min(1e-300)
    return float((actual.double() - truth.double()).abs().max() / scale)


def assert_within_reference_error(
    ours: torch.Tensor,
    reference: torch.Tensor,
    truth: torch.Tensor,
    *,
    factor: float = 2.0,
    floor: float = 1e-7,
    name: str = "tensor",
) -> None:
    """Our error against `truth` is at most `factor` x the reference's own error.

    `truth` is a float64 run of the reference, `reference` its run at our precision; `floor`
    (about one fp32 ulp, relative) applies when the reference happens to be (almost) exact.
    """
    ours_err = relative_error(ours, truth)
    ref_err = relative_error(reference, truth)
    assert ours_err <= max(factor * ref_err, floor), (
        f"{name}: our error vs the float64 reference {ours_err:.3g} > {factor} x the "
        f"reference's own error {ref_err:.3g}"
    )


LOSSLESS_SHAPES = [(10, 6), (6,), (2, 3, 4), ()]  # matrix, vector, 3-D tensor, scalar


def lossless_params(dtype: torch.dtype) -> list[torch.Tensor]:
    """Seeded parameters of `LOSSLESS_SHAPES` in `dtype` (not yet leaves that need grads)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in LOSSLESS_SHAPES]


def check_lossless_resume(
    make_opt: Callable[..., torch.optim.Optimizer], dtype: torch.dtype
) -> None:
    """Exact resume on `lossless_params(dtype)`, with full-precision state.

    `check_exact_resume`; every state tensor then is float64 for float64 parameters and
    float32 otherwise, and not all zero (an fp16 cast would flush the statistics to zero).
    """
    opt, params = check_exact_resume(make_opt, lossless_params(dtype))
    want = torch.float64 if dtype == torch.float64 else torch.float32
    for p in params:
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == want, key
                assert value.abs().sum() > 0, key


def noisy_run(
    optimizer: Callable[..., torch.optim.Optimizer],
    dtype: torch.dtype,
    shape: tuple[int, ...],
    kw: dict[str, Any],
    steps: int = 300,
) -> torch.Tensor:
    """One parameter of `shape` in `dtype` after `steps` steps of `optimizer([p], **kw)`.

    The gradients are seeded float64 noise with row-varied scales, rounded to `dtype`.
    """
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    opt = optimizer([p], **kw)
    for _ in range(steps):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        g *= torch.rand(shape[:-1], generator=gen, dtype=torch.float64).add_(0.1).unsqueeze(-1)
        p.grad = g.to(dtype)
        opt.step()
    return p.detach()


def check_against_float64_reference(
    ours: Callable[..., torch.optim.Optimizer],
    reference: Callable[..., torch.optim.Optimizer],
    shape: tuple[int, ...],
    kw: dict[str, Any],
    name: str,
) -> None:
    """Ours in fp32 errs at most 2x the reference's fp32 run, against its float64 run.

    Runs are `noisy_run`s; ours in float64 must equal the reference's float64 run (relative
    1e-13: float64 state and math).
    """
    truth = noisy_run(reference, torch.float64, shape, kw)
    theirs = noisy_run(reference, torch.float32, shape, kw)
    mine = noisy_run(ours, torch.float32, shape, kw)
    assert_within_reference_error(mine, theirs, truth, factor=2.0, name=name)
    ours64 = noisy_run(ours, torch.float64, shape, kw)  # float64 state and math
    assert_within_reference_error(ours64, truth, truth, factor=0.0, floor=1e-13, name="f64")


def check_tensor_lr_equals_float_lr(
    make_opt: Callable[[list[torch.Tensor], float | torch.Tensor], torch.optim.Optimizer],
    init: Sequence[torch.Tensor],
    grads: Callable[[int], Sequence[torch.Tensor]],
    steps: int,
    lr_dtype: torch.dtype = torch.float32,
) -> torch.optim.Optimizer:
    """`make_opt(params, torch.tensor(1e-3, dtype=lr_dtype))` equals `make_opt(params, 1e-3)`.

    Both step `steps` times on fp32 copies of `grads(t)` (t = 1..steps); a `LambdaLR`
    (1 / (1 + t)) updates the tensor lr in place (`fill_`, in `lr_dtype`) and the float run is
    given the same values, bit for bit. Every parameter must have moved from `init`, and the
    parameters and every state entry must be equal. Returns the float-lr optimizer.
    """
    pa, pb = clone_params(init), clone_params(init)
    oa, ob = make_opt(pa, 1e-3), make_opt(pb, torch.tensor(1e-3, dtype=lr_dtype))
    sched = torch.optim.lr_scheduler.LambdaLR(ob, lambda t: 1 / (1 + t))
    for t in range(1, steps + 1):
        for a, b, g in zip(pa, pb, grads(t), strict=True):
            a.grad, b.grad = g.to(torch.float32, copy=True), g.to(torch.float32, copy=True)
        oa.step()
        ob.step()
        sched.step()
        assert isinstance(ob.param_groups[0]["lr"], torch.Tensor)
        oa.param_groups[0]["lr"] = float(ob.param_groups[0]["lr"])
    for a, b, p0 in zip(pa, pb, init, strict=True):
        assert not torch.equal(a, p0)
        assert torch.equal(a, b), (a - b).abs().max()
        for key, value in oa.state[a].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(ob.state[b][key], value), key
            else:
                assert ob.state[b][key] == value, key
    return oa


def check_sr_keeps_sub_ulp_updates(
    make: Callable[[list[torch.Tensor], bool], torch.optim.Optimizer],
    *,
    trials: int = 300,
    min_lost: float = 0.9,
    check_bias: bool = True,
) -> None:
    """Stochastic rounding of bf16 parameters keeps updates below half an ulp, in expectation.

    `make(params, stochastic_rounding)` builds the optimizer. One step of a (32, 48) bf16
    parameter in [1, 2) (ulp 2^-7) whose fp32 updates are all below half an ulp: round to
    nearest loses at least `min_lost` of them, while the mean of `trials` stochastically rounded
    steps (built after `torch.manual_seed(trial)`) equals the fp32 step within 6 sigma (each
    rounding error has variance <= ulp²/4).
    `check_bias`: also require round to nearest's error to exceed 3x the mean's (for updates
    large enough that the mean's sampling error is well below them).
    """
    gen = torch.Generator().manual_seed(0)
    p0 = (1.0 + torch.rand(32, 48, generator=gen)).bfloat16()
    g = torch.randn(32, 48, generator=gen).bfloat16().float()  # the same gradient in both dtypes

    def one_step(start: torch.Tensor, sr: bool) -> torch.Tensor:
        p = start.clone().requires_grad_()
        opt = make([p], sr)
        p.grad = g.to(p.dtype)
        opt.step()
        return p.detach().float()

    exact = one_step(p0.float(), False)  # the fp32 result the bf16 steps should average to
    assert (exact - p0.float()).abs().max() < 2**-8
    rtn = one_step(p0, False)
    steps = []
    for trial in range(trials):  # a seed per trial: the optimizer's noise follows torch's seed
        torch.manual_seed(trial)
        steps.append(one_step(p0, True))
    sr = torch.stack(steps)
    assert (sr.mean(0) - exact).abs().max() < 6 * 2**-7 / (2 * trials**0.5)
    assert (rtn == p0.float()).float().mean() >= min_lost
    if check_bias:
        assert (rtn - exact).abs().mean() > 3 * (sr.mean(0) - exact).abs().mean()
