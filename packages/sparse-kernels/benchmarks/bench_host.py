"""Host (CPU) time of one `BlockSparseLinear` call on the Triton path, its launches stubbed out.

Command (from the repo root; no GPU needed, the Triton interpreter only makes the CPU a valid
device for the launchers, no kernel runs):

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python packages/sparse-kernels/benchmarks/bench_host.py \
        [--rounds 15] [--round-ms 10] [--profile]

4096 -> 4096 layers (block 64 and 128, half the tiles, no bias, bf16 and fp32 at matmul
precision "high" (TF32, the fp32 that the Hopper kernels take) on CPU tensors. The sm_80 and
sm_90 paths are chosen as the real dispatch does (`SPARSE_KERNELS_SM90` = 0 / 1, read by
`_bsr_hopper.use_sm90` in `_bsr_autograd._BlockSparseMM`). Only the final `kernel[grid](...)`
of each launcher is replaced by a stub that keeps the last launch's arguments: everything our
Python does before the launch runs, Triton's launcher does not. Per case: forward under
`no_grad`, and forward + backward (`torch.autograd.grad` of x and the values: no gradient
accumulation), with 1, 16 and 4096 tokens. Time per call: `time.perf_counter` around a round
of calls (a round lasts about `--round-ms`), median and minimum over `--rounds` rounds after a
warm-up (on a shared machine the minimum is the round least slowed by other processes); and
the Python function calls per call (cProfile's count over 100 calls), which load does not move.

What this cannot show: Triton's own launcher (argument specialization, the TMA descriptor
encoding of `TensorDescriptor` arguments, the driver launch), and the cost of the torch.cuda
queries the CUDA branches make (on CPU tensors the launchers take their CPU branch; a
steady-state call makes no such query since the device facts are cached per device, which
tests/test_host_path.py checks with fake CUDA tensors). CPU allocations of the outputs stand
in for the caching allocator's. `--profile` adds cProfile's top functions of one steady-state
fwd+bwd sequence per path (bf16, block 128, 16 tokens).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from leanlm_testing import bench
from sparse_kernels import BlockSparseLinear
from sparse_kernels import _bsr_hopper as H
from sparse_kernels import _bsr_hopper_dw as HW
from sparse_kernels import _bsr_kernels as K

KERNELS = ((K, "_dsd_kernel"), (K, "_dsdt_kernel"), (K, "_sdd_kernel"), (H, "_bsr_tma_kernel"),
           (HW, "_sdd_tma_kernel"))  # fmt: skip
PATHS = {"sm80": "0", "sm90": "1"}


class Stub:
    """Stands in for a `@triton.jit` kernel: `stub[grid](*args, **kwargs)` records, runs nothing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.last: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls += 1
            self.last = (grid, args, kwargs)

        return launch


@contextmanager
def stubbed() -> Iterator[dict[str, Stub]]:
    """Every kernel of `KERNELS` replaced by a `Stub` (by name), restored on exit."""
    stubs = {name: Stub(name) for _, name in KERNELS}
    real = [getattr(module, name) for module, name in KERNELS]
    for module, name in KERNELS:
        setattr(module, name, stubs[name])
    try:
        yield stubs
    finally:
        for (module, name), kernel in zip(KERNELS, real, strict=True):
            setattr(module, name, kernel)


@dataclass(frozen=True)
class Case:
    """One measured point."""

    path: str
    block: int
    dtype: torch.dtype
    tokens: int
    backward: bool

    @property
    def label(self) -> str:
        """Table row text."""
        dt = str(self.dtype).removeprefix("torch.")
        return f"| {self.path} | {self.block} | {dt} | {self.tokens} | " + (
            "fwd+bwd" if self.backward else "fwd"
        )


