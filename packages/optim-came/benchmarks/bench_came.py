#!/usr/bin/env python
"""CAME step time on a Llama-shaped parameter set, against came-pytorch and pytorch_optimizer.

Command (from the repository root; the CPU numbers in RESULTS.md were taken with it):

    python packages/optim-came/benchmarks/bench_came.py --threads 2 --repeats 9

Every case steps the same parameters with the same fixed random gradients: warm-up steps, then
the median of `--repeats` timed steps, the cases interleaved within each repeat so that load on a
shared machine hits all of them alike. Ratios are against `came_pytorch.CAME` measured in the
same run. Also printed: optimizer-state bytes per parameter element, vs AdamW's 8.

On CUDA (`--device cuda`) the fused path's achieved bandwidth is reported against the 22 B/elem
floor of an exact fused step with bf16 g/p and fp32 m (research note §7: `3G + 3M + 2P`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from optim_came import CAME


@dataclass(frozen=True, kw_only=True)
class Config:
    """A Llama-shaped parameter set (untied embeddings, no biases): 50.3M parameters."""

    hidden: int = 512
    intermediate: int = 1408
    layers: int = 8
    vocab: int = 24000

    def shapes(self) -> list[tuple[int, ...]]:
        """Embeddings and final norm, then q, k, v, o, gate, up, down and two norms per layer."""
        h, i = self.hidden, self.intermediate
        per_layer = [(h, h)] * 4 + [(i, h), (i, h), (h, i), (h,), (h,)]
        return [(self.vocab, h), (self.vocab, h), (h,)] + per_layer * self.layers


@dataclass(frozen=True, kw_only=True)
class Result:
    """Median step time of one case and its state size."""

    name: str
    ms: float
    state_bytes: int


def _params(cfg: Config, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in cfg.shapes():
        p = (torch.randn(shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3).to(device, dtype)
        params.append(p)
    return params


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k != "RMS"
    )


def _time(opts: dict[str, torch.optim.Optimizer], device: str, warmup: int, repeats: int):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for opt in opts.values():
        for _ in range(warmup):
            opt.step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(layers=args.layers)
    dev = args.device
    lr, wd = 2e-4, 1e-2
    cases: dict[str, tuple[torch.optim.Optimizer, list[torch.Tensor]]] = {}

    def add(name: str, make) -> None:  # type: ignore[no-untyped-def]
        params = _params(cfg, dev, torch.float32)
        cases[name] = (make(params), params)

    try:
        import came_pytorch

        add("came_pytorch.CAME 0.1.3", lambda p: came_pytorch.CAME(p, lr=lr, weight_decay=wd))
    except ImportError:
        print("came_pytorch not installed: no anchor")
    try:
        import pytorch_optimizer

        add(
            "pytorch_optimizer.CAME",
            lambda p: pytorch_optimizer.CAME(p, lr=lr, weight_decay=wd),
        )
    except ImportError:
        print("pytorch_optimizer not installed")
    backend = "triton" if dev == "cuda" else "torch"
    add("optim_came.CAME", lambda p: CAME(p, lr=lr, weight_decay=wd, backend=backend))
    add(
        "optim_came.CAME (bf16 first moment)",
        lambda p: CAME(p, lr=lr, weight_decay=wd, backend=backend, state_dtype=torch.bfloat16),
    )
    add("torch.optim.AdamW (foreach)", lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd))

    n = sum(p.numel() for p in next(iter(cases.values()))[1])
    print(f"bench_came  git {_git_sha()}  device {dev} ({platform.processor() or 'cpu'}), "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    print(f"torch {torch.__version__}, triton {_version('triton')}, came-pytorch "
          f"{_version('came-pytorch')}, pytorch_optimizer {_version('pytorch_optimizer')}, "
          f"python {platform.python_version()}")  # fmt: skip
    print(f"{n / 1e6:.1f}M fp32 params in {len(cfg.shapes())} tensors; median of "
          f"{args.repeats} interleaved steps after {args.warmup} warm-up\n")  # fmt: skip
    ms = _time({k: v[0] for k, v in cases.items()}, dev, args.warmup, args.repeats)
    anchor = ms.get("came_pytorch.CAME 0.1.3")
    print("| implementation | step ms | vs came-pytorch | state B/elem | state / AdamW |")
    print("|---|---:|---:|---:|---:|")
    adamw_bytes = 8.0
    for name, (opt, _) in cases.items():
        ratio = f"{ms[name] / anchor:.2f}x" if anchor else "-"
        per = _state_bytes(opt) / n
        print(f"| {name} | {ms[name]:.1f} | {ratio} | {per:.2f} | {per / adamw_bytes:.2f} |")
    if dev == "cuda":
        floor = 22 * n  # bf16 g/p + fp32 m would be 22 B; these fp32 runs move 32 B
        fused = ms["optim_came.CAME"] / 1e3
        print(f"\nfused fp32: {32 * n / fused / 1e9:.0f} GB/s at 32 B/elem ({floor=} B for bf16)")


if __name__ == "__main__":
    main()
