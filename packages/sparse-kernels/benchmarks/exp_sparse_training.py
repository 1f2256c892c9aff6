#!/usr/bin/env python
"""Experiment: sparse training schedules and one-shot 2:4 methods on a tiny Llama (CPU).

Command (from the repository root):
    python packages/sparse-kernels/benchmarks/exp_sparse_training.py [--steps 200]

Data: bytes of the CPython standard library's .py files (vocab 256, no tokenizer), a 95/5
train/validation split by file. Model: Llama, hidden 64, 2 layers, 4 heads (2 KV), MLP 176.
Part 1 trains from scratch for `--steps` AdamW steps with equal budgets: dense, sparse from
the start (unstructured magnitude mask at init on every decoder Linear) at 50 / 75 / 87.5%, and
gradual cubic pruning to 87.5% (ending at 75% of the steps). Part 2 prunes the trained dense
model one-shot to 2:4 with magnitude, Wanda and SparseGPT (calibration: 8 training batches),
then fine-tunes each sparse model for `--finetune` steps with its mask held (the dense model
gets the same extra steps as the baseline).
Reported: validation perplexity (mean over `--eval-batches` fixed batches).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparse_kernels import GradualPruning, SparseFromStart, SparsityConfig, sparsify_


def load_corpus(limit_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(0).shuffle(files)
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for i, f in enumerate(files):
        if "test" in f.parts:
            continue
        data = f.read_bytes()
        (val if i % 20 == 0 else train).append(data)
        total += len(data)
        if total > limit_bytes:
            break
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train).long(), as_tensor(val).long()


def batch(data: torch.Tensor, gen: torch.Generator, size: int, seq: int) -> dict[str, Any]:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=gen)
    ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
    return {"input_ids": ids}


def model_fn(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, batches: list[dict[str, Any]]) -> float:
    model.eval()
    losses = [float(model(**b, labels=b["input_ids"]).loss) for b in batches]
    model.train()
    return math.exp(sum(losses) / len(losses))


def train(model, data, steps, args, *, schedule=None, seed=1) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model.train()
    for _ in range(steps):
        b = batch(data, gen, args.batch, args.seq)
        loss = model(**b, labels=b["input_ids"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--finetune", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=16)
    args = parser.parse_args()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    )
    print(f"# exp_sparse_training: git {sha.stdout.strip()}, torch {torch.__version__}, CPU")
    print(f"# steps {args.steps}, batch {args.batch}x{args.seq} bytes, lr {args.lr}, AdamW wd 0.1")
    train_data, val_data = load_corpus(8_000_000)
    gen = torch.Generator().manual_seed(123)
    val = [batch(val_data, gen, args.batch, args.seq) for _ in range(args.eval_batches)]
    print(f"# corpus: {train_data.numel()} train / {val_data.numel()} validation bytes\n")

    print("| run | val ppl | time s |\n|---|---|---|")
    dense = None
    runs: list[tuple[str, Any]] = [("dense", None)]
    runs += [(f"sparse from start {s:.1%}", s) for s in (0.5, 0.75, 0.875)]
    runs += [("gradual cubic 0 -> 87.5%", "gradual")]
    for name, kind in runs:
        start = time.perf_counter()
        model = model_fn(0)
        schedule: Any = None
        if isinstance(kind, float):
            schedule = SparseFromStart(model, SparsityConfig(sparsity=kind))
        elif kind == "gradual":
            schedule = GradualPruning(
                model, final_sparsity=0.875, end_step=int(0.75 * args.steps),
                frequency=max(1, args.steps // 20),
            )  # fmt: skip
        train(model, train_data, args.steps, args, schedule=schedule)
        ppl = perplexity(model, val)
        print(f"| {name} | {ppl:.2f} | {time.perf_counter() - start:.0f} |", flush=True)
        if kind is None:
            dense = model

    assert dense is not None
    calib_gen = torch.Generator().manual_seed(7)
    calibration = [batch(train_data, calib_gen, args.batch, args.seq) for _ in range(8)]
    print(f"\n| one-shot 2:4 on the dense model | val ppl | after {args.finetune} sparse steps |")
    print("|---|---|---|")
    dense_ppl = perplexity(dense, val)
    model = copy.deepcopy(dense)
    train(model, train_data, args.finetune, args, seed=2)
    print(
        f"| dense (no pruning; same extra steps) | {dense_ppl:.2f} | {perplexity(model, val):.2f} |"
    )
    for method in ("magnitude", "wanda", "sparsegpt"):
        model = copy.deepcopy(dense)
        sparsify_(model, SparsityConfig(pattern="2:4", method=method), calibration=calibration)
        before = perplexity(model, val)
        train(model, train_data, args.finetune, args, seed=2)
        print(f"| {method} | {before:.2f} | {perplexity(model, val):.2f} |", flush=True)


if __name__ == "__main__":
    main()
