"""What one `BlockSparseLinear` call does besides its Triton kernels, per path, counted on CPU.

Command (from the repo root; the Triton interpreter, no GPU needed):

    TRITON_INTERPRET=1 python packages/sparse-kernels/benchmarks/bench_ops.py [--tokens 512]

A bf16 layer (128 -> 128, block 64, 3 of 4 tiles stored, no bias) runs forward + backward once
(the sm_90 launch plan is built and cached on its layout), then once more, the steady state,
under a `TorchDispatchMode` that records every aten op (views excepted) dispatched outside the
kernel launches, and the launches themselves, per phase; with `SPARSE_KERNELS_SM90` = 0 (the
sm_80 kernels) and 1 (the Hopper kernels). At 512 tokens both dW kernels split the tokens in 2
(4 "SMs" on CPU), as they do on an H100 at low tile density. On a GPU every op here but
`empty*` (an allocation from the caching allocator) is a kernel of its own, and
`_local_scalar_dense` or a copy to the CPU is a host sync. The interpreter's own tensor work
inside a launch is not counted; what Triton's launcher does on a GPU (descriptor encoding, the
launch) is not seen at all.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_hopper as H
from sparse_kernels import _bsr_hopper_dw as HW
from sparse_kernels import _bsr_kernels as K

KERNELS = ((K, "_dsd_kernel"), (K, "_dsdt_kernel"), (K, "_sdd_kernel"), (H, "_bsr_tma_kernel"),
           (HW, "_sdd_tma_kernel"))  # fmt: skip
PHASES = ("forward", "backward")


class OpsOutsideKernels(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """aten ops (views excepted) and kernel launches, in order, per phase."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.phase = PHASES[0]
        self.ops: dict[str, list[str]] = {p: [] for p in PHASES}
        self.launches: dict[str, list[str]] = {p: [] for p in PHASES}
        self.in_kernel = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not (self.in_kernel or func.is_view):
            self.ops[self.phase].append(str(func))
        return func(*args, **(kwargs or {}))

    def spy(self, kernel: Any, name: str) -> Any:
        """`kernel` whose `[grid](...)` launch is recorded and its own tensor work not counted."""
        mode = self

        class Launch:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    mode.launches[mode.phase].append(name)
                    mode.in_kernel = True
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        mode.in_kernel = False

                return launch

        return Launch()


@contextmanager
def counting() -> Iterator[OpsOutsideKernels]:
    """An `OpsOutsideKernels` mode, active, with every kernel of `KERNELS` spied on."""
    mode = OpsOutsideKernels()
    real = [getattr(module, name) for module, name in KERNELS]
    for (module, name), kernel in zip(KERNELS, real, strict=True):
        setattr(module, name, mode.spy(kernel, name))
    try:
        with mode:
            yield mode
    finally:
        for (module, name), kernel in zip(KERNELS, real, strict=True):
            setattr(module, name, kernel)


def example(tokens: int) -> tuple[BlockSparseLinear, torch.Tensor, torch.Tensor]:
    """The layer, x (requires grad) and dY of the docstring, seeded."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)  # rows of 2 and 1 tiles: 2 dW pairs
    layer = BlockSparseLinear(128, 128, block_mask=mask, block_size=64, bias=False,
                              backend="triton", dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16)
    return layer, x, dy


def steady_call(
    layer: BlockSparseLinear, x: torch.Tensor, dy: torch.Tensor
) -> tuple[OpsOutsideKernels, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Counts of the second fwd+bwd call, and (dX, dvalues) of the first and the second."""
    first = torch.autograd.grad(layer(x), (x, layer.values), dy)
    with counting() as mode:
        y = layer(x)
        mode.phase = "backward"
        second = torch.autograd.grad(y, (x, layer.values), dy)
    return mode, first, second


def main() -> None:
    """Print each path's ops and launches per phase."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels run on CPU tensors)")
    for sm90 in ("0", "1"):
        os.environ[H.ENV] = sm90
        mode, _, _ = steady_call(*example(args.tokens))
        for phase in PHASES:
            print(f"{H.ENV}={sm90} {phase}: launches {mode.launches[phase]}; "
                  f"ops {mode.ops[phase]}")  # fmt: skip


if __name__ == "__main__":
    main()
