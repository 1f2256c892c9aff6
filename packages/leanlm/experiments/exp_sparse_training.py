#!/usr/bin/env python
"""Experiment: sparse training schedules and one-shot 2:4 methods on a tiny Llama (CPU).

Command (from the repository root; the full run of experiments/RESULTS.md):
    nice -n 19 python packages/leanlm/experiments/exp_sparse_training.py --seeds 0 1 2 \
        --json packages/leanlm/experiments/sparse_training.json \
        --plot packages/leanlm/experiments/sparse_training.png
    python .../exp_sparse_training.py --quick            # a ~2 min smoke run, one seed
    python .../exp_sparse_training.py --plot-only all.json --plot X.png  # table + plot again

Data: the leanlm corpus (`leanlm.data.load_corpus`: CPython standard library + pydoc topics,
first `--max-bytes`, split by file) and leanlm's byte-level BPE (`load_or_train_tokenizer`,
vocab `--vocab`), both cached in leanlm's cache dir. Model: Llama, hidden 64, 2 layers, 4 heads
(2 KV), MLP 176, tied embeddings. Validation: `--eval-windows` fixed windows of `--seq` tokens
spread over the validation split, the same for every arm and seed: the *test* windows.

Learning rate, per arm: every arm (dense, each from-start and gradual sparsity) is trained at
every `--lrs` on `--sweep-seed` (not one of the reported seeds) and scored on *selection*
windows (the blocks halfway between consecutive test windows: disjoint from them); the lowest
is that arm's lr for every reported seed. The one-shot part of the sweep seed starts from its
dense model at the dense arm's chosen lr, and picks each method's fine-tuning lr from
`--finetune-lrs` the same way (on the perplexity after fine-tuning).

Per seed (model init and batch order): part 1 trains from scratch for `--steps` AdamW steps
(warm-up then cosine decay) with equal budgets: dense; sparse from the start (unstructured
magnitude mask at init on all 14 decoder Linears, attention and MLP) at each `--sparsities`;
gradual cubic pruning to the same sparsities (0 at step 0, s_f at 75% of the steps, re-mask
every steps/20). Part 2 prunes that seed's trained dense model one-shot to 2:4 with magnitude,
Wanda and SparseGPT (calibration: 8 training batches), then fine-tunes each for `--finetune`
steps with the mask held; the dense model gets the same extra steps as the baseline.
Reported: test-window perplexity, per seed and as mean ± sample std over seeds, each arm at its
chosen lr; and the sweep's selection perplexities.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanlm_testing import bench
from sparse_kernels import GradualPruning, SparseFromStart, SparsityConfig, sparsify_

ONESHOT: tuple[Literal["dense", "magnitude", "wanda", "sparsegpt"], ...] = (
    "dense", "magnitude", "wanda", "sparsegpt",
)  # fmt: skip


def load_data(args: argparse.Namespace) -> dict[str, Any]:
    """Train stream, test and selection windows, token ids of the config, corpus description."""
    from leanlm.config import DataConfig, TokenizerConfig
    from leanlm.data import load_corpus, selection_windows, spread_windows, tokenize_corpus
    from leanlm.data.resources import default_cache_dir
    from leanlm.data.tokenizer import load_or_train_tokenizer

    cache = default_cache_dir()
    corpus = load_corpus(
        DataConfig(max_bytes=args.max_bytes, seq_len=args.seq), cache_dir=cache / "datasets"
    )
    tokenizer, key = load_or_train_tokenizer(
        corpus, TokenizerConfig(vocab_size=args.vocab), cache_dir=cache
    )
    streams = tokenize_corpus(corpus, tokenizer, tokenizer_key=key)
    return {
        "train": streams.train,
        "test": spread_windows(streams.validation, args.seq, args.eval_windows),
        "selection": selection_windows(streams.validation, args.seq, args.eval_windows),
        "tok": {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        "description": corpus.description,
    }


def batch(data: torch.Tensor, gen: torch.Generator, size: int, seq: int) -> dict[str, Any]:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=gen)
    return {"input_ids": torch.stack([data[s : s + seq] for s in starts.tolist()])}


def model_fn(seed: int, tok: dict[str, int]) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        use_cache=False, **tok,
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


DATA: dict[str, Any] = {}
"""What `load_data` returned, in each worker process (set by `init_worker`)."""


def init_worker(data: dict[str, Any], threads: int) -> None:
    DATA.update(data)
    torch.set_num_threads(threads)


def train_arm(job: dict[str, Any]) -> dict[str, Any]:
    """Train arm `job["arm"]` ("dense", "from_start/s", "gradual/s") for one seed and lr."""
    args, seed, arm = job["args"], job["seed"], job["arm"]
    start, cpu = time.perf_counter(), time.process_time()
    model = model_fn(seed, DATA["tok"])
    schedule: Any = None
    if arm.startswith("from_start/"):
        schedule = SparseFromStart(model, SparsityConfig(sparsity=float(arm.split("/")[1])))
    elif arm.startswith("gradual/"):
        schedule = GradualPruning(
            model, final_sparsity=float(arm.split("/")[1]), end_step=int(0.75 * args.steps),
            frequency=max(1, args.steps // 20),
        )  # fmt: skip
    train(model, DATA["train"], args.steps, args, lr=job["lr"], seed=seed, schedule=schedule)
    out = {**{k: job[k] for k in ("seed", "arm", "lr", "split")}}
    out["ppl"] = perplexity(model, DATA[job["split"]], args.batch * 2)
    out["cpu"] = time.process_time() - cpu
    if arm == "dense":
        out["state"] = model.state_dict()
    print(
        f"| {job['split']} | {seed} | {arm} | {job['lr']:.1e} | {out['ppl']:.3f} | "
        f"{time.perf_counter() - start:.0f} | {out['cpu']:.0f} |",
        flush=True,
    )
    return out


def oneshot(job: dict[str, Any]) -> dict[str, Any]:
    """Prune the trained dense model (`job["state"]`) to 2:4 with `job["method"]`, fine-tune."""
    args, seed, method = job["args"], job["seed"], job["method"]
    start, cpu = time.perf_counter(), time.process_time()
    model = model_fn(seed, DATA["tok"])
    model.load_state_dict(job["state"])
    calib_gen = torch.Generator().manual_seed(1000 + seed)
    calibration = [batch(DATA["train"], calib_gen, args.batch, args.seq) for _ in range(8)]
    if method != "dense":
        sparsify_(model, SparsityConfig(pattern="2:4", method=method), calibration=calibration)
    windows = DATA[job["split"]]
    before = perplexity(model, windows, args.batch * 2)
    train(model, DATA["train"], args.finetune, args, lr=job["lr"], seed=seed + 500)
    after = perplexity(model, windows, args.batch * 2)
    out = {**{k: job[k] for k in ("seed", "method", "lr", "split")}}
    out |= {"before": before, "after": after, "cpu": time.process_time() - cpu}
    print(
        f"| {job['split']} | {seed} | 2:4 {method} (before / after {args.finetune} steps) | "
        f"{job['lr']:.1e} | {before:.3f} / {after:.3f} | {time.perf_counter() - start:.0f} | "
        f"{out['cpu']:.0f} |",
        flush=True,
    )
    return out


def arm_names(sparsities: list[float]) -> list[str]:
    return ["dense", *(f"{k}/{s}" for k in ("from_start", "gradual") for s in sparsities)]


def run_all(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The lr sweep on `args.sweep_seed`, then every reported seed at each arm's chosen lr."""
    arms = arm_names(args.sparsities)
    ctx = get_context("spawn")
    with ProcessPoolExecutor(args.workers, ctx, init_worker, (data, args.threads)) as pool:
        # 1. Sweep: every arm at every lr (dense first: the one-shot sweep needs its best).
        sweep_f = {
            (arm, lr): pool.submit(
                train_arm, {"args": args, "seed": args.sweep_seed, "arm": arm, "lr": lr}
                | {"split": "selection"},
            )
            for arm in arms
            for lr in args.lrs
        }  # fmt: skip
        dense = min((sweep_f["dense", lr].result() for lr in args.lrs), key=lambda r: r["ppl"])
        shot_f = {
            (m, lr): pool.submit(
                oneshot, {"args": args, "seed": args.sweep_seed, "method": m, "lr": lr}
                | {"split": "selection", "state": dense["state"]},
            )
            for m in ONESHOT
            for lr in args.finetune_lrs
        }  # fmt: skip
        sweep = {f"{arm}@{lr}": f.result()["ppl"] for (arm, lr), f in sweep_f.items()}
        chosen = {arm: min(args.lrs, key=lambda lr, a=arm: sweep[f"{a}@{lr}"]) for arm in arms}
        # 2. Reported seeds at the chosen lrs, dense first (its model feeds the one-shot part).
        final_f: dict[tuple[int, str], Future[dict[str, Any]]] = {}
        for arm in arms:
            for seed in args.seeds:
                job = {"args": args, "seed": seed, "arm": arm, "lr": chosen[arm], "split": "test"}
                final_f[seed, arm] = pool.submit(train_arm, job)
        shots = {k: f.result() for k, f in shot_f.items()}
        for m in ONESHOT:
            for lr in args.finetune_lrs:
                sweep[f"oneshot/{m}@{lr}"] = shots[m, lr]["after"]
            chosen[f"oneshot/{m}"] = min(
                args.finetune_lrs, key=lambda lr, m=m: shots[m, lr]["after"]
            )
        final_shot: dict[tuple[int, str], Future[dict[str, Any]]] = {}
        for seed in args.seeds:
            state = final_f[seed, "dense"].result()["state"]
            for m in ONESHOT:
                job = {"args": args, "seed": seed, "method": m, "lr": chosen[f"oneshot/{m}"]}
                final_shot[seed, m] = pool.submit(oneshot, job | {"split": "test", "state": state})
        per_seed: dict[str, dict[str, float]] = {str(seed): {} for seed in args.seeds}
        for (seed, arm), f in final_f.items():
            per_seed[str(seed)][arm] = f.result()["ppl"]
        for (seed, m), f in final_shot.items():
            r = f.result()
            per_seed[str(seed)] |= {
                f"oneshot/{m}/before": r["before"],
                f"oneshot/{m}/after": r["after"],
            }
        cpu = sum(f.result()["cpu"] for d in (sweep_f, shot_f) for f in d.values())
        cpu_final = sum(f.result()["cpu"] for d in (final_f, final_shot) for f in d.values())
    return {"per_seed": per_seed, "sweep": sweep, "chosen": chosen, "cpu": [cpu, cpu_final]}


