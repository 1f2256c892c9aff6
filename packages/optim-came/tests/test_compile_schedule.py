"""`torch.compile(opt.step)` with an LR scheduler that writes a float `lr` every step.

Before: once the scheduler had changed `group["lr"]`, dynamo made it a symbolic float; the
option check's `math.isfinite` on it broke the graph inside the step's loop, dynamo ran the step
eagerly and compiled its inner functions one by one (30-37 graphs over 12 steps), and inductor
kept a stale `alpha=` where a step-varying float was also a tensor operand (`ema_`'s
`alpha=1-β`, `decay_`'s `alpha=-wd·lr`): with `bias_correction` the parameters were 6e-3 off
(updates up to 30%); with the int8 first moment dynamo crashed in some runs ("sources must not
be empty"). Now the step stays one graph, and no step-varying float is an `alpha=` under
compile (`optim_adafactor.factored.compile_safe_scalars`).
"""

from functools import partial

import pytest
import torch

from leanlm_testing import optim_basics as basics
from optim_came import CAME

STEPS = 12


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warmup over the test's steps: a new float `lr` at every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / STEPS)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"weight_decay": 0.1}, id="weight-decay"),
        pytest.param({"weight_decay": 0.1, "bias_correction": True}, id="bias-correction"),
        pytest.param(
            {"weight_decay": 0.1, "bias_correction": True, "instability_init": 1.0},
            id="instability-init",
        ),
    ],
)
def test_compiled_step_with_a_float_lr_scheduler_equals_eager(options) -> None:
    """12 steps: 3 graphs; parameters and statistics within 1e-5 of the eager step."""
    make = partial(CAME, lr=1e-2, **options)
    basics.check_compiled_step(make, steps=STEPS, max_graphs=3, scheduler=warmup)


def test_compiled_int8_state_step_with_a_float_lr_scheduler_equals_eager() -> None:
    """The int8 first moment with a scheduled lr (its quantizer runs as a custom op under
    compile); parameters and fp32 statistics and scales within 1e-5."""
    make = partial(CAME, lr=1e-2, weight_decay=0.1, state_dtype=torch.int8)
    basics.check_compiled_step(make, steps=STEPS, max_graphs=3, scheduler=warmup)


def test_cosine_schedule_to_zero() -> None:
    """A cosine schedule that reaches lr = 0 at the last step: no recompile, same result."""
    basics.check_compiled_step(
        partial(CAME, lr=1e-2, weight_decay=0.1),
        steps=STEPS,
        max_graphs=3,
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 1),
    )
