"""FSDP2 (`fully_shard`) and DTensor parameters: sharded CAME steps equal the single-process steps.

gloo on CPU, world 2 and 4, rows that do not divide the world size (a rank with no rows at
world 4), odd column counts, a vector and a 3-D parameter; HSDP on a (2, 2) mesh; Replicate;
DCP checkpoints of the optimizer state across 2 -> 3 -> 1 ranks; fp32 and int8 `exp_avg`.
"""

from functools import partial
from typing import Any, ClassVar

import torch

from leanlm_testing.fsdp import FsdpParityTests, no_column_reduction
from optim_adafactor.base import StepWork
from optim_adafactor.dtensor import distributed_state_dict, load_distributed_state_dict
from optim_came import CAME


class TestFsdp2(FsdpParityTests):
    optimizer = partial(CAME, backend="torch")
    configs: ClassVar[dict[str, dict[str, Any]]] = {
        # momentum is part of CAME; β1 = 0 makes m the clipped update itself
        "default_wd": {"lr": 1e-3, "weight_decay": 0.01},
        "no_momentum": {"lr": 1e-3, "betas": (0.0, 0.99, 0.999), "instability_init": 1.0},
        # blockwise int8 exp_avg (blocks inside rows); rounding to nearest (the stochastic
        # codes, equal given equal seeds, are tested in test_sharding.py)
        "int8": {"lr": 1e-3, "weight_decay": 0.01, "state_dtype": torch.int8},
    }
    world4 = "default_wd"
    lazy = partial(no_column_reduction, StepWork)  # column statistics from the local rows only
    fused = partial(CAME, lr=1e-3, backend="triton")
    dcp = (distributed_state_dict, load_distributed_state_dict)  # checkpoints through DCP
