"""The launch plan of the fused CAME step, and a batch stepped in groups.

The plan (`optim_adafactor.multi_tensor.plan_launches`) must list the kernels and grids a real
(interpreter) step launches; a batch split into groups to bound the scratch must step exactly
as one launch set does, and match the PyTorch path.
"""

from __future__ import annotations

import pytest

from leanlm_testing import multi_tensor as mtt
from leanlm_testing.kernels import fused_kernel_marks
from optim_adafactor.multi_tensor import plan_launches
from optim_came import CAME, _kernels

pytestmark = fused_kernel_marks(_kernels, mtt.device())

KW = {"lr": 1e-2, "weight_decay": 0.01}


def _make(params):
    return CAME(params, backend="triton", **KW)


def _modules():
    from optim_adafactor import _kernels as af_kernels
    from optim_adafactor import _multi_kernels as af_multi
    from optim_came import _multi_kernels, _multi_vec_kernels

    return [_multi_kernels, _multi_vec_kernels, af_multi, af_kernels, _kernels]


def test_plan_is_what_the_step_launches() -> None:
    shapes = [(13, 7), (40, 257), (33, 64), (200, 48), (2, 5, 6), (9,)]
    planned = mtt.check_plan_is_what_the_step_launches(
        plan_launches, _make, shapes, _modules(),
        ["_mt_stats_kernel", "_mt_momentum_kernel", "_mt_came_apply_kernel"],
    )  # fmt: skip
    assert "_momentum_kernel" in [lp.kernel for lp in planned]  # the 3-D tensor's, per tensor


def test_groups_step_exactly_as_one_launch_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items of 4096 elements, so every matrix keeps its items at the 800-float budget.

    (At 1024 the 40 x 257 matrix's 14 items of 3 rows exceed it: 16-row items there.)
    """
    from optim_adafactor import _multi_tables

    monkeypatch.setattr(_multi_tables, "ITEM_ELEMENTS", 4096)
    mtt.check_groups_step_as_one_launch_set(
        CAME,
        KW,
        plan_launches,
        "_mt_momentum_kernel",
        tables=_multi_tables,
        monkeypatch=monkeypatch,
    )
