#!/usr/bin/env python
"""Adafactor step time on a Llama-shaped parameter set, against the reference implementations.

Command (from the repository root; CPU numbers in RESULTS.md were taken with it):

    python packages/optim-adafactor/benchmarks/bench_adafactor.py --threads 2

On a CUDA machine (`--device cuda`) the script also reports the fused path's achieved GB/s
against the bandwidth floor of an exact fused step (research note §7: `3G + 3P (+2M)` bytes per
element with parameter scaling, `3G + 2P (+2M)` without).

Every case runs the same parameters and (fixed) gradients: warm-up steps, then the median of
`--repeats` timed steps (CUDA: synchronised). Ratios are against the anchor measured in the same
run. Also printed: optimizer-state bytes of each implementation vs AdamW's.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm_testing import bench
from optim_adafactor import Adafactor

Config = bench.LlamaShapes  # also what bench_launches.py imports


@dataclass(frozen=True, kw_only=True)
class Result:
    """Median step time of one case."""

    name: str
    ms: float
    state_bytes: int
    anchor: str | None = None


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def cases(
    device: str,
) -> list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer], str | None]]:
    """(name, factory, anchor name) for every implementation that is installed."""
    from transformers.optimization import Adafactor as HFAdafactor

    backend = "triton" if device == "cuda" else "torch"
    trainer_kw = {"lr": 1e-3, "relative_step": False, "scale_parameter": False}
    out: list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer], str | None]] = [
        ("HF Adafactor (defaults: relative step, param scale)", HFAdafactor, None),
        (
            "optim_adafactor (defaults)",
            lambda p: Adafactor(p, backend=backend),
            "HF Adafactor (defaults: relative step, param scale)",
        ),
        (
            "HF Adafactor (Trainer: lr=1e-3, no scaling)",
            lambda p: HFAdafactor(p, **trainer_kw),
            None,
        ),
        (
            "optim_adafactor (Trainer settings)",
            lambda p: Adafactor(p, backend=backend, **trainer_kw),
            "HF Adafactor (Trainer: lr=1e-3, no scaling)",
        ),
        ("HF Adafactor (beta1=0.9)", lambda p: HFAdafactor(p, beta1=0.9), None),
        (
            "optim_adafactor (beta1=0.9)",
            lambda p: Adafactor(p, beta1=0.9, backend=backend),
            "HF Adafactor (beta1=0.9)",
        ),
        (
            "torch.optim.Adafactor(foreach=True)",
            lambda p: torch.optim.Adafactor(p, foreach=True),
            None,
        ),
        (
            "optim_adafactor.from_torch_args",
            lambda p: Adafactor.from_torch_args(p, backend="torch"),
            "torch.optim.Adafactor(foreach=True)",
        ),
        (
            "optim_adafactor (defaults) vs torch",
            lambda p: Adafactor(p, backend=backend),
            "torch.optim.Adafactor(foreach=True)",
        ),
    ]
    try:
        import pytorch_optimizer

        out.append(("pytorch_optimizer.AdaFactor", pytorch_optimizer.AdaFactor, None))
        out.append(
            (
                "optim_adafactor (beta1=0.9) vs pytorch_optimizer",
                lambda p: Adafactor(p, beta1=0.9, backend=backend),
                "pytorch_optimizer.AdaFactor",
            )
        )
    except ImportError:
        pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="multiply hidden/intermediate")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = Config(
        hidden=512 * args.scale,
        intermediate=1408 * args.scale,
        kv_hidden=512 * args.scale,
    )
    numel = sum(torch.Size(s).numel() for s in cfg.shapes())
    dists = ["optim-adafactor", "transformers", "pytorch_optimizer"]
    print(bench.header("bench_adafactor", args.device, dists, where=Path(__file__).parents[1]))
    print(
        f"# {numel / 1e6:.1f}M fp32 params in {len(cfg.shapes())} tensors; median of "
        f"{args.repeats} interleaved steps after {args.warmup} warm-up"
    )
    all_cases = cases(args.device)
    opts = {
        name: factory(bench.random_params(cfg.shapes(), args.device, torch.float32))
        for name, factory, _ in all_cases
    }
    # the cases step in turn within each round, so load on a shared machine hits all alike
    seconds = bench.interleaved_medians(
        {name: opt.step for name, opt in opts.items()},
        rounds=args.repeats,
        warmup=args.warmup,
        sync=bench.synchronizer(args.device),
    )
    ms = {name: s * 1e3 for name, s in seconds.items()}
    results = {
        name: Result(name=name, ms=ms[name], state_bytes=_state_bytes(opts[name]), anchor=anchor)
        for name, _, anchor in all_cases
    }
    adamw_bytes = 2 * 4 * numel
    print("\n| implementation | step ms | ratio vs anchor | state MB | state / AdamW |")
    print("|---|---:|---:|---:|---:|")
    for r in results.values():
        ratio = f"{r.ms / results[r.anchor].ms:.2f}x {r.anchor}" if r.anchor else "anchor"
        print(
            f"| {r.name} | {r.ms:.1f} | {ratio} | {r.state_bytes / 1e6:.1f} | "
            f"{r.state_bytes / adamw_bytes:.3f} |"
        )
    print(f"\nAdamW state for the same parameters: {adamw_bytes / 1e6:.1f} MB")
    if args.device == "cuda":
        for name, key, bytes_per in [
            ("defaults (param scale, no momentum): 3G+3P", "optim_adafactor (defaults)", 24),
            ("Trainer settings (no scale): 3G+2P", "optim_adafactor (Trainer settings)", 20),
            ("beta1=0.9: 3G+3P+2M", "optim_adafactor (beta1=0.9)", 32),
        ]:
            r = results[key]
            gbs = bytes_per * numel / (r.ms * 1e-3) / 1e9
            print(f"fused {name}: {gbs:.0f} GB/s achieved ({bytes_per} B/elem floor)")


if __name__ == "__main__":
    main()