def print_sweep(meta: dict[str, Any]) -> None:
    sweep, chosen = meta["sweep"], meta["chosen"]
    print(f"\n## lr sweep on seed {meta['sweep_seed']}: selection-window perplexity\n")
    lrs, ft = meta["lrs"], meta["finetune_lrs"]
    print("| arm | " + " | ".join(f"lr {lr:.1e}" for lr in lrs) + " | chosen |")
    print("|---|" + "---:|" * len(lrs) + "---|")
    for arm in arm_names(meta["sparsities"]):
        edge = " (edge of the grid)" if len(lrs) > 1 and chosen[arm] in (lrs[0], lrs[-1]) else ""
        cells = [f"{sweep[f'{arm}@{lr}']:.2f}" for lr in lrs]
        print(f"| {arm} | " + " | ".join(cells) + f" | {chosen[arm]:.1e}{edge} |")
    print(f"\n| one-shot 2:4, after {meta['finetune']} steps at | "
          + " | ".join(f"lr {lr:.1e}" for lr in ft) + " | chosen |")  # fmt: skip
    print("|---|" + "---:|" * len(ft) + "---|")
    for m in ONESHOT:
        lr_m = chosen[f"oneshot/{m}"]
        edge = " (edge of the grid)" if len(ft) > 1 and lr_m in (ft[0], ft[-1]) else ""
        cells = [f"{sweep[f'oneshot/{m}@{lr}']:.2f}" for lr in ft]
        print(f"| {m} | " + " | ".join(cells) + f" | {lr_m:.1e}{edge} |")


