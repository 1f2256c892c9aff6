"""Calibration memory of one-shot vs sequential Wanda / SparseGPT at Llama-3-8B shapes.

Command (from the repository root; CPU, no GPU, a few minutes):

    python packages/sparse-kernels/benchmarks/calibration_memory.py [--samples 128 --seq 2048]

Two numbers per mode and method:

* formula: the statistics alone, from the shapes: a SparseGPT Hessian is in_features² fp32 per
  Linear (Wanda: in_features fp32); one-shot holds every decoder Linear's, sequential one
  layer's.
* measured with fake tensors: the same walk the library runs (`collect_input_stats` for
  one-shot, `prune_sequential_` for sequential) on a bf16 `LlamaForCausalLM` built from the
  Llama-3-8B config under `FakeTensorMode` (shapes and dtypes, no storage), with
  `LiveBytes` recording the peak of live tensor storage bytes (MemTracker's method: weak
  references to every storage an op creates; MemTracker itself refuses a module called more
  than once per iteration, which a layer walk does).
  The pruning itself is a no-op here (`sparsegpt_prune` checks tensor values, which fake
  tensors do not have), so one Linear's pruner temporaries (about 5 in² fp32 + 2 rows·cols
  fp32 for SparseGPT) come on top of the sequential peak.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm_testing import bench
from leanlm_testing.memory import LiveBytes
from leanlm_testing.models import llama3_8b_config

GIB = 2**30
MIB = 2**20
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def in_features(config: Any) -> list[int]:
    """in_features of the 7 Linears of one decoder layer."""
    h, i = config.hidden_size, config.intermediate_size
    return [h, h, h, config.num_attention_heads * (h // config.num_attention_heads), h, h, i]


def formula_bytes(config: Any, *, hessian: bool) -> tuple[int, int]:
    """(one layer's, all layers') statistics bytes: Σ in² · 4 (+ in · 4 for the sumsq)."""
    one = sum(4 * n * n * hessian + 4 * n for n in in_features(config))
    return one, one * config.num_hidden_layers


def measure(
    config: Any, *, sequential: bool, hessian: bool, samples: int, seq: int, batch: int
) -> tuple[int, int]:
    """(weights and buffers bytes, peak live bytes) of the calibration walk on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaForCausalLM

    from sparse_kernels.calibration import collect_input_stats
    from sparse_kernels.sequential import prune_sequential_
    from sparse_kernels.sparsify import select_targets

    with FakeTensorMode():
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
        batches = [
            {"input_ids": torch.randint(0, config.vocab_size, (batch, seq))}
            for _ in range(samples // batch)
        ]
        modules = select_targets(model)
        tracker = LiveBytes()
        for t in [*model.parameters(), *model.buffers()]:
            tracker.add(t)
        weights = tracker.live
        with tracker:
            if sequential:

                def prune(name: str, linear: nn.Linear, stats: object) -> None:
                    del stats  # the pruning itself is not run on fake tensors

                prune_sequential_(model, modules, batches, prune, hessian=hessian)
            else:
                stats = collect_input_stats(model, modules, batches, hessian=hessian)
                del stats
    return weights, tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    config = llama3_8b_config(args.layers)
    sha = bench.git_revision(Path(__file__).resolve().parents[1])
    import transformers

    print(
        f"# calibration_memory: git {sha}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; fake tensors on CPU"
    )
    print(
        f"# Llama-3-8B shapes, {args.layers} layers, bf16 model; calibration "
        f"{args.samples} x {args.seq} tokens in batches of {args.batch}"
    )
    print(
        "| method | mode | statistics, formula MiB | peak live, measured (fake) GiB | "
        "of which weights GiB | peak beyond weights GiB |"
    )
    print("|---|---|---|---|---|---|")
    for method, hessian in (("wanda", False), ("sparsegpt", True)):
        one, every = formula_bytes(config, hessian=hessian)
        for sequential in (False, True):
            params, total = measure(
                config,
                sequential=sequential,
                hessian=hessian,
                samples=args.samples,
                seq=args.seq,
                batch=args.batch,
            )
            stats = one if sequential else every
            mode = "sequential" if sequential else "one-shot"
            print(
                f"| {method} | {mode} | {stats / MIB:.1f} | {total / GIB:.2f} | "
                f"{params / GIB:.2f} | {(total - params) / GIB:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
