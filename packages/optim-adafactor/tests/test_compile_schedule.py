"""`torch.compile(opt.step)` with an LR scheduler that writes a float `lr` every step.

Before: once the scheduler had changed `group["lr"]`, dynamo made it a symbolic float; the
option check's `math.isfinite` on it broke the graph inside the step's loop, dynamo ran the step
eagerly and compiled its inner functions one by one (26-35 graphs over 12 steps), with the
step-varying floats (β2_t, lr) as graph inputs, and inductor kept a stale `alpha=` in
`avg.mul_(β).add_(x, alpha=1-β)`: `exp_avg_sq_col` up to 100% off, parameters 2e-3 off.
HF's `AdafactorSchedule` writes the step size into `lr` (ignored with the relative step) and
broke it the same way. Now the step stays one graph, and no step-varying float is an `alpha=`
under compile (`factored.compile_safe_scalars`).
"""

from functools import partial

import pytest
import torch
import transformers.optimization as hf_optimization

from leanlm_testing import optim_basics as basics
from optim_adafactor import Adafactor

STEPS = 12


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warmup over the test's steps: a new float `lr` at every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / STEPS)


CASES = {
    # what `Trainer(optim="adafactor")` builds (no parameter scaling: a float step size), with
    # momentum and weight decay (`decay_`, `add_scaled_` with a float lr)
    "trainer-lambdalr": (
        partial(Adafactor, lr=1e-2, relative_step=False, scale_parameter=False, beta1=0.9,
                weight_decay=0.1),
        warmup,
    ),
    "hf-defaults-adafactorschedule": (Adafactor, hf_optimization.AdafactorSchedule),
    "warmup-init-adafactorschedule": (
        partial(Adafactor, warmup_init=True, weight_decay=0.1),
        hf_optimization.AdafactorSchedule,
    ),
    "torch-semantics-lambdalr": (
        lambda ps: Adafactor.from_torch_args(ps, lr=1e-2, weight_decay=0.1),
        warmup,
    ),
}  # fmt: skip


@pytest.mark.parametrize(("make_opt", "scheduler"), list(CASES.values()), ids=list(CASES))
def test_compiled_step_with_a_float_lr_scheduler_equals_eager(make_opt, scheduler) -> None:
    """12 steps: 3 graphs; parameters and statistics within 1e-5 of the eager step."""
    basics.check_compiled_step(make_opt, steps=STEPS, max_graphs=3, scheduler=scheduler)


def test_compiled_int8_momentum_step_with_a_float_lr_scheduler_equals_eager() -> None:
    """The int8 momentum with a scheduled lr (its quantizer runs as a custom op under compile)."""
    make = partial(
        Adafactor, lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1,
        state_dtype=torch.int8,
    )  # fmt: skip
    basics.check_compiled_step(make, steps=STEPS, max_graphs=3, scheduler=warmup)


def test_a_scheduler_that_first_changes_lr_later_adds_one_graph() -> None:
    """`StepLR` keeps the lr for 5 steps: dynamo compiles it as a constant until it changes."""
    make = partial(Adafactor, lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1)
    basics.check_compiled_step(
        make,
        steps=STEPS,
        max_graphs=4,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    )


def test_get_lr_after_compiled_steps_is_the_lr_of_the_last_step() -> None:
    """Before, a float step size (no parameter scaling) was stored from inside the compiled
    step: inductor specialised that output on the lr of step 3 and reported it ever after."""
    import torch._dynamo

    torch._dynamo.reset()
    param = torch.randn(10, 6)
    opt = Adafactor([param], lr=1e-2, relative_step=False, scale_parameter=False)
    sched = warmup(opt)
    step = torch.compile(opt.step)
    reported, used = [], []
    for _ in range(8):
        param.grad = torch.randn(10, 6)
        used.append(opt.param_groups[0]["lr"])
        step()
        reported.append(opt._get_lr(opt.param_groups[0], opt.state[param]))
        sched.step()
    assert reported == used
