#!/usr/bin/env python
"""CAME step time on a Llama-shaped parameter set, against came-pytorch, pytorch_optimizer, AdamW.

Commands (from the repository root; the CPU numbers in RESULTS.md were taken with the first):

    python packages/optim-came/benchmarks/bench_came.py --threads 2 --repeats 9
    python packages/optim-came/benchmarks/bench_came.py --device cuda --repeats 20

Every case steps its own copy of the same parameters with the same fixed random gradients:
warm-up steps, then the median of `--repeats` timed steps, the cases interleaved within each
repeat so that load on a shared machine hits all of them alike. Ratios are against
`came_pytorch.CAME` measured in the same run. Also printed: optimizer-state bytes per parameter
element, vs AdamW's 8.

The bandwidth table (always on CUDA; `--bandwidth` on CPU) adds, for each case, the bytes per
element an exact fused step must move (research note §7) and what the case achieves against it:

- CAME: `3G + 3M + 2P` (G, P, M: bytes per element of the gradient, the parameter and the first
  moment): 32 B in fp32, 22 B with bf16 g/p and an fp32 first moment, 16 B all bf16.
- AdamW: `G + 2P + 4S` (torch keeps `exp_avg`/`exp_avg_sq` in the parameter's dtype S): 28 B in
  fp32, 14 B in bf16.

"GB/s" is that floor over the step time; "x floor" is the step time over the floor's time at
the copy bandwidth measured in the same run (`dst.copy_(src)` of 1 GiB, 256 MiB on CPU; read +
write), so 1.0 is an ideal fused step (the issue's target is <= 1.3). "vs AdamW" divides by
`torch.optim.AdamW` of the same parameter dtype (fused on CUDA, foreach on CPU; the CPU table
also shows torch's default for-loop AdamW).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from leanlm_testing import bench
from optim_came import CAME

Kind = Literal["came", "adamw"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


Config = bench.LlamaShapes  # also what bench_launches.py imports

# The CUDA default: large enough (333M parameters) that the step is bandwidth-bound, small
# enough that every case's parameters, gradients and state fit together in ~30 GB.
CUDA_CONFIG = Config(hidden=2048, intermediate=5632, layers=4, vocab=32000)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One timed optimizer: its parameters and the traffic model of its floor."""

    name: str
    opt: torch.optim.Optimizer
    params: list[torch.Tensor]
    kind: Kind
    param_dtype: torch.dtype
    moment_dtype: torch.dtype  # CAME's `exp_avg`; AdamW's two moments
    anchor: bool = False  # the AdamW that "vs AdamW" divides by

    def floor_bytes_per_elem(self) -> int:
        """Bytes per element of an exact fused step (research note §7)."""
        g = p = self.param_dtype.itemsize
        m = self.moment_dtype.itemsize
        return 3 * g + 3 * m + 2 * p if self.kind == "came" else g + 2 * p + 4 * m


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and k not in {"RMS", "step"}
    )


