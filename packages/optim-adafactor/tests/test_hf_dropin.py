"""HF drop-in details: `AdafactorSchedule` (the proxy scheduler for `lr=None`) and tensor `lr`.

Both are compared with HF's own `Adafactor` (+ `AdafactorSchedule`) run on the same gradients,
and the tensor `lr` with the float `lr` (bit for bit: the same fp32 arithmetic).
"""

import functools
import math

import pytest
import torch
import transformers.optimization as hf_optimization

from leanlm_testing.optim import (
    assert_within_reference_error,
    check_tensor_lr_equals_float_lr,
    clone_params,
)
from optim_adafactor import Adafactor, _kernels

SHAPES = [(9, 7), (7,), (2, 3, 5)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    scale = 10.0 ** (torch.rand((), generator=gen).item() * 3 - 2)
    return [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in SHAPES]


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


BACKENDS = ["torch"]
if _kernels.available(torch.device("cpu")):  # the kernels under the Triton interpreter
    BACKENDS.append(pytest.param("triton", marks=pytest.mark.interpreter))

SCHEDULE_COMBOS = {
    "default": {},
    "warmup_init": {"warmup_init": True},
    "momentum_wd": {"beta1": 0.9, "weight_decay": 0.01},
    "groups": {},  # two param groups: one lr per group
}


def _groups(params: list[torch.Tensor], combo: str) -> list[dict]:
    kw = SCHEDULE_COMBOS[combo]
    if combo == "groups":
        return [{"params": params[:1]}, {"params": params[1:], "warmup_init": True}]
    return [{"params": params, **kw}]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", list(SCHEDULE_COMBOS))
def test_adafactor_schedule_reports_the_step_size_used(combo: str, backend: str) -> None:
    """`AdafactorSchedule` drives our optimizer as HF's; it reports the `lr_t` of each step."""
    steps = 12
    runs = {}
    ours_cls = functools.partial(Adafactor, backend=backend)
    for name, cls, dtype in [
        ("truth", hf_optimization.Adafactor, torch.float64),
        ("theirs", hf_optimization.Adafactor, torch.float32),
        ("ours", ours_cls, torch.float32),
    ]:
        params = [p.requires_grad_() for p in _params(dtype)]
        opt = cls(_groups(params, combo))
        sched = hf_optimization.AdafactorSchedule(opt)
        assert sched.get_last_lr() == [0.0] * len(opt.param_groups)  # initial_lr before a step
        reported, expected = [], []
        for t in range(1, steps + 1):
            for p, g in zip(params, _grads(t), strict=True):
                p.grad = g.to(dtype)
            # lr_t of each group's first parameter, from the HF formula on the pre-step weights
            want = []
            for group in opt.param_groups:
                first = group["params"][0]
                rho = min(1e-6 * t if group.get("warmup_init") else 1e-2, 1 / math.sqrt(t))
                rms = first.detach().double().square().mean().sqrt().item()
                want.append(rho * max(1e-3, rms))
            opt.step()
            sched.step()
            reported.append([float(x) for x in sched.get_last_lr()])
            expected.append(want)
            # the schedule writes the reported value into group["lr"]; the step ignores it
            assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr()
        runs[name] = (
            params,
            torch.tensor(reported, dtype=torch.float64),
            torch.tensor(expected, dtype=torch.float64),
        )
    ours, theirs, truth = runs["ours"], runs["theirs"], runs["truth"]
    # the reported lr is the step size the step used (fp32 RMS of the weights vs float64)
    torch.testing.assert_close(ours[1], ours[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=0)
    for i, (a, b, c) in enumerate(zip(ours[0], theirs[0], truth[0], strict=True)):
        assert_within_reference_error(a.detach(), b.detach(), c.detach(), name=f"param {i}")


def test_adafactor_schedule_changes_nothing_in_the_steps() -> None:
    """With the proxy schedule the weights equal a run without any scheduler, bit for bit."""
    pa, pb = clone_params(_params(torch.float32)), clone_params(_params(torch.float32))
    oa, ob = Adafactor(pa, beta1=0.9), Adafactor(pb, beta1=0.9)
    sched = hf_optimization.AdafactorSchedule(ob)
    for t in range(1, 8):
        for a, b, g in zip(pa, pb, _grads(t), strict=True):
            a.grad, b.grad = g.float(), g.float()
        oa.step()
        ob.step()
        sched.step()
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)


TENSOR_LR_COMBOS = {
    "plain": {"scale_parameter": False},
    "scaled": {"scale_parameter": True},
    "momentum_wd": {"scale_parameter": False, "beta1": 0.9, "weight_decay": 0.1},
    "scaled_momentum_wd_noclip": {"beta1": 0.5, "weight_decay": 0.01, "clip_threshold": None},
}


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", list(TENSOR_LR_COMBOS))
def test_tensor_lr_equals_float_lr(combo: str, backend: str, lr_dtype: torch.dtype) -> None:
    """`lr=torch.tensor(1e-3)` gives the float `lr=1e-3` result bit for bit, also scheduled.

    A float64 tensor too: 0-dim by 0-dim products would otherwise round once from float64.
    """
    kw = {"relative_step": False, "backend": backend, **TENSOR_LR_COMBOS[combo]}
    opt = check_tensor_lr_equals_float_lr(
        lambda ps, lr: Adafactor(ps, lr=lr, **kw), _params(torch.float32), _grads, steps=9,
        lr_dtype=lr_dtype,
    )  # fmt: skip
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 10, rel=1e-6)


def test_tensor_lr_matches_transformers_float_lr() -> None:
    """A tensor lr gives what HF's Adafactor computes with the same lr as a float."""
    kw = {"relative_step": False, "scale_parameter": True, "beta1": 0.9, "weight_decay": 0.01}
    truth = [p.requires_grad_() for p in _params(torch.float64)]
    theirs, ours = clone_params(_params(torch.float32)), clone_params(_params(torch.float32))
    opts = [
        hf_optimization.Adafactor(truth, lr=1e-3, **kw),
        hf_optimization.Adafactor(theirs, lr=1e-3, **kw),
        Adafactor(ours, lr=torch.tensor(1e-3), **kw),
    ]
    for t in range(1, 20):
        grads = _grads(t)
        for params in (truth, theirs, ours):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(p.dtype)
        for opt in opts:
            opt.step()
    for i, (a, b, c) in enumerate(zip(ours, theirs, truth, strict=True)):
        assert_within_reference_error(a.detach(), b.detach(), c.detach(), name=f"param {i}")


@pytest.mark.parametrize(
    "lr", [torch.tensor([1e-3, 2e-3]), torch.tensor(1, dtype=torch.int64), torch.tensor(-1e-3)]
)
def test_bad_tensor_lr_is_rejected_by_name(lr: torch.Tensor) -> None:
    with pytest.raises((TypeError, ValueError), match="`lr`"):
        Adafactor([torch.zeros(3, 3, requires_grad=True)], lr=lr, relative_step=False)