def make_layer(block: int, dtype: torch.dtype, size: int = 4096) -> BlockSparseLinear:
    """A `size`² layer with a seeded random half of its tiles stored, no bias, Triton backend."""
    gen = torch.Generator().manual_seed(0)
    tiles = (size // block) ** 2
    keep = torch.randperm(tiles, generator=gen)[: tiles // 2]
    mask = torch.zeros(tiles, dtype=torch.bool)
    mask[keep] = True
    return BlockSparseLinear(size, size, block_mask=mask.view(size // block, -1),
                             block_size=block, bias=False, backend="triton",
                             dtype=dtype)  # fmt: skip


def call(layer: BlockSparseLinear, tokens: int, backward: bool) -> Callable[[], object]:
    """One steady-state call of `layer` on `tokens` rows (forward or forward + backward)."""
    x = torch.zeros(tokens, layer.in_features, dtype=layer.values.dtype)
    if not backward:

        def fwd() -> object:
            with torch.no_grad():
                return layer(x)

        return fwd
    x.requires_grad_()
    dy = torch.zeros(tokens, layer.out_features, dtype=layer.values.dtype)
    inputs = (x, layer.values)
    return lambda: torch.autograd.grad(layer(x), inputs, dy)


def per_call_us(fn: Callable[[], object], rounds: int, round_ms: float) -> tuple[float, float]:
    """Median and minimum over `rounds` of (round time / calls), rounds about `round_ms` long.

    On a shared machine the minimum is the round least slowed by other processes.
    """
    for _ in range(20):
        fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < round_ms / 1e3:
        fn()
        n += 1
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times) * 1e6, min(times) * 1e6


def profiled(fn: Callable[[], object], calls: int) -> pstats.Stats:
    """Profile statistics (cProfile) of `calls` calls of `fn`, after one unprofiled call."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return pstats.Stats(prof)


def python_calls(fn: Callable[[], object], calls: int = 100) -> float:
    """Function calls per call of `fn` (cProfile's count, builtins included).

    A measure of the host work that, unlike time, does not depend on the machine's load.
    """
    return float(profiled(fn, calls).total_calls) / calls  # type: ignore[attr-defined]


def profile(layer: BlockSparseLinear, path: str, calls: int = 2000, top: int = 14) -> None:
    """Top functions by own time (cProfile) of `calls` steady-state fwd+bwd calls."""
    os.environ[H.ENV] = PATHS[path]
    stats = profiled(call(layer, 16, backward=True), calls)
    print(f"\n### cProfile, {path}, bf16, block {layer.block_size}, 16 tokens, fwd+bwd, "
          f"{calls} calls (tottime = own time, cumtime = with callees; seconds)\n```")  # fmt: skip
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    print("```")


def main() -> None:
    """Print the table (markdown) and, with `--profile`, the profiles."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--round-ms", type=float, default=10.0)
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 4096])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the launchers then accept CPU tensors)")
    torch.set_float32_matmul_precision("high")
    print(bench.header("bench_host", "cpu", where=__file__))
    print("| path | block | dtype | tokens | phase | host us per call, median | min | calls |")
    print("|---|---|---|---|---|---|---|---|")
    with stubbed() as stubs:
        for block in args.blocks:
            for dtype in (torch.bfloat16, torch.float32):
                layer = make_layer(block, dtype)
                for path, env in PATHS.items():
                    os.environ[H.ENV] = env
                    for tokens in args.tokens:
                        for backward in (False, True):
                            case = Case(path, block, dtype, tokens, backward)
                            fn = call(layer, tokens, backward)
                            med, low = per_call_us(fn, args.rounds, args.round_ms)
                            n = python_calls(fn)
                            print(f"{case.label} | {med:.1f} | {low:.1f} | {n:.0f} |", flush=True)
        launched = sorted(name for name, stub in stubs.items() if stub.calls)
        print(f"# stubbed launches that ran: {launched}")
        if args.profile:
            layer = make_layer(128, torch.bfloat16)
            for path in PATHS:
                profile(layer, path)


if __name__ == "__main__":
    main()
