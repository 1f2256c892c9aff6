#!/usr/bin/env python
"""BlockSparseLinear (PyTorch CPU path) vs dense nn.Linear, forward and forward+backward.

Command (from the repository root):
    python packages/sparse-kernels/benchmarks/bench_sparse.py [--size 4096] [--tokens 1024]
        [--blocks 32 64] [--sparsities 0.5 0.75 0.9] [--repeats 5]

Weight `size x size` fp32, input `tokens x size`; block sparsity = fraction of tiles dropped
(random tile mask). Times are medians over `repeats` after one warm-up. FLOPs count
2·tokens·size² per dense GEMM (3 GEMMs for forward+backward) and density x that for the sparse
layer; "useful GFLOP/s" divides the sparse layer's (non-zero) FLOPs by its time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sparse_kernels import BlockSparseLinear


@dataclass(frozen=True)
class Config:
    """One benchmark point."""

    size: int
    tokens: int
    block: int
    sparsity: float


@dataclass(frozen=True)
class Result:
    """Median times of one point (seconds)."""

    config: Config
    density: float
    dense_fwd_s: float
    sparse_fwd_s: float
    dense_fwdbwd_s: float
    sparse_fwdbwd_s: float


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fwd_bwd(layer: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        y.backward(torch.ones_like(y))
        return y

    return run


def fwd(layer: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return layer(x)

    return run


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"# bench_sparse: git {git_sha()}, torch {torch.__version__}, triton {triton_version}")
    print(
        f"# device: CPU {cpu_name()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}; no GPU"
    )
    print(f"# weight {args.size}x{args.size} fp32, tokens {args.tokens}, repeats {args.repeats}")

    torch.manual_seed(0)
    dense = nn.Linear(args.size, args.size)
    x = torch.randn(args.tokens, args.size, requires_grad=True)
    dense_fwd = median_time(fwd(dense, x), args.repeats)
    dense_fb = median_time(fwd_bwd(dense, x), args.repeats)
    flops = 2 * args.tokens * args.size * args.size
    print(
        f"# dense nn.Linear: fwd {dense_fwd * 1e3:.1f} ms ({flops / dense_fwd / 1e9:.1f} GFLOP/s), "
        f"fwd+bwd {dense_fb * 1e3:.1f} ms ({3 * flops / dense_fb / 1e9:.1f} GFLOP/s)"
    )
    print()
    print(
        "| block | sparsity | fwd ms (dense / sparse) | fwd speedup | fwd+bwd ms (dense / sparse)"
        " | fwd+bwd speedup | useful GFLOP/s fwd+bwd |"
    )
    print("|---|---|---|---|---|---|---|")
    for block in args.blocks:
        for sparsity in args.sparsities:
            cfg = Config(args.size, args.tokens, block, sparsity)
            layer = BlockSparseLinear.from_dense(
                dense, block_size=block, sparsity=sparsity, backend="torch"
            )
            s_fwd = median_time(fwd(layer, x), args.repeats)
            s_fb = median_time(fwd_bwd(layer, x), args.repeats)
            r = Result(cfg, layer.density, dense_fwd, s_fwd, dense_fb, s_fb)
            useful = 3 * flops * r.density / s_fb / 1e9
            print(
                f"| {block} | {sparsity:.2f} | {dense_fwd * 1e3:.0f} / {s_fwd * 1e3:.0f} | "
                f"{dense_fwd / s_fwd:.2f}x | {dense_fb * 1e3:.0f} / {s_fb * 1e3:.0f} | "
                f"{dense_fb / s_fb:.2f}x | {useful:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