def copy_bandwidth(device: str, repeats: int, nbytes: int = 1 << 30) -> float:
    """Achieved bytes/s of `dst.copy_(src)` (read + write), median of `repeats`."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = bench.synchronizer(device)
    return 2 * nbytes / bench.median_seconds(lambda: dst.copy_(src), repeats, sync=sync)


ANCHORS = (  # (case name, module with a `CAME` class, what to print when it is not installed)
    ("came_pytorch.CAME 0.1.3", "came_pytorch", "came_pytorch not installed: no anchor"),
    ("pytorch_optimizer.CAME", "pytorch_optimizer", "pytorch_optimizer not installed"),
)


def build_cases(cfg: Config, device: str, dtypes: list[str], *, anchors: bool) -> list[Case]:
    """The cases of the run: fp32 (with came-pytorch/pytorch_optimizer anchors) and/or bf16."""
    lr, wd = 2e-4, 1e-2
    backend = "triton" if device == "cuda" else "torch"
    fused = device == "cuda"
    cases: list[Case] = []
    fp32, bf16 = torch.float32, torch.bfloat16

    def add(  # type: ignore[no-untyped-def]
        name: str, kind: Kind, dtype: torch.dtype, moment: torch.dtype, make, *, anchor=False
    ) -> None:
        params = bench.random_params(cfg.shapes(), device, dtype)
        cases.append(
            Case(
                name=name,
                opt=make(params),
                params=params,
                kind=kind,
                param_dtype=dtype,
                moment_dtype=moment,
                anchor=anchor,
            )
        )

    for label in dtypes:
        dtype = DTYPES[label]
        suffix = "" if dtype == fp32 else ", bf16 params/grads"
        for name, module, missing in ANCHORS if dtype == fp32 and anchors else ():
            try:
                anchor_cls = importlib.import_module(module).CAME
            except ImportError:
                print(missing)
                continue
            add(name, "came", fp32, fp32, lambda p, c=anchor_cls: c(p, lr=lr, weight_decay=wd))
        add(
            f"optim_came.CAME{suffix}",
            "came",
            dtype,
            fp32,
            lambda p: CAME(p, lr=lr, weight_decay=wd, backend=backend),
        )
        add(
            f"optim_came.CAME{suffix} (bf16 first moment)",
            "came",
            dtype,
            bf16,
            lambda p: CAME(p, lr=lr, weight_decay=wd, backend=backend, state_dtype=bf16),
        )
        add(
            f"optim_came.CAME{suffix} (int8 first moment)",
            "came",
            dtype,
            torch.int8,
            lambda p: CAME(p, lr=lr, weight_decay=wd, backend=backend, state_dtype=torch.int8),
        )
        if not fused:
            # torch's default on CPU is the single-tensor loop (neither foreach nor fused).
            add(
                f"torch.optim.AdamW (for-loop, CPU default){suffix}",
                "adamw",
                dtype,
                dtype,
                lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd),
            )
        add(
            f"torch.optim.AdamW ({'fused' if fused else 'foreach'}){suffix}",
            "adamw",
            dtype,
            dtype,
            lambda p: torch.optim.AdamW(
                p, lr=lr, weight_decay=wd, fused=fused or None, foreach=None if fused else True
            ),
            anchor=True,
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=None, help="default: 8 (cpu), 4 (cuda)")
    parser.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated fp32,bf16 (default: fp32 on cpu, both on cuda)",
    )
    parser.add_argument("--bandwidth", action="store_true", help="bandwidth table on CPU too")
    args = parser.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("`--device cuda` needs a CUDA device; none is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = (args.dtypes or ("fp32,bf16" if dev == "cuda" else "fp32")).split(",")
    for label in dtypes:
        if label not in DTYPES:
            raise ValueError(f"`--dtypes` entry {label!r} must be one of {sorted(DTYPES)}")
    base = CUDA_CONFIG if dev == "cuda" else Config()
    cfg = Config(
        hidden=base.hidden,
        intermediate=base.intermediate,
        layers=base.layers if args.layers is None else args.layers,
        vocab=base.vocab,
    )
    cases = build_cases(cfg, dev, dtypes, anchors=True)
    n = sum(p.numel() for p in cases[0].params)
    dists = ["optim-came", "optim-adafactor", "came-pytorch", "pytorch_optimizer"]
    print(bench.header("bench_came", dev, dists, where=Path(__file__).parents[1]))
    print(f"# {n / 1e6:.1f}M params in {len(cfg.shapes())} tensors ({', '.join(dtypes)}); median "
          f"of {args.repeats} interleaved steps after {args.warmup} warm-up\n")  # fmt: skip
    seconds = bench.interleaved_medians(
        {case.name: case.opt.step for case in cases},
        rounds=args.repeats,
        warmup=args.warmup,
        sync=bench.synchronizer(dev),
    )
    ms = {name: s * 1e3 for name, s in seconds.items()}
    anchor = ms.get("came_pytorch.CAME 0.1.3")
    print("| implementation | step ms | vs came-pytorch | state B/elem | state / AdamW |")
    print("|---|---:|---:|---:|---:|")
    adamw_bytes = 8.0
    for case in cases:
        ratio = f"{ms[case.name] / anchor:.2f}x" if anchor else "-"
        per = _state_bytes(case.opt) / n
        print(f"| {case.name} | {ms[case.name]:.1f} | {ratio} | {per:.2f} | "
              f"{per / adamw_bytes:.2f} |")  # fmt: skip

    if dev == "cuda" or args.bandwidth:
        nbytes = 1 << 30 if dev == "cuda" else 1 << 28
        copy = copy_bandwidth(dev, args.repeats, nbytes)
        print(f"\ncopy bandwidth ({nbytes >> 20} MiB dst.copy_(src), read + write): "
              f"{copy / 1e9:.0f} GB/s\n")  # fmt: skip
        print("| implementation | floor B/elem | GB/s at floor | x floor | vs AdamW (same dtype) |")
        print("|---|---:|---:|---:|---:|")
        adamw_ms = {c.param_dtype: ms[c.name] for c in cases if c.anchor}
        for case in cases:
            floor = case.floor_bytes_per_elem() * n
            sec = ms[case.name] / 1e3
            versus = f"{ms[case.name] / adamw_ms[case.param_dtype]:.2f}x"
            print(f"| {case.name} | {case.floor_bytes_per_elem()} | {floor / sec / 1e9:.3g} | "
                  f"{sec / (floor / copy):.2f} | {versus} |")  # fmt: skip


if __name__ == "__main__":
    main()
