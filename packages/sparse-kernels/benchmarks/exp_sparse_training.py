#!/usr/bin/env python
"""Experiment: sparse training schedules and one-shot 2:4 methods on a tiny Llama (CPU).

Command (from the repository root; the full run of benchmarks/RESULTS.md):
    python packages/sparse-kernels/benchmarks/exp_sparse_training.py --seeds 0 1 2 \
        --json packages/sparse-kernels/benchmarks/sparse_training.json \
        --plot packages/sparse-kernels/benchmarks/sparse_training.png
    python .../exp_sparse_training.py --quick            # a ~1 min smoke run, one seed
    # or one process per seed (`--seeds 0 --json s0.json`, ...), then merge and plot:
    python .../exp_sparse_training.py --plot-only s0.json s1.json s2.json --json all.json \
        --plot X.png

Data: the leanlm corpus (`leanlm.data.load_corpus`: CPython standard library + pydoc topics,
first `--max-bytes`, split by file) and leanlm's byte-level BPE (`load_or_train_tokenizer`,
vocab `--vocab`), both cached in leanlm's cache dir. Model: Llama, hidden 64, 2 layers, 4 heads
(2 KV), MLP 176, tied embeddings. Validation: `--eval-windows` fixed windows of `--seq` tokens
spread over the validation split, the same for every arm and seed.

Per seed (model init and batch order): part 1 trains from scratch for `--steps` AdamW steps
(warm-up then cosine decay) with equal budgets: dense; sparse from the start (unstructured
magnitude mask at init on all 14 decoder Linears, attention and MLP) at each `--sparsities`;
gradual cubic pruning to the same sparsities (0 at step 0, s_f at 75% of the steps, re-mask
every steps/20). Part 2 prunes that seed's trained dense model one-shot to 2:4 with magnitude,
Wanda and SparseGPT (calibration: 8 training batches), then fine-tunes each for `--finetune`
steps with the mask held; the dense model gets the same extra steps as the baseline.
Reported: validation perplexity, per seed and as mean ± sample std over seeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparse_kernels import GradualPruning, SparseFromStart, SparsityConfig, sparsify_

ONESHOT: tuple[Literal["dense", "magnitude", "wanda", "sparsegpt"], ...] = (
    "dense", "magnitude", "wanda", "sparsegpt",
)  # fmt: skip


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, Any, str]:
    """(train stream, validation windows, tokenizer, corpus description) from leanlm."""
    from leanlm.config import DataConfig, TokenizerConfig
    from leanlm.data import load_corpus, spread_windows, tokenize_corpus
    from leanlm.stages import default_cache_dir
    from leanlm.tokenizer import load_or_train_tokenizer

    cache = default_cache_dir()
    corpus = load_corpus(
        DataConfig(max_bytes=args.max_bytes, seq_len=args.seq), cache_dir=cache / "datasets"
    )
    tokenizer, key = load_or_train_tokenizer(
        corpus, TokenizerConfig(vocab_size=args.vocab), cache_dir=cache
    )
    streams = tokenize_corpus(corpus, tokenizer, tokenizer_key=key)
    val = spread_windows(streams.validation, args.seq, args.eval_windows)
    return streams.train, val, tokenizer, corpus.description


def batch(data: torch.Tensor, gen: torch.Generator, size: int, seq: int) -> dict[str, Any]:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=gen)
    return {"input_ids": torch.stack([data[s : s + seq] for s in starts.tolist()])}


def model_fn(seed: int, tokenizer: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """exp(mean token loss) over `windows` (all of the same length)."""
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size]
        total += float(model(input_ids=w, labels=w).loss) * w.shape[0]
    model.train()
    return math.exp(total / windows.shape[0])


def lr_lambda(steps: int) -> Any:
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:  # warm-up, then cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def train(
    model: LlamaForCausalLM,
    data: torch.Tensor,
    steps: int,
    args: argparse.Namespace,
    *,
    lr: float,
    seed: int,
    schedule: Any = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    model.train()
    for _ in range(steps):
        b = batch(data, gen, args.batch, args.seq)
        loss = model(**b, labels=b["input_ids"]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if schedule is not None:
            schedule.step()


def run_seed(
    seed: int, train_data: torch.Tensor, val: torch.Tensor, tok: Any, args: argparse.Namespace
) -> dict[str, float]:
    """All arms for one seed: {arm name: validation perplexity}."""
    out: dict[str, float] = {}
    arms: list[tuple[str, Any]] = [("dense", None)]
    arms += [(f"from_start/{s}", ("start", s)) for s in args.sparsities]
    arms += [(f"gradual/{s}", ("gradual", s)) for s in args.sparsities]
    dense = None
    for name, kind in arms:
        start = time.perf_counter()
        model = model_fn(seed, tok)
        schedule: Any = None
        if kind is not None and kind[0] == "start":
            schedule = SparseFromStart(model, SparsityConfig(sparsity=kind[1]))
        elif kind is not None:
            schedule = GradualPruning(
                model, final_sparsity=kind[1], end_step=int(0.75 * args.steps),
                frequency=max(1, args.steps // 20),
            )  # fmt: skip
        train(model, train_data, args.steps, args, lr=args.lr, seed=seed, schedule=schedule)
        out[name] = perplexity(model, val, args.batch * 2)
        print(
            f"| {seed} | {name} | {out[name]:.3f} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )
        if kind is None:
            dense = model
    assert dense is not None
    calib_gen = torch.Generator().manual_seed(1000 + seed)
    calibration = [batch(train_data, calib_gen, args.batch, args.seq) for _ in range(8)]
    for method in ONESHOT:
        start = time.perf_counter()
        model = copy.deepcopy(dense)
        if method != "dense":
            sparsify_(model, SparsityConfig(pattern="2:4", method=method), calibration=calibration)
        out[f"oneshot/{method}/before"] = perplexity(model, val, args.batch * 2)
        train(model, train_data, args.finetune, args, lr=args.finetune_lr, seed=seed + 500)
        out[f"oneshot/{method}/after"] = perplexity(model, val, args.batch * 2)
        print(
            f"| {seed} | 2:4 {method} (before / after {args.finetune} steps) | "
            f"{out[f'oneshot/{method}/before']:.3f} / {out[f'oneshot/{method}/after']:.3f} | "
            f"{time.perf_counter() - start:.0f} |",
            flush=True,
        )
    return out


def summarize(per_seed: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """{arm: (mean, sample std)} over seeds (std 0 for one seed)."""
    arms = next(iter(per_seed.values())).keys()
    stats = {}
    for arm in arms:
        vals = [r[arm] for r in per_seed.values()]
        stats[arm] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return stats


def print_summary(stats: dict[str, tuple[float, float]], sparsities: list[float], n: int) -> None:
    def f(arm: str) -> str:
        return f"{stats[arm][0]:.2f} ± {stats[arm][1]:.2f}"

    dense = stats["dense"][0]
    print(f"\n## mean ± std over {n} seed(s): validation perplexity\n")
    print("| sparsity | sparse from start | gradual cubic | gap from start | gap gradual |")
    print("|---|---|---|---|---|")
    print(f"| 0 (dense) | {f('dense')} | | | |")
    for s in sparsities:
        a, g = f"from_start/{s}", f"gradual/{s}"
        print(
            f"| {s:.1%} | {f(a)} | {f(g)} | {stats[a][0] - dense:+.2f} | "
            f"{stats[g][0] - dense:+.2f} |"
        )
    print("\n| one-shot 2:4 on the trained dense model | before fine-tune | after fine-tune |")
    print("|---|---|---|")
    for m in ONESHOT:
        label = "dense (no pruning; same extra steps)" if m == "dense" else m
        print(f"| {label} | {f(f'oneshot/{m}/before')} | {f(f'oneshot/{m}/after')} |")


def plot(stats: dict[str, tuple[float, float]], meta: dict[str, Any], path: Path) -> None:
    """Left: perplexity vs sparsity (from start, gradual, dense band); right: one-shot 2:4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = meta["sparsities"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    d, dstd = stats["dense"]
    left.axhline(d, color="k", lw=1, label="dense")
    left.axhspan(d - dstd, d + dstd, color="k", alpha=0.1)
    for key, label, marker in (
        ("from_start", "sparse from start", "o"),
        ("gradual", "gradual", "s"),
    ):
        mean = [stats[f"{key}/{s}"][0] for s in sp]
        std = [stats[f"{key}/{s}"][1] for s in sp]
        pct = [100 * s for s in sp]
        left.errorbar(pct, mean, yerr=std, marker=marker, capsize=3, label=label)
    left.set_xlabel("sparsity of the 14 decoder Linears (%)")
    left.set_ylabel("validation perplexity")
    left.set_title(f"training, {meta['steps']} steps each")
    left.legend(frameon=False)
    x = range(len(ONESHOT))
    for i, (phase, label) in enumerate(
        (("before", "one-shot 2:4"), ("after", f"+ {meta['finetune']} sparse steps"))
    ):
        mean = [stats[f"oneshot/{m}/{phase}"][0] for m in ONESHOT]
        std = [stats[f"oneshot/{m}/{phase}"][1] for m in ONESHOT]
        right.bar([j + (i - 0.5) * 0.38 for j in x], mean, 0.38, yerr=std, capsize=3, label=label)
    low = min(stats[f"oneshot/{m}/{ph}"][0] - stats[f"oneshot/{m}/{ph}"][1]
              for m in ONESHOT for ph in ("before", "after"))  # fmt: skip
    right.set_ylim(bottom=0.9 * low)
    right.set_xticks(list(x), ["dense", "magnitude", "Wanda", "SparseGPT"])
    right.set_ylabel("validation perplexity")
    right.set_title("2:4 on the trained dense model")
    right.legend(frameon=False)
    fig.suptitle(
        f"tiny Llama, leanlm corpus (BPE {meta['vocab']}), mean ± std over "
        f"{len(meta['seeds'])} seeds",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"# plot: {path} ({path.stat().st_size / 1024:.0f} KB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--finetune", type=int, default=100)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.75, 0.875])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: shared CPU)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 40 + 10 steps")
    parser.add_argument("--json", type=Path, help="write per-seed results here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument(
        "--plot-only",
        type=Path,
        nargs="+",
        help="summarize (and redraw --plot) from --json files, merging their seeds",
    )
    args = parser.parse_args()
    if args.plot_only:  # e.g. one file per seed from parallel runs
        saved = [json.loads(p.read_text()) for p in args.plot_only]
        meta = saved[0]["meta"]
        per_seed: dict[str, dict[str, float]] = {}
        for part in saved:
            per_seed |= part["per_seed"]
        meta["seeds"] = sorted(int(s) for s in per_seed)
        stats = summarize(per_seed)
        print_summary(stats, meta["sparsities"], len(per_seed))
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "per_seed": per_seed}, indent=1) + "\n")
        if args.plot:
            plot(stats, meta, args.plot)
        return
    if args.quick:
        args.seeds, args.steps, args.finetune, args.eval_windows = [0], 40, 10, 16
    torch.set_num_threads(args.threads)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()
    print(f"# exp_sparse_training: git {sha}, torch {torch.__version__}, CPU")
    print(f"# torch threads {args.threads}")
    train_data, val, tok, description = load_data(args)
    print(f"# corpus: {description}; BPE vocab {len(tok)}")
    print(f"# {train_data.numel()} train tokens; validation {val.shape[0]} x {val.shape[1]} tokens")
    print(
        f"# seeds {args.seeds}, steps {args.steps}, batch {args.batch}x{args.seq} tokens, "
        f"lr {args.lr} (warm-up 5%, cosine to 10%), AdamW wd 0.1; 2:4 fine-tune "
        f"{args.finetune} steps at lr {args.finetune_lr}\n"
    )
    print("| seed | run | val ppl | time s |\n|---|---|---|---|")
    start = time.perf_counter()
    per_seed = {str(s): run_seed(s, train_data, val, tok, args) for s in args.seeds}
    print(f"# total {time.perf_counter() - start:.0f} s")
    stats = summarize(per_seed)
    print_summary(stats, args.sparsities, len(args.seeds))
    meta = {k: getattr(args, k) for k in ("seeds", "steps", "finetune", "sparsities", "vocab")}
    meta |= {"git": sha, "batch": args.batch, "seq": args.seq, "lr": args.lr}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "per_seed": per_seed}, indent=1) + "\n")
    if args.plot:
        plot(stats, meta, args.plot)


if __name__ == "__main__":
    main()
