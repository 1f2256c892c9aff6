#!/usr/bin/env python
"""Triton launches and torch ops per fused CAME step (measured), DRAM bytes (computed).

Command (from the repository root; RESULTS.md was made with it):

    python packages/optim-came/benchmarks/bench_launches.py

The method is optim-adafactor's `benchmarks/bench_launches.py` (counted launches, the launch
plan at full size, computed bytes, roofline predictions rather than measured GPU times), applied
to CAME, whose steps also launch optim-adafactor's statistics and column kernels.
"""

from __future__ import annotations

import os
from functools import partial

import torch

if not torch.cuda.is_available():  # before the kernels' modules read it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_came import Config

from leanlm_testing import bench, roofline
from leanlm_testing.kernels import shipped_launch_configs
from leanlm_testing.launches import path_counts
from optim_adafactor import _kernels as af_kernels
from optim_adafactor import _multi_kernels as af_multi
from optim_adafactor import _multi_stats_kernels as af_stats
from optim_adafactor.multi_tensor import Launch, plan_launches
from optim_came import CAME, _kernels
from optim_came import _multi_kernels as _multi
from optim_came import _multi_vec_kernels as _multi_vec

MODULES = [_multi, _multi_vec, _kernels, af_multi, af_stats, af_kernels]  # whose launches count
OPTIMIZER = partial(CAME, lr=1e-4, weight_decay=0.01)

MODELS = {
    "48 matrices": Config(hidden=1024, intermediate=2816, layers=0, vocab=32000),
    "bench model (50M)": Config(),
    "Llama-3.2-1B shape": Config(hidden=2048, intermediate=8192, layers=16, vocab=128256),
}


def shapes(name: str) -> list[tuple[int, ...]]:
    """The model's parameter shapes; '48 matrices' cycles one layer's 7 matrices."""
    if name == "48 matrices":
        layer = [
            s for s in Config(hidden=1024, intermediate=2816, layers=1).shapes() if len(s) == 2
        ][2:9]
        return [layer[i % 7] for i in range(48)]
    return MODELS[name].shapes()


GPU_TILES = ["optim_adafactor._multi_tables", af_multi.__name__, _multi.__name__]


def plan(shape_list: list[tuple[int, ...]]) -> list[Launch]:
    """The launches of the full-size multi-tensor step on a GPU (its tiles; meta tensors)."""
    with shipped_launch_configs(GPU_TILES):
        return plan_launches(partial(OPTIMIZER, backend="triton"), shape_list, torch.bfloat16)


def traffic(
    shape_list: list[tuple[int, ...]], *, gpu: roofline.Gpu, multi: bool
) -> tuple[dict[str, float], int]:
    """DRAM bytes per kernel of one step over the 2-D matrices (bf16 g/p, fp32 m), and N.

    Multi-tensor: statistics G (second sweep: L2) + 8 B partials per column per row item;
    momentum G + 2M + 4 B partials; apply M + 2P; O(n + m) state: the bytes the launch plan
    records (`optim_adafactor.multi_tensor.plan_launches`, at the GPU's tiles). Per-tensor:
    statistics G + 4 B partials per column per 16 rows, Σu² G, momentum G + 2M + partials,
    apply M + 2P.
    """
    mats = [s for s in shape_list if len(s) == 2]
    n_el = sum(n * m for n, m in mats)
    g = p = 2
    mom = 4
    rows, cols = sum(n for n, _ in mats), sum(m for _, m in mats)
    out: dict[str, float] = {}
    if multi:  # the launch plan of the real step (GPU tiles, meta tensors)
        for launch in plan(mats):
            name = launch.kernel
            if name in ("_mt_cols_kernel", "_mt_scalars_kernel"):
                name += " (x2)"
            out[name] = out.get(name, 0.0) + launch.bytes
    else:
        partial = sum(-(-n // 16) * m for n, m in mats)
        out["_stats_kernel"] = n_el * g + 4 * rows + 8 * partial
        out["_sumsq_kernel"] = n_el * g + 8 * (rows + cols)
        out["_momentum_kernel"] = n_el * (g + 2 * mom) + 8 * partial + 8 * (rows + cols)
        out["_apply_kernel"] = n_el * (mom + 2 * p) + 8 * (rows + cols)
    return out, n_el


def main() -> None:
    device = bench.start("bench_launches (optim-came)")
    print(
        "# bf16 parameters and gradients, fp32 state; lr 1e-4, weight decay 0.01; counts: "
        "third step; "
        + ("full sizes" if device == "cuda" else "kernels recorded, not executed; dims <= 64")
    )
    floor = 2 + 2 * 2 + 2 * 4  # read g, read/write p and m (the floor, 14 B)
    print(
        "\n| model | path | Triton launches | torch ops | DRAM B/elem (computed) | "
        "/ 14 B floor | A100 ms (model) | H100 ms (model) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in MODELS:
        shape_list = shapes(model)
        for path in ("torch", "per-tensor", "multi"):
            launches, ops = path_counts(
                OPTIMIZER, shape_list, MODULES, path, gpu_tiles=GPU_TILES,
                plan=partial(plan, shape_list),
            )  # fmt: skip
            cells = ["-"] * 4
            if path != "torch":
                bpe, times = roofline.predict_on_gpus(
                    partial(traffic, shape_list, multi=path == "multi"),
                    launches=launches,
                    torch_ops=ops,
                )
                cells = [
                    f"{bpe:.2f}",
                    f"{bpe / floor:.2f}",
                    f"{times[0] * 1e3:.2f}",
                    f"{times[1] * 1e3:.2f}",
                ]
            print(f"| {model} | {path} | {launches} | {ops} | " + " | ".join(cells) + " |")
    print(f"\n# predictions: {roofline.assumptions()}")
    print("\n## DRAM bytes per element per kernel (computed; bench model, H100 row chunks)\n")
    for multi in (False, True):
        per_kernel, n_el = traffic(shapes("bench model (50M)"), gpu=roofline.H100, multi=multi)
        for name, total in per_kernel.items():
            print(f"- `{name}`: {total / n_el:.3f} B/elem")


if __name__ == "__main__":
    main()
