#!/usr/bin/env python
"""Peak memory of importance scoring at Llama-3-8B shapes, measured on fake tensors (no weights).

Command (from the repository root):
    python packages/prune-distill/benchmarks/bench_importance_memory.py [--layers 32] [--json F]

The model is `LlamaForCausalLM` built from a Llama-3-8B config (vocab 128256, hidden 4096,
32 layers, 32 query / 8 KV heads, MLP 14336, untied embeddings) in bf16 under `FakeTensorMode`:
every tensor has its shape and dtype but no data, so an 8B model and its passes fit on a laptop.
`leanlm_testing.memory.LiveBytes` counts the bytes of the tensors the run creates while they are
alive (the weights and inputs are not counted); the table gives their peak. Rows:

* `forward`: one `no_grad` forward pass, output dropped (the anchor);
* `forward + LM loss`: the same with the summed next-token loss of its logits;
* `collect_importance(layer_loss=False)` / `(layer_loss=True)`: the scoring on one calibration
  batch (every statistic hook, and with the LM-loss metric one more pass per skipped layer).

Fake tensors have no values, so `collect_importance` stops at its last line, where it reads its
token counts on the host: after every pass, so the peak is complete.
Attention runs PyTorch's CPU SDPA kernels (a GPU would pick flash / memory-efficient ones).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import LlamaForCausalLM

from leanlm_testing.memory import LiveBytes
from leanlm_testing.models import llama3_8b_config
from prune_distill import collect_importance
from prune_distill.importance import _nll_sum, lm_targets

GIB = 2**30
WORKLOADS = ((1, 4096), (16, 256))  # (batch, seq): the 8B recipe's and leanlm's default batches


RUNS = (
    "forward",
    "forward + LM loss",
    "collect_importance(layer_loss=False)",
    "collect_importance(layer_loss=True)",
)


def run(name: str, model: Any, ids: torch.Tensor) -> None:
    """One row's work on the batch `ids`; nothing is kept."""
    batch = {"input_ids": ids}
    if name == "forward":
        model(**batch, use_cache=False)
    elif name == "forward + LM loss":
        _nll_sum(model(**batch, use_cache=False).logits, lm_targets(batch))
    else:
        collect_importance(model, [batch], layer_loss=name.endswith("=True)"))


def measure(name: str, model: Any, ids: torch.Tensor) -> int:
    """Peak bytes of the tensors `run(name, ...)` creates (beyond the weights and `ids`)."""
    tracker = LiveBytes()
    for t in [*model.parameters(), *model.buffers(), ids]:
        tracker.ignore(t)
    try:
        with tracker, torch.no_grad():
            run(name, model, ids)
    except DataDependentOutputException:
        pass  # collect_importance's final host read of its token counts (see the docstring)
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with FakeTensorMode():
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(llama3_8b_config(args.layers)).eval()
        finally:
            torch.set_default_dtype(default)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"weights {weights / GIB:.3f} GiB ({args.layers} layers, bf16)")
        for batch, seq in WORKLOADS:
            ids = torch.randint(0, model.config.vocab_size, (batch, seq))
            for name in RUNS:
                peak = measure(name, model, ids)
                rows.append({"batch": batch, "seq": seq, "run": name, "peak_bytes": peak})
                print(f"B={batch:2d} S={seq:4d} {name:38s} {peak / GIB:7.3f} GiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "weight_bytes": weights, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
