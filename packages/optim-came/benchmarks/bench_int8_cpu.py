#!/usr/bin/env python
"""CPU time of a CAME step with fp32, int8 and int8 + stochastic-rounding first moments.

Command (from the repository root; RESULTS.md was made with it):

    python packages/optim-came/benchmarks/bench_int8_cpu.py --layers 2 --repeats 5

The PyTorch path (`backend="torch"`) on `bench_came.py`'s Llama-shaped parameters, one torch
thread. Each step is timed by `time.process_time()` (CPU seconds of this process), which a
machine shared with other jobs disturbs far less than wall time; the cases are interleaved and
the table gives medians after 2 warm-up steps, with wall time alongside.
"""

from __future__ import annotations

import argparse
import statistics
import time
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
    kw = {"lr": 2e-4, "weight_decay": 1e-2, "backend": "torch"}
    fp32, int8 = torch.float32, torch.int8
    cases = {
        "fp32 state": CAME(bench.random_params(shapes, "cpu", fp32), **kw),
        "int8 state": CAME(bench.random_params(shapes, "cpu", fp32), **kw, state_dtype=int8),
        "int8 state, stochastic rounding": CAME(
            bench.random_params(shapes, "cpu", fp32),
            **kw, state_dtype=int8, stochastic_rounding=True,
        ),
    }  # fmt: skip
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
    print(bench.header("bench_int8_cpu", "cpu", ["optim-came"], where=Path(__file__).parents[1]))
    print(f"# {n / 1e6:.1f}M params in {len(shapes)} tensors (fp32); torch threads 1; median "
          f"of {args.repeats} interleaved steps after 2 warm-up\n")  # fmt: skip
    base = statistics.median(cpu["fp32 state"])
    print("| first moment | CPU ms | vs fp32 state | wall ms |")
    print("|---|---:|---:|---:|")
    for name in cases:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"| {name} | {c * 1e3:.1f} | {c / base:.2f}x | {w * 1e3:.1f} |")


if __name__ == "__main__":
    main()
