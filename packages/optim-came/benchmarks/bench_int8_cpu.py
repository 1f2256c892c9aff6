#!/usr/bin/env python
"""CPU time of a CAME step with fp32, int8 and int8 + SR first moments, and of (8-bit) AdamW.

Command (from the repository root; RESULTS.md was made with it, under `OMP_NUM_THREADS=1`):

    python packages/optim-came/benchmarks/bench_int8_cpu.py --layers 2 --repeats 5

The PyTorch path (`backend="torch"`) on `bench_came.py`'s Llama-shaped parameters, one torch
thread, next to torch's foreach AdamW and, when bitsandbytes imports, its `AdamW8bit` (CPU
backend; same lr and weight decay; without bitsandbytes the row is left out with a note). Each
step is timed by `time.process_time()` (CPU seconds of this process, all its threads), which a
machine shared with other jobs disturbs far less than wall time; the cases are interleaved and
the table gives medians after 2 warm-up steps, with wall time alongside and the state bytes
counted from the state's tensors.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from leanlm_testing import bench
from optim_came import CAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = bench.LlamaShapes(layers=args.layers).shapes()
    lr, wd, int8 = 2e-4, 1e-2, torch.int8
    makers: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "CAME, fp32 state": lambda p: CAME(p, lr=lr, weight_decay=wd, backend="torch"),
        "CAME, int8 state": lambda p: CAME(
            p, lr=lr, weight_decay=wd, backend="torch", state_dtype=int8
        ),
        "CAME, int8 state, stochastic rounding": lambda p: CAME(
            p, lr=lr, weight_decay=wd, backend="torch", state_dtype=int8, stochastic_rounding=True
        ),
        "torch.optim.AdamW (foreach), fp32 state": lambda p: torch.optim.AdamW(
            p, lr=lr, weight_decay=wd, foreach=True
        ),
    }
    try:
        adamw8bit = importlib.import_module("bitsandbytes").optim.AdamW8bit
        makers["bitsandbytes AdamW8bit"] = lambda p: adamw8bit(p, lr=lr, weight_decay=wd)
    except ImportError as err:
        print(f"# bitsandbytes does not import ({err}): no AdamW8bit row")
    cases = {
        name: make(bench.random_params(shapes, "cpu", torch.float32))
        for name, make in makers.items()
    }
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    wall: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.repeats + 2):
        for name, opt in cases.items():
            c, w = time.process_time(), time.perf_counter()
            opt.step()
            if r >= 2:
                cpu[name].append(time.process_time() - c)
                wall[name].append(time.perf_counter() - w)
    n = sum(torch.Size(s).numel() for s in shapes)
    dists = ["optim-came", "bitsandbytes"]
    print(bench.header("bench_int8_cpu", "cpu", dists, where=Path(__file__).parents[1]))
    print(f"# {n / 1e6:.1f}M params in {len(shapes)} tensors (fp32); torch threads 1; median "
          f"of {args.repeats} interleaved steps after 2 warm-up\n")  # fmt: skip
    base = statistics.median(cpu["CAME, fp32 state"])
    print("| optimizer, state | CPU ms | vs CAME fp32 state | wall ms | state B/param |")
    print("|---|---:|---:|---:|---:|")
    for name, opt in cases.items():
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        per = bench.state_bytes(opt) / n
        print(f"| {name} | {c * 1e3:.1f} | {c / base:.2f}x | {w * 1e3:.1f} | {per:.2f} |")


if __name__ == "__main__":
    main()
