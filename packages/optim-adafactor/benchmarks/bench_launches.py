#!/usr/bin/env python
"""Triton launches and torch ops per fused Adafactor step (measured), DRAM bytes (computed).

Command (from the repository root; RESULTS.md was made with it):

    python packages/optim-adafactor/benchmarks/bench_launches.py

Counts: `leanlm_testing.launches.step_counts` (see there) on Llama-shaped parameter sets, for
the per-tensor kernels, the multi-tensor step and the PyTorch path. DRAM bytes per element:
computed from the kernels at the full sizes. A100/H100 times: `leanlm_testing.roofline`
predictions (a stated model, not measurements).
"""

from __future__ import annotations

import os
from functools import partial

import torch

if not torch.cuda.is_available():  # before the kernels' modules read it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_adafactor import Config

from leanlm_testing import bench, roofline
from leanlm_testing.launches import step_counts
from optim_adafactor import (
    Adafactor,
    _kernels,
)
from optim_adafactor import (
    _multi_kernels as _multi,
)
from optim_adafactor import _multi_tables as mt
from optim_adafactor import (
    _multi_vec_kernels as _multi_vec,
)

MODULES = [_multi, _multi_vec, _kernels]  # whose Triton launches count

#: (name, Adafactor kwargs): defaults (parameter scaling, no momentum) and momentum settings.
SETTINGS = {
    "defaults (param scale)": {},
    "beta1=0.9, lr=1e-3, no scale": {
        "beta1": 0.9,
        "lr": 1e-3,
        "relative_step": False,
        "scale_parameter": False,
    },
    "beta1=0.9 (param scale)": {"beta1": 0.9},
}
MODELS = {
    "48 matrices": Config(hidden=1024, intermediate=2816, layers=0, vocab=32000),
    "bench model (50M)": Config(),
    "Llama-3.2-1B shape": Config(
        hidden=2048, intermediate=8192, layers=16, vocab=128256, kv_hidden=512
    ),
}


def shapes(name: str) -> list[tuple[int, ...]]:
    """The model's parameter shapes; '48 matrices' cycles one layer's 7 matrices."""
    cfg = MODELS[name]
    if name == "48 matrices":
        layer = [
            s
            for s in Config(hidden=1024, intermediate=2816, kv_hidden=1024).shapes()
            if len(s) == 2
        ][2:9]
        return [layer[i % 7] for i in range(48)]
    return cfg.shapes()


def traffic(
    shape_list: list[tuple[int, ...]],
    *,
    momentum: bool,
    scale: bool,
    gpu: roofline.Gpu,
    multi: bool,
) -> tuple[dict[str, float], int]:
    """DRAM bytes per kernel of one step over the 2-D matrices (bf16 g/p, fp32 state), and N.

    Vectors (norms) take the PyTorch path and are left out. Multi-tensor: statistics G (+P),
    its second sweep an L2 hit; column partials 2 x 4 B per column per row chunk, written
    and read; row/column state r/w; apply G + 2P (+2M). Per-tensor: statistics G (+P) and
    its per-16-row column partials (4 B written, read), Σu² G, apply G + 2P (+2M).
    """
    mats = [s for s in shape_list if len(s) == 2]
    n_el = sum(n * m for n, m in mats)
    g = p = 2
    rows, cols = sum(n for n, _ in mats), sum(m for _, m in mats)
    out: dict[str, float] = {}
    if multi:
        per_item = mt.item_rows(rows, 8, 4 * gpu.sms)
        partial = sum(-(-n // per_item) * m for n, m in mats)
        out["_mt_stats_kernel"] = n_el * (g + (p if scale else 0)) + 8 * rows + 8 * partial
        out["_mt_cols_kernel"] = 8 * partial + 12 * cols
        out["_mt_scalars_kernel"] = 0.0  # O(row chunks + column tiles): a few KB
        out["_mt_apply_kernel"] = n_el * (g + 2 * p + (8 if momentum else 0)) + 4 * rows
    else:
        partial = sum(-(-n // 16) * m for n, m in mats)
        out["_stats_kernel"] = n_el * (g + (p if scale else 0)) + 4 * rows + 8 * partial
        out["_sumsq_kernel"] = n_el * g + 8 * (rows + cols)
        out["_apply_kernel"] = n_el * (g + 2 * p + (8 if momentum else 0)) + 8 * (rows + cols)
    return out, n_el


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(bench.header("bench_launches (optim-adafactor)", device))
    print(
        "# bf16 parameters and gradients, fp32 state; counts: third step; "
        + ("full sizes" if device == "cuda" else "kernels recorded, not executed; dims <= 64")
    )
    print(
        "\n| model | setting | path | Triton launches | torch ops | DRAM B/elem (computed) | "
        "floor B/elem | / floor | A100 ms (model) | H100 ms (model) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in MODELS:
        shape_list = shapes(model)
        for setting, kw in SETTINGS.items():
            momentum, scale = "beta1" in kw, kw.get("scale_parameter", True) is not False
            floor = 2 + 2 * 2 + (8 if momentum else 0)  # read g, read/write p (and m)
            for path in ("torch", "per-tensor", "multi"):
                launches, ops = step_counts(partial(Adafactor, **kw), shape_list, MODULES, path)
                cells = ["-"] * 5
                if path != "torch":
                    bpe, times = roofline.predict_on_gpus(
                        partial(
                            traffic,
                            shape_list,
                            momentum=momentum,
                            scale=scale,
                            multi=path == "multi",
                        ),
                        launches=launches,
                        torch_ops=ops,
                    )
                    cells = [
                        f"{bpe:.2f}",
                        f"{floor}",
                        f"{bpe / floor:.2f}",
                        f"{times[0] * 1e3:.2f}",
                        f"{times[1] * 1e3:.2f}",
                    ]
                print(
                    f"| {model} | {setting} | {path} | {launches} | {ops} | "
                    + " | ".join(cells)
                    + " |"
                )
    print(f"\n# predictions: {roofline.assumptions()}")
    print(
        "\n## DRAM bytes per element per kernel (computed; bench model, beta1=0.9 + param scale,"
        " H100 row chunks)\n"
    )
    for multi in (False, True):
        per_kernel, n_el = traffic(
            shapes("bench model (50M)"), momentum=True, scale=True, gpu=roofline.H100, multi=multi
        )
        for name, total in per_kernel.items():
            print(f"- `{name}`: {total / n_el:.3f} B/elem")


if __name__ == "__main__":
    main()
