#!/usr/bin/env python
"""Optimizer-state bytes per parameter of CAME by `state_dtype`, on Llama-shaped parameter sets.

Command (from the repository root; RESULTS.md's numbers were taken with it):

    python packages/optim-came/benchmarks/bench_state_bytes.py

The parameters live on the meta device (no memory, no compute): `CAME.init_state()` creates the
state a first step would create, and its bytes are counted from the tensors' shapes and dtypes
(`numel · element_size` over every state tensor). Exact for any device: the state's shapes and
dtypes do not depend on it. Sets: TinyLlama-1.1B (2 x 32000x2048 embeddings, 22 layers, GQA
kv 256, 45 norm vectors) and Llama-2-7B (32 layers, hidden 4096, intermediate 11008).
"""

from __future__ import annotations

import pathlib

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
    nbytes = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return nbytes / sum(p.numel() for p in params)


def main() -> None:
    print(bench.header("bench_state_bytes", "meta", ["optim-came"],
                       where=pathlib.Path(__file__).parents[1]))  # fmt: skip
    print("\n| parameter set | parameters | " + " | ".join(DTYPES) + " |")
    print("|---|---:|" + "---:|" * len(DTYPES))
    for name, llama in SETS.items():
        shapes = llama.shapes()
        n = sum(torch.Size(s).numel() for s in shapes)
        cells = [f"{state_bytes_per_param(shapes, d):.4f}" for d in DTYPES.values()]
        print(f"| {name} | {n / 1e9:.3f}B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
