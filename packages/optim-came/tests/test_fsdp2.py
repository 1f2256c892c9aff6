"""FSDP2 (`fully_shard`) and DTensor parameters: sharded CAME steps equal the single-process steps.

gloo on CPU, world 2 and 4, rows that do not divide the world size (a rank with no rows at
world 4), odd column counts, a vector and a 3-D parameter; HSDP on a (2, 2) mesh; Replicate.
"""

from functools import partial
from typing import Any

import pytest

from leanlm_testing import spawn
from leanlm_testing.fsdp import (
    fsdp_parity_worker,
    fused_fsdp_worker,
    hsdp_parity_worker,
    no_column_reduction,
)
from optim_adafactor.base import StepWork
from optim_came import CAME

CONFIGS: dict[str, dict[str, Any]] = {
    # momentum is part of CAME; β1 = 0 makes m the clipped update itself
    "default_wd": {"lr": 1e-3, "weight_decay": 0.01},
    "no_momentum": {"lr": 1e-3, "betas": (0.0, 0.99, 0.999), "instability_init": 1.0},
}
OPTIMIZER = partial(CAME, backend="torch")
_lazy = partial(no_column_reduction, StepWork)  # column statistics from the local rows only


@pytest.mark.distributed
def test_fully_shard_and_replicate_world2(tmp_path: Any) -> None:
    spawn(fsdp_parity_worker, OPTIMIZER, CONFIGS, _lazy, world_size=2, tmp_path=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow  # ~30 s: 4 processes on the 2-core CI machine
def test_fully_shard_world4(tmp_path: Any) -> None:
    """3 rows on 4 ranks: one rank holds none of `lin3.weight` and still joins the reductions."""
    world4 = {"default_wd": CONFIGS["default_wd"]}
    spawn(fsdp_parity_worker, OPTIMIZER, world4, None, world_size=4, tmp_path=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_fully_shard_world4_all_configs_and_hsdp(tmp_path: Any) -> None:
    spawn(fsdp_parity_worker, OPTIMIZER, CONFIGS, _lazy, world_size=4, tmp_path=tmp_path)
    spawn(hsdp_parity_worker, OPTIMIZER, CONFIGS, world_size=4, tmp_path=tmp_path)


@pytest.mark.distributed
@pytest.mark.interpreter
@pytest.mark.slow  # the Triton interpreter in 2 processes
def test_fully_shard_fused_kernels_world2(tmp_path: Any) -> None:
    make = partial(CAME, lr=1e-3, backend="triton")
    spawn(fused_fsdp_worker, make, world_size=2, tmp_path=tmp_path)
