"""Count Triton kernel launches and torch ops of a block of code (tests and benchmarks).

`count_launches(modules)` patches every `*_kernel` attribute of the given modules with a
wrapper that records `kernel[grid](...)` calls, and counts the torch (aten) ops dispatched
meanwhile outside those launches (the interpreter's own tensor handling is not counted). It
works under the Triton interpreter and on a GPU. With `execute=False` the kernels are recorded
but not run (fast counting of host code without data-dependent branches; results are garbage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Counts:
    """What ran inside `count_launches`: kernel names and grids in launch order, torch ops."""

    launches: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    grids: list[tuple[int, ...]] = field(default_factory=list)


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counts: Counts) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts = counts
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.paused:
            self.counts.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Counted:
    """Stands in for a `@triton.jit` function: records each `kernel[grid](...)` launch."""

    def __init__(self, fn: Any, name: str, counter: _OpCounter, *, execute: bool) -> None:
        self.fn, self.name, self.counter, self.execute = fn, name, counter, execute

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.counter.counts.launches.append(self.name)
            self.counter.counts.grids.append(tuple(grid) if isinstance(grid, tuple) else (grid,))
            if not self.execute:
                return None
            self.counter.paused = True
            try:
                return self.fn[grid](*args, **kwargs)
            finally:
                self.counter.paused = False

        return launch


@contextmanager
def count_launches(modules: Sequence[ModuleType], *, execute: bool = True) -> Iterator[Counts]:
    """Count the launches of the `*_kernel` functions of `modules` and the torch ops meanwhile.

    `execute=False` records the launches without running the kernels. The modules' attributes
    are restored on exit.
    """
    counts = Counts()
    counter = _OpCounter(counts)
    saved: list[tuple[ModuleType, str, Any]] = []
    try:
        for module in modules:
            for name in dir(module):
                if name.endswith("_kernel") and hasattr(getattr(module, name), "__getitem__"):
                    fn = getattr(module, name)
                    saved.append((module, name, fn))
                    counted = _Counted(fn, f"{module.__name__}.{name}", counter, execute=execute)
                    setattr(module, name, counted)
        with counter:
            yield counts
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def step_counts(
    optimizer: Callable[..., Any],
    shapes: Sequence[tuple[int, ...]],
    modules: Sequence[ModuleType],
    path: str,
    *,
    steps: int = 3,
) -> tuple[int, int]:
    """(Triton launches, torch ops) of the last of `steps` optimizer steps, for benchmarks.

    `optimizer(params, backend=...)` steps bf16 parameters of `shapes` with fresh bf16
    gradients; `path` is "torch" (`backend="torch"`: its op count), "per-tensor"
    (`backend="triton"`, `multi_tensor = False`) or "multi" (`multi_tensor = True`). Without
    CUDA the kernels of `modules` are recorded, not executed (`count_launches(execute=False)`;
    the host code has no data-dependent branch, so the counts are those of a real step), and
    every dim is shrunk to <= 64 (the counts do not depend on the sizes).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    small = [tuple(min(d, 64) for d in s) for s in shapes] if device == "cpu" else list(shapes)
    params = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in small]
    opt = optimizer(params, backend="torch" if path == "torch" else "triton")
    opt.multi_tensor = path == "multi"
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device, torch.bfloat16)
        with count_launches(modules, execute=device == "cuda") as seen:
            opt.step()
    return len(seen.launches), len(seen.ops)


def path_counts(
    optimizer: Callable[..., Any],
    shapes: Sequence[tuple[int, ...]],
    modules: Sequence[ModuleType],
    path: str,
    *,
    gpu_tiles: Sequence[str],
    plan: Callable[[], Sequence[object]],
) -> tuple[int, int]:
    """`step_counts` of `path`, with the multi-tensor path ("multi") counted as on a GPU.

    Its torch ops are counted with the shipped GPU tiles of the modules named in `gpu_tiles`
    (`kernels.shipped_launch_configs`: the host code depends on the tiles), and its launches
    are those of `plan()` (the launch plan at full size, as the benchmark states it).
    """
    if path != "multi":
        return step_counts(optimizer, shapes, modules, path)
    from leanlm_testing.kernels import shipped_launch_configs

    with shipped_launch_configs(gpu_tiles):
        _, ops = step_counts(optimizer, shapes, modules, path)
    return len(plan()), ops