def summarize(per_seed: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """{arm: (mean, sample std)} over seeds (std 0 for one seed)."""
    arms = next(iter(per_seed.values())).keys()
    stats = {}
    for arm in arms:
        vals = [r[arm] for r in per_seed.values()]
        stats[arm] = (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return stats


def paired(per_seed: dict[str, dict[str, float]], arm: str, base: str) -> str:
    """Mean ± sample std over seeds of (arm - base), each difference taken within a seed."""
    diffs = [r[arm] - r[base] for r in per_seed.values()]
    std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return f"{statistics.fmean(diffs):+.2f} ± {std:.2f}"


def print_summary(per_seed: dict[str, dict[str, float]], meta: dict[str, Any]) -> None:
    stats, chosen = summarize(per_seed), meta["chosen"]

    def f(arm: str) -> str:
        return f"{stats[arm][0]:.2f} ± {stats[arm][1]:.2f}"

    print(
        f"\n## mean ± std over {len(per_seed)} seed(s), test windows, each arm at its chosen lr: "
        "validation perplexity (paired: the difference within each seed, then mean ± std)\n"
    )
    print(
        "| sparsity | sparse from start (lr) | gradual cubic (lr) | from start - dense (paired) "
        "| gradual - dense (paired) |"
    )
    print("|---|---|---|---|---|")
    print(f"| 0 (dense) | {f('dense')} ({chosen['dense']:.1e}) | | | |")
    for s in meta["sparsities"]:
        a, g = f"from_start/{s}", f"gradual/{s}"
        print(
            f"| {s:.1%} | {f(a)} ({chosen[a]:.1e}) | {f(g)} ({chosen[g]:.1e}) | "
            f"{paired(per_seed, a, 'dense')} | {paired(per_seed, g, 'dense')} |"
        )
    print(
        "\n| one-shot 2:4 on the trained dense model | fine-tune lr | before fine-tune "
        "| after fine-tune | after - dense after (paired) |"
    )
    print("|---|---|---|---|---|")
    for m in ONESHOT:
        label = "dense (no pruning; same extra steps)" if m == "dense" else m
        after = f"oneshot/{m}/after"
        print(
            f"| {label} | {chosen[f'oneshot/{m}']:.1e} | {f(f'oneshot/{m}/before')} | {f(after)} "
            f"| {paired(per_seed, after, 'oneshot/dense/after')} |"
        )


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
    left.set_title(f"training, {meta['steps']} steps each, best lr per arm")
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
        f"{len(meta['seeds'])} seeds\neach arm at its best lr of {meta['lrs']} (2:4 fine-tune: "
        f"of {meta['finetune_lrs']}), chosen on seed {meta['sweep_seed']}'s selection windows",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"# plot: {path} ({path.stat().st_size / 1024:.0f} KB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sweep-seed", type=int, default=3, help="seed of the lr sweep")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--finetune", type=int, default=100)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.75, 0.875])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3], help="swept per arm"
    )
    parser.add_argument(
        "--finetune-lrs", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3], help="per method"
    )
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--quick", action="store_true", help="1 seed, 40 + 10 steps, 2 lrs")
    parser.add_argument("--json", type=Path, help="write per-seed results and the sweep here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument(
        "--plot-only", type=Path, help="summarize (and redraw --plot) from a --json file"
    )
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads(args.plot_only.read_text())
        print_sweep(saved["meta"])
        print_summary(saved["per_seed"], saved["meta"])
        if args.plot:
            plot(summarize(saved["per_seed"]), saved["meta"], args.plot)
        return
    if args.quick:
        args.seeds, args.steps, args.finetune, args.eval_windows = [0], 40, 10, 16
        args.lrs, args.finetune_lrs = [1.5e-3, 6e-3], [5e-4, 2e-3]
    if args.sweep_seed in args.seeds:
        parser.error(f"--sweep-seed ({args.sweep_seed}) must not be one of --seeds {args.seeds}")
    args.lrs, args.finetune_lrs = sorted(args.lrs), sorted(args.finetune_lrs)
    torch.set_num_threads(args.threads)
    where = Path(__file__).parents[1]
    sha = bench.git_revision(where)
    dists = ["leanlm", "sparse-kernels", "transformers"]
    print(bench.header("exp_sparse_training", "cpu", dists, where=where))
    data = load_data(args)
    print(f"# corpus: {data['description']}; BPE vocab {data['tok']['vocab_size']}")
    print(
        f"# {data['train'].numel()} train tokens; validation: {data['test'].shape[0]} test "
        f"windows x {data['test'].shape[1]} tokens; lr selection: the "
        f"{data['selection'].shape[0]} blocks halfway between them"
    )
    print(
        f"# seeds {args.seeds} (lr sweep on seed {args.sweep_seed}), steps {args.steps}, batch "
        f"{args.batch}x{args.seq} tokens, lrs {args.lrs} (warm-up 5%, cosine to 10%), AdamW wd "
        f"0.1; 2:4 fine-tune {args.finetune} steps at lrs {args.finetune_lrs}; {args.workers} "
        f"worker(s) x {args.threads} thread(s)\n"
    )
    print("| split | seed | run | lr | ppl | time s | CPU s |\n|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    out = run_all(data, args)
    print(
        f"# total wall {time.perf_counter() - start:.0f} s; CPU time: lr sweep {out['cpu'][0]:.0f}"
        f" s + reported runs {out['cpu'][1]:.0f} s (workers only)"
    )
    meta = {k: getattr(args, k) for k in ("seeds", "steps", "finetune", "sparsities", "vocab")}
    meta |= {"git": sha, "batch": args.batch, "seq": args.seq, "lrs": args.lrs}
    meta |= {"finetune_lrs": args.finetune_lrs, "sweep_seed": args.sweep_seed}
    meta |= {"chosen": out["chosen"], "sweep": out["sweep"]}
    print_sweep(meta)
    print_summary(out["per_seed"], meta)
    if args.json:
        payload = {"meta": meta, "per_seed": out["per_seed"]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        plot(summarize(out["per_seed"]), meta, args.plot)


if __name__ == "__main__":
    main()
