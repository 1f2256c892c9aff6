#!/usr/bin/env python
"""Optimizer-state bytes per parameter of CAME by `state_dtype`, and of bitsandbytes' AdamW8bit.

Command (from the repository root; RESULTS.md's numbers were taken with it):

    python packages/optim-came/benchmarks/bench_state_bytes.py

The parameters live on the meta device (no memory, no compute): `CAME.init_state()` creates the
state a first step would create, and bitsandbytes' `AdamW8bit` (defaults: 8-bit moments for
tensors of >= 4096 elements; when bitsandbytes imports) creates it with its own `init_state`,
the method its first `step()` calls for each parameter. The bytes are counted from the state's
tensors (`leanlm_testing.bench.state_bytes`: `numel · element_size`, a tensor shared by several
parameters' states, such as bitsandbytes' quantization maps, once). Exact for any device: the
state's shapes and dtypes do not depend on it (bitsandbytes' blocks are 256 elements on every
device). A real AdamW8bit step on the CPU (a 1-layer set) checks the meta count. Sets:
TinyLlama-1.1B (2 x 32000x2048 embeddings, 22 layers, GQA kv 256, 45 norm vectors) and
Llama-2-7B (32 layers, hidden 4096, intermediate 11008).
"""

from __future__ import annotations

import importlib
import pathlib
from types import ModuleType

import torch

from leanlm_testing import bench
from leanlm_testing.bench import LlamaShapes
from optim_came import CAME

SETS = {
    "TinyLlama-1.1B": LlamaShapes(hidden=2048, intermediate=5632, layers=22, vocab=32000,
                                  kv_hidden=256),
    "Llama-2-7B": LlamaShapes(hidden=4096, intermediate=11008, layers=32, vocab=32000),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def state_bytes_per_param(shapes: list[tuple[int, ...]], state_dtype: torch.dtype) -> float:
    """State bytes / parameters of CAME(state_dtype=...) over meta parameters of `shapes`."""
    params = [torch.empty(s, device="meta", requires_grad=True) for s in shapes]
    opt = CAME(params, lr=1e-3, state_dtype=state_dtype)
    opt.init_state()
    return bench.state_bytes(opt) / sum(p.numel() for p in params)


def adamw8bit_state(
    bnb: ModuleType, shapes: list[tuple[int, ...]], *, device: str = "meta"
) -> tuple[float, float]:
    """(state bytes / parameter, share of parameters with 8-bit moments) of `AdamW8bit`.

    On "meta" the state comes from `init_state`, elsewhere from one real step (zero gradients).
    """
    params = [torch.zeros(s, device=device, requires_grad=True) for s in shapes]
    opt = bnb.optim.AdamW8bit(params, lr=1e-3)
    for gindex, group in enumerate(opt.param_groups):
        for pindex, p in enumerate(group["params"]):
            if device == "meta":
                opt.init_state(group, p, gindex, pindex)
            p.grad = torch.zeros_like(p)
    if device != "meta":
        opt.step()
    n = sum(p.numel() for p in params)
    low = sum(p.numel() for p in params if opt.state[p]["state1"].dtype == torch.uint8)
    return bench.state_bytes(opt) / n, low / n


def main() -> None:
    print(bench.header("bench_state_bytes", "meta", ["optim-came", "bitsandbytes"],
                       where=pathlib.Path(__file__).parents[1]))  # fmt: skip
    try:
        bnb: ModuleType | None = importlib.import_module("bitsandbytes")
    except ImportError as err:
        bnb = None
        print(f"# bitsandbytes does not import ({err}): no AdamW8bit column")
    columns = [f"CAME {d} state" for d in DTYPES]
    columns += ["bnb AdamW8bit", "AdamW8bit: params in 8 bits"] if bnb else []
    print("\n| parameter set | parameters | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for name, llama in SETS.items():
        shapes = llama.shapes()
        n = sum(torch.Size(s).numel() for s in shapes)
        cells = [f"{state_bytes_per_param(shapes, d):.4f}" for d in DTYPES.values()]
        if bnb:
            per, share = adamw8bit_state(bnb, shapes)
            cells += [f"{per:.4f}", f"{share:.4%}"]
        print(f"| {name} | {n / 1e9:.3f}B | " + " | ".join(cells) + " |")
    if bnb:
        small = LlamaShapes(layers=1).shapes()
        meta, real = adamw8bit_state(bnb, small)[0], adamw8bit_state(bnb, small, device="cpu")[0]
        n = sum(torch.Size(s).numel() for s in small)
        print(f"\ncheck, AdamW8bit on LlamaShapes(layers=1) ({n / 1e6:.1f}M params): meta "
              f"init_state {meta:.6f} B/param, one real CPU step {real:.6f}")  # fmt: skip
        if meta != real:
            raise RuntimeError(f"meta count {meta} != real step's {real}: the table is wrong")


if __name__ == "__main__":
    main()
