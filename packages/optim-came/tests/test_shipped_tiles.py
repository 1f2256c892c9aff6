"""The fused CAME kernels at the tiles that ship on a GPU, run in the Triton interpreter.

Under `TRITON_INTERPRET=1` the kernel modules pick narrower tiles to stay fast; these tests
patch in the GPU values of their tile constants (read from copies imported as on a GPU) for
optim-came's kernels, the optim-adafactor statistics kernels they reuse and a multi-tensor
step (`_multi_kernels`): 16 x 256 tiles on 8 warps for widths that are multiples
of 16, 16 x 64 on 4 warps otherwise. Widths
cover one full 256-column tile, the multi-tile column loop with a partial last tile, and odd
widths (257, 300, 513); row counts leave a partial 16-row block. Fresh random gradients every
step; bf16 and fp32 parameters; the PyTorch path is the reference.
"""

import pytest
import torch

from leanlm_testing import kernels as kt
from optim_came import CAME, _kernels, _multi_kernels

pytestmark = kt.fused_kernel_marks(_kernels, torch.device("cpu"))

SHAPES = kt.SHIPPED_TILE_SHAPES
# dependencies first: optim-came's multi-tensor step takes optim-adafactor's tile constants
MODULES = [
    "optim_adafactor._kernels",
    "optim_adafactor._multi_kernels",
    _kernels.__name__,
    _multi_kernels.__name__,
]
MULTI = [False, True]


gpu_tiles = kt.shipped_tiles_fixture(MODULES)


def test_tiles_are_the_shipped_ones_and_span_several(gpu_tiles) -> None:
    gpu = gpu_tiles[_kernels.__name__]
    kt.assert_tiles_span_several(_kernels, gpu, SHAPES)


CONFIGS = {
    "defaults_wd": {"lr": 1e-3, "weight_decay": 0.01},
    "extras_sr": {
        "lr": 1e-3,
        "bias_correction": True,
        "instability_init": 1.0,
        "stochastic_rounding": True,
    },
}


test_fused_matches_torch_path_at_shipped_tiles = kt.shipped_tiles_parity_test(CAME, CONFIGS, MULTI)


@pytest.mark.parametrize("multi_tensor", MULTI)
@pytest.mark.parametrize("sr", [False, True])
def test_int8_state_matches_torch_path_at_shipped_tiles(gpu_tiles, sr, multi_tensor) -> None:
    """int8 `exp_avg`: tiles of whole 128-column blocks (per tensor 16 x 256, or 16 x 128 for
    unaligned widths; multi-tensor 8 x 128 momentum, 8 x 256 or 8 x 128 apply)."""
    kw = {"lr": 1e-3, "weight_decay": 0.01, "state_dtype": torch.int8, "stochastic_rounding": sr}
    kt.check_fused_matches_torch_multi(
        _seeded, kw, SHAPES, torch.float32, multi_tensor=multi_tensor
    )


def _seeded(params, **kw) -> CAME:
    """CAME with a fixed stochastic-rounding seed (drawn from torch's global generator)."""
    torch.manual_seed(0)
    return CAME(params, **kw)
