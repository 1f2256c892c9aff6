#!/usr/bin/env python
"""Prune time, importance-collection throughput and KL-loss time on a ~50M Llama-shaped model.

Command (from the repository root):
    python packages/prune-distill/benchmarks/bench_prune.py [--repeats 5] [--json out.json]

The model is built from a config (random weights; no download): vocab 32000, hidden 512,
12 layers, 8 query / 2 KV heads of 64, MLP 1536, tied embeddings (~52M parameters). Each number is
the median of `--repeats` rounds after one warm-up run; the systems compared in a group (anchor and
importance collection; the three prunes; the two KL losses) are timed in turn in every round.
Throughput counts non-padding tokens.
The anchor for importance collection is a plain `torch.no_grad` forward over the same batches
(hooks and statistics are the overhead on top of it).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from leanlm_testing import bench
from leanlm_testing.models import LlamaShape, random_batches
from prune_distill import PruneTarget, collect_importance, forward_kl, prune

SHAPE = LlamaShape(vocab=32000, hidden=512, layers=12, heads=8, kv_heads=2, ffn=1536)


@dataclass(frozen=True)
class BenchConfig:
    """Model shape and workload."""

    shape: LlamaShape = SHAPE
    batch_size: int = 4
    seq_len: int = 256
    batches: int = 2
    repeats: int = 5


@dataclass(frozen=True)
class Result:
    """One timed benchmark."""

    name: str
    median_s: float
    detail: str


def run(cfg: BenchConfig) -> dict[str, Any]:
    model = cfg.shape.model(max_position_embeddings=cfg.seq_len, tie_word_embeddings=True)
    n_params = sum(p.numel() for p in model.parameters())
    batches = random_batches(
        cfg.shape.vocab, batches=cfg.batches, batch_size=cfg.batch_size, seq_len=cfg.seq_len
    )
    tokens = cfg.batches * cfg.batch_size * cfg.seq_len
    results: list[Result] = []

    def forward_only() -> None:
        with torch.no_grad():
            for b in batches:
                model(**b, use_cache=False)

    t = bench.interleaved_medians(
        {
            "anchor": forward_only,
            "importance": lambda: collect_importance(model, batches, layer_loss=False),
            "importance+loss": lambda: collect_importance(model, batches, layer_loss=True),
        },
        rounds=cfg.repeats,
    )
    t_fwd, t_imp, t_loss = t["anchor"], t["importance"], t["importance+loss"]
    results.append(Result("plain forward (anchor)", t_fwd, f"{tokens / t_fwd:,.0f} tok/s"))
    results.append(
        Result(
            "collect_importance, layer_loss=False",
            t_imp,
            f"{tokens / t_imp:,.0f} tok/s, {t_imp / t_fwd:.2f}x the anchor",
        )
    )
    results.append(
        Result(
            "collect_importance, layer_loss=True",
            t_loss,
            f"{tokens / t_loss:,.0f} tok/s ({cfg.shape.layers + 1} forwards per batch), "
            f"{t_loss / t_fwd:.2f}x the anchor",
        )
    )

    scores = collect_importance(model, batches, layer_loss=False)
    targets = {
        "width (hidden 384, MLP 768, heads 4)": PruneTarget(
            hidden_size=384, intermediate_size=768, num_attention_heads=4
        ),
        "depth (12 -> 6 layers)": PruneTarget(num_hidden_layers=6),
        "no-op (copy)": PruneTarget(),
    }
    t = bench.interleaved_medians(
        {
            name: lambda target=target: prune(model, scores, target)
            for name, target in targets.items()
        },
        rounds=cfg.repeats,
    )
    for name, target in targets.items():
        small = prune(model, scores, target)
        n_small = sum(p.numel() for p in small.parameters())
        results.append(
            Result(
                f"prune {name}", t[name], f"{n_params / 1e6:.1f}M -> {n_small / 1e6:.1f}M params"
            )
        )

    n_rows = cfg.batch_size * cfg.seq_len
    s = torch.randn(n_rows, cfg.shape.vocab, requires_grad=True)
    t_logits = torch.randn(n_rows, cfg.shape.vocab)

    def kl_step(chunk: int | None) -> Callable[[], None]:
        def run() -> None:
            loss = forward_kl(s, t_logits, chunk_size=chunk)
            loss.backward()
            s.grad = None

        return run

    labels = {"plain autograd": None, "chunked 1024 rows": 1024}
    t = bench.interleaved_medians(
        {label: kl_step(chunk) for label, chunk in labels.items()}, rounds=cfg.repeats
    )
    for label in labels:
        results.append(
            Result(
                f"forward_kl fwd+bwd, {label}",
                t[label],
                f"{n_rows} tokens x {cfg.shape.vocab} vocab, fp32, {n_rows / t[label]:,.0f} tok/s",
            )
        )

    return {
        "config": asdict(cfg),
        "params": n_params,
        "results": [asdict(r) for r in results],
        "device": f"{bench.device_name('cpu')}, {torch.get_num_threads()} threads",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "git_sha": bench.git_revision(__file__),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    out = run(BenchConfig(repeats=args.repeats))
    print(f"# prune-distill bench_prune  (git {out['git_sha']}, {out['device']})")
    print(f"# {out['versions']}, model {out['params'] / 1e6:.1f}M params")
    print(f"{'benchmark':<44} {'median':>10}  detail")
    for r in out["results"]:
        print(f"{r['name']:<44} {r['median_s'] * 1e3:>8.1f}ms  {r['detail']}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
