"""The fused kernels at the tiles that ship on a GPU, run in the Triton interpreter.

Under `TRITON_INTERPRET=1` the kernel modules pick narrower tiles to stay fast; these tests patch
in the GPU values of their tile constants (read from copies of the modules imported as on a
GPU), for the per-tensor kernels (`_kernels`) and the multi-tensor step (`_multi_kernels`):
16 x 256 tiles on 8 warps for rows whose width is a multiple of 16, 16 x 64 on 4 warps
otherwise. Widths cover one full 256-column tile, the multi-tile column loop with a full and a
partial last tile, and odd widths (257, 300, 513) over several 64-column tiles; row counts
leave a partial 16-row block. Fresh random gradients every step; bf16 and fp32 parameters;
the PyTorch path is the reference.
"""

import torch

from leanlm_testing import kernels as kt
from optim_adafactor import Adafactor, _kernels, _multi_kernels

pytestmark = kt.fused_kernel_marks(_kernels, torch.device("cpu"))

SHAPES = kt.SHIPPED_TILE_SHAPES
# the per-tensor tiles are `_kernels`' (the fused phases, `Adafactor._kernels()`, launch there)
MODULES = [_kernels.__name__, _multi_kernels.__name__]
MULTI = [False, True]


gpu_tiles = kt.shipped_tiles_fixture(MODULES)


def test_tiles_are_the_shipped_ones_and_span_several(gpu_tiles) -> None:
    """The patched tiles are the GPU's, and the widths above run the multi-tile column loop."""
    gpu = gpu_tiles[_kernels.__name__]
    kt.assert_tiles_span_several(_kernels, gpu, SHAPES)
    for name, copy in gpu_tiles.items():  # every module's launch_config now returns the GPU's
        live = __import__(name, fromlist=["launch_config"])
        for arg in (True, False) if name == _multi_kernels.__name__ else (256, 300):
            assert live.launch_config(arg) == copy.launch_config(arg)


CONFIGS = {
    # stats with Σp² (parameter scale), Σu², apply with momentum and weight decay
    "momentum_wd": {"beta1": 0.9, "weight_decay": 0.01},
    # external lr without parameter scale: stats without p, apply without momentum
    "plain": {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
    # no clip (no Σu² pass), stochastic rounding of bf16 parameters
    "noclip_sr": {"beta1": 0.5, "clip_threshold": None, "stochastic_rounding": True},
}


test_fused_matches_torch_path_at_shipped_tiles = kt.shipped_tiles_parity_test(
    Adafactor, CONFIGS, MULTI
)
