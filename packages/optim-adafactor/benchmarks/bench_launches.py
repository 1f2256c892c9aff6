#!/usr/bin/env python
"""Triton launches and torch ops per fused Adafactor step (measured), DRAM bytes (computed).

Command (from the repository root; RESULTS.md was made with it):

    python packages/optim-adafactor/benchmarks/bench_launches.py

Counts: `leanlm_testing.launches.step_counts` (see there) on Llama-shaped parameter sets, for
the per-tensor kernels, the multi-tensor step and the PyTorch path; the multi-tensor step's
launches are those of its launch plan at full size (groups appear beyond 2^24 column
partials). DRAM bytes per element: computed from the kernels at the full sizes. A100/H100
times: `leanlm_testing.roofline` predictions (a stated model, not measurements).
"""

from __future__ import annotations

import os
from functools import partial

import torch

if not torch.cuda.is_available():  # before the kernels' modules read it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_adafactor import Config

from leanlm_testing import bench, roofline
from leanlm_testing.kernels import shipped_launch_configs
from leanlm_testing.launches import path_counts
from optim_adafactor import (
    Adafactor,
    _kernels,
)
from optim_adafactor import (
    _multi_kernels as _multi,
)
from optim_adafactor import (
    _multi_vec_kernels as _multi_vec,
)
from optim_adafactor.multi_tensor import Launch, plan_launches

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
#: (momentum, parameter scale) -> the SETTINGS entry's kwargs
SETTINGS_KW = {("beta1" in kw, kw.get("scale_parameter", True) is not False): kw
               for kw in SETTINGS.values()}  # fmt: skip
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


GPU_TILES = ["optim_adafactor._multi_tables", _multi.__name__]


def plan(shape_list: list[tuple[int, ...]], kw: dict[str, object]) -> list[Launch]:
    """The launches of the full-size multi-tensor step on a GPU (its tiles; meta tensors)."""
    with shipped_launch_configs(GPU_TILES):
        return plan_launches(
            lambda ps: Adafactor(ps, backend="triton", **kw), shape_list, torch.bfloat16
        )


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
    its second sweep an L2 hit; column partials 2 x 4 B per column per row item, written
    and read; row/column state r/w; apply G + 2P (+2M): the bytes the launch plan records
    (`optim_adafactor.multi_tensor.plan_launches`, at the GPU's tiles). Per-tensor:
    statistics G (+P) and its per-16-row column partials (4 B written, read), Σu² G, apply
    G + 2P (+2M).
    """
    mats = [s for s in shape_list if len(s) == 2]
    n_el = sum(n * m for n, m in mats)
    g = p = 2
    rows, cols = sum(n for n, _ in mats), sum(m for _, m in mats)
    out: dict[str, float] = {}
    if multi:  # the launch plan of the real step (GPU tiles, meta tensors)
        for launch in plan(mats, SETTINGS_KW[(momentum, scale)]):
            out[launch.kernel] = out.get(launch.kernel, 0.0) + launch.bytes
    else:
        partial = sum(-(-n // 16) * m for n, m in mats)
        out["_stats_kernel"] = n_el * (g + (p if scale else 0)) + 4 * rows + 8 * partial
        out["_sumsq_kernel"] = n_el * g + 8 * (rows + cols)
        out["_apply_kernel"] = n_el * (g + 2 * p + (8 if momentum else 0)) + 8 * (rows + cols)
    return out, n_el


def main() -> None:
    device = bench.start("bench_launches (optim-adafactor)")
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
                launches, ops = path_counts(
                    partial(Adafactor, **kw), shape_list, MODULES, path, gpu_tiles=GPU_TILES,
                    plan=partial(plan, shape_list, kw),
                )  # fmt: skip
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
