"""FSDP2 (`fully_shard`) and DTensor parameters: sharded steps equal the single-process steps.

gloo on CPU, world 2 and 4, rows that do not divide the world size (a rank with no rows at
world 4), odd column counts, a vector and a 3-D parameter; HSDP on a (2, 2) mesh; Replicate;
DCP checkpoints of the optimizer state across 2 -> 3 -> 1 ranks; fp32 and int8 momentum.
"""

from functools import partial
from typing import Any, ClassVar

import torch

from leanlm_testing.fsdp import FsdpParityTests, no_column_reduction
from optim_adafactor import Adafactor
from optim_adafactor.base import StepWork
from optim_adafactor.dtensor import distributed_state_dict, load_distributed_state_dict


class TestFsdp2(FsdpParityTests):
    optimizer = partial(Adafactor, backend="torch")
    configs: ClassVar[dict[str, dict[str, Any]]] = {
        # relative step, parameter scaling (Σp² reduced), clipping (Σu² reduced)
        "hf_default": {},
        "momentum_wd": {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.1},
        # blockwise int8 momentum (blocks inside rows), rounded to nearest
        "int8": {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "state_dtype": torch.int8},
    }
    world4 = "momentum_wd"
    lazy = partial(no_column_reduction, StepWork)  # column statistics from the local rows only
    fused = partial(Adafactor, beta1=0.9, backend="triton")
    dcp = (distributed_state_dict, load_distributed_state_dict)  # checkpoints through DCP
