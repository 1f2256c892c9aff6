#!/usr/bin/env python
"""The launches one fused CAME / Adafactor step makes on a GPU, computed without a GPU.

Usage: python tools/launch_plan.py --out FILE.json [--markdown FILE.md] [--check]

Each case steps the real optimizer on meta tensors (`optim_adafactor.multi_tensor.plan_launches`:
the step's own launch code runs, with the GPU tiles, and records each launch instead of making it).
One JSON record per launch of the steady-state step: `optimizer` (came | came-int8 | adafactor |
adafactor-int8), `case`, `kernel`, `programs`, `max_elements` and `mean_elements` (per program:
elements of the parameter a program steps, or the partial sums it reduces) and `bytes` (DRAM
bytes that launch moves, computed from the kernel). `--check` exits 1 unless every launch gives
a program at most 64K elements and every launch moving more than 64 MB has at least 4 x 132
programs (4 per SM of an H100) and max/mean elements per program <= 2.
Run it without TRITON_INTERPRET (the interpreter's tiles are not the GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from leanlm_testing.bench import LlamaShapes
from optim_adafactor import Adafactor
from optim_adafactor.multi_tensor import plan_launches
from optim_came import CAME

SMS = 132  # H100 SXM
MIN_PROGRAMS = 4 * SMS
BIG_BYTES = 64 * 2**20
MAX_IMBALANCE = 2.0
MAX_ELEMENTS = 1 << 16  # per program, every launch (a row item: R whole rows, R·cols <= 64K)

# TinyLlama: 2 x 32000x2048, 22 x {q, k, v, o, gate, up, down}, 45 vectors of 2048
TINYLLAMA = LlamaShapes(hidden=2048, intermediate=5632, layers=22, vocab=32000, kv_hidden=256)
# bench_came.py's CUDA parameter set (its CUDA_CONFIG)
BENCH = LlamaShapes(hidden=2048, intermediate=5632, layers=4, vocab=32000)
#: name -> (parameter shapes, parameter and gradient dtype)
CASES: dict[str, tuple[LlamaShapes, torch.dtype]] = {
    "tinyllama-1.1b": (TINYLLAMA, torch.bfloat16),
    "bench-336m": (BENCH, torch.bfloat16),
    "bench-336m-fp32": (BENCH, torch.float32),
}


def optimizers(dtype: torch.dtype) -> dict[str, Callable[[list[Any]], torch.optim.Optimizer]]:
    """The settings of `../shared/gpu/e2e_step.py` (bf16: bf16 first moment, SR).

    `came-int8`: the same with an int8 first moment (`state_dtype=torch.int8`);
    `adafactor-int8`: Adafactor with a momentum (`beta1=0.9`) in int8.
    """
    kw: dict[str, Any] = {"lr": 1e-4, "stochastic_rounding": dtype == torch.bfloat16}
    kw["backend"] = "triton"
    return {
        "came": lambda ps: CAME(ps, state_dtype=dtype, **kw),
        "came-int8": lambda ps: CAME(ps, state_dtype=torch.int8, **kw),
        "adafactor": lambda ps: Adafactor(ps, relative_step=False, scale_parameter=False, **kw),
        "adafactor-int8": lambda ps: Adafactor(
            ps, relative_step=False, scale_parameter=False, beta1=0.9, state_dtype=torch.int8, **kw
        ),
    }


def records() -> list[dict[str, Any]]:
    out = []
    for case, (shapes, dtype) in CASES.items():
        for name, make in optimizers(dtype).items():
            for launch in plan_launches(make, shapes.shapes(), dtype):
                record: dict[str, Any] = {"optimizer": name, "case": case}
                record.update(kernel=launch.kernel, programs=launch.programs)
                record.update(max_elements=launch.max_elements, bytes=launch.bytes)
                record["mean_elements"] = round(launch.mean_elements, 1)
                out.append(record)
    return out


def failures(recs: list[dict[str, Any]]) -> list[str]:
    """The launches that miss the targets (see the module docstring)."""
    bad = []
    for r in recs:
        what = f"{r['optimizer']} {r['case']} {r['kernel']}"
        if r["max_elements"] > MAX_ELEMENTS:
            bad.append(f"{what}: {r['max_elements']} elements in a program")
        if r["bytes"] <= BIG_BYTES:
            continue
        imbalance = r["max_elements"] / max(r["mean_elements"], 1e-9)
        if r["programs"] < MIN_PROGRAMS or imbalance > MAX_IMBALANCE:
            bad.append(
                f"{what}: {r['programs']} programs, max/mean {imbalance:.2f}, "
                f"{r['bytes'] / 2**20:.0f} MiB"
            )
    return bad


def markdown(recs: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer | case | kernel | programs | max elements | mean elements | MiB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in recs:
        cells = [r["optimizer"], r["case"], f"`{r['kernel']}`", r["programs"]]
        cells += [r["max_elements"], f"{r['mean_elements']:.0f}", f"{r['bytes'] / 2**20:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1 (the plan uses the GPU's tiles)")
    recs = records()
    args.out.write_text(json.dumps({"records": recs}, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(recs))
    bad = failures(recs)
    for line in bad:
        print(f"target missed: {line}", file=sys.stderr)
    print(f"{len(recs)} launches planned, {len(bad)} missing the targets -> {args.out}")
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
