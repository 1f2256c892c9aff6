#!/usr/bin/env python
"""Experiment: Minitron's claim at toy scale: pruned + distilled vs pruned + plain vs scratch.

Command (from the repository root; `--quick` is a ~2-minute smoke run that checks the plumbing
only: its 60-step teacher is too weak for the comparison to mean anything):
    nice -n 19 python packages/leanlm/experiments/exp_minitron.py [--quick] [--json F] \
        [--lrs 1e-3 2e-3 4e-3] [--seeds 1 2 3] [--sweep-seed 0]
    python packages/leanlm/experiments/exp_minitron.py --from-json F  # table + plot again

Data: leanlm's embedded corpus (the CPython standard library's `.py` files, split by file into
train / validation), its byte-level BPE tokenizer trained on the train split, and validation
perplexity on evenly spread, non-overlapping validation windows (`leanlm.data.spread_windows`,
`leanlm.train.evaluate.evaluate_perplexity`): the *test* windows. The learning rate is chosen on
*selection* windows: the blocks halfway between consecutive test windows of the same validation
stream (disjoint from every test window).

1. Teacher: a small Llama (GQA) trained with AdamW and a cosine schedule; cached on disk under
   `--cache-dir` (keyed by its settings and the corpus), so reruns skip it.
2. Importance (`collect_importance`) on calibration windows from the train split, then `prune` to
   two students of about half the teacher: **width** (hidden, MLP and query heads) and **depth**
   (half the layers, lowest Block Importance dropped).
3. Per student and seed, three arms with the same optimizer (AdamW), lr schedule (linear warm-up,
   then constant), batch, token budget and data order (the seed picks the order): (a) distill:
   forward KL(teacher || student) on the logits at T = 1, no CE term (Minitron's default);
   (b) plain next-token training of the pruned model; (c) a random init of the same config,
   plain training (the seed also picks this init). Perplexity is measured at 0, 1/4, 1/2 and 1 of
   the budget along each run (the constant lr after warm-up makes the checkpoints comparable to
   separate shorter runs, minus their decay).
4. Learning rate, per (student, arm): every lr of `--lrs` is run on `--sweep-seed` (not one of the
   reported seeds) and scored on the selection windows at the full budget; the best one is then
   run on every reported seed and scored on the test windows. The sweep's scores at every budget
   are printed too, so a budget whose best lr differs shows up.

Prints a markdown table (mean ± std over seeds), writes a PNG plot and a JSON of every number.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from leanlm.config import DataConfig, TokenizerConfig
from leanlm.data import (
    blocks,
    global_batch_indices,
    load_corpus,
    selection_windows,
    spread_windows,
    tokenize_corpus,
)
from leanlm.data.tokenizer import load_or_train_tokenizer
from leanlm.train.evaluate import evaluate_perplexity
from leanlm_testing import bench
from prune_distill import PruneTarget, collect_importance, forward_kl, prune

ARMS = ("distill", "plain", "scratch")
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Every knob of one experiment (the teacher's cache key hashes the teacher part)."""

    max_bytes: int = 0
    """Corpus bytes (0 = the whole standard library, ~11 MB)."""
    vocab_size: int = 2048
    seq_len: int = 128
    batch: int = 16
    """Sequences per optimizer step (teacher and students)."""
    hidden: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 384
    teacher_steps: int = 800
    teacher_lr: float = 3e-3
    teacher_warmup: int = 40
    # Students.
    width_hidden: int = 96
    width_ffn: int = 224
    width_heads: int = 2
    depth_layers: int = 3
    calibration_samples: int = 256
    student_steps: int = 128
    """The largest token budget, in optimizer steps; checkpoints at 1/4, 1/2 and 1 of it."""
    student_lrs: tuple[float, ...] = (1e-3, 2e-3, 4e-3)
    """Peak lrs swept per (student, arm) on `sweep_seed` (2e-3 was the single lr before)."""
    student_warmup: int = 10
    sweep_seed: int = 0
    seeds: tuple[int, ...] = (1, 2, 3)
    eval_windows: int = 256

    def teacher_key(self, corpus: str) -> str:
        """Cache key of the teacher: its settings (not the students') and the corpus/tokenizer."""
        fields = {
            k: v
            for k, v in asdict(self).items()
            if not k.startswith(("width", "depth", "student", "seeds", "sweep", "calib", "eval"))
        }
        blob = json.dumps({"setup": fields, "corpus": corpus}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


QUICK = Setup(
    max_bytes=1_500_000,
    vocab_size=1024,
    seq_len=64,
    batch=8,
    hidden=64,
    layers=4,
    heads=4,
    kv_heads=2,
    ffn=176,
    teacher_steps=60,
    teacher_warmup=6,
    width_hidden=48,
    width_ffn=96,
    width_heads=2,
    depth_layers=2,
    calibration_samples=32,
    student_steps=12,
    student_warmup=2,
    student_lrs=(1e-3, 4e-3),
    seeds=(1, 2),
    eval_windows=32,
)


def lr_factor(step: int, *, warmup: int, total: int | None) -> float:
    """Linear warm-up, then constant (`total` None) or cosine to 10% at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None:
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train(
    model: Any,
    train_blocks: torch.Tensor,
    *,
    setup: Setup,
    steps: int,
    seed: int,
    lr: float,
    warmup: int,
    cosine: bool,
    teacher: Any = None,
    checkpoints: tuple[int, ...] = (),
    on_checkpoint: Any = None,
    log_every: int = 0,
) -> None:
    """AdamW steps on batches `global_batch_indices(step, seed)`; KL to `teacher` if given."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=warmup, total=steps if cosine else None)
    )
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        index = global_batch_indices(
            step, global_batch=setup.batch, num_blocks=train_blocks.shape[0], seed=seed
        )
        ids = train_blocks[index]
        logits = model(input_ids=ids, use_cache=False).logits
        if teacher is None:
            flat = logits[:, :-1].reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat, ids[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                target = teacher(input_ids=ids, use_cache=False).logits
            loss = forward_kl(logits, target, temperature=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step + 1 in checkpoints and on_checkpoint is not None:
            on_checkpoint(step + 1)
        if log_every and (step + 1) % log_every == 0:
            elapsed = time.perf_counter() - start
            print(
                f"#   step {step + 1}/{steps}: loss {float(loss):.3f} ({elapsed:.0f} s)", flush=True
            )


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def ppl(model: Any, windows: torch.Tensor) -> float:
    return evaluate_perplexity(model, windows, batch_size=32).perplexity


def prepare_data(
    setup: Setup, cache: Path
) -> tuple[Any, str, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    data = DataConfig(max_bytes=setup.max_bytes, seq_len=setup.seq_len)
    corpus = load_corpus(data, cache_dir=cache / "datasets")
    tokenizer, key = load_or_train_tokenizer(
        corpus, TokenizerConfig(vocab_size=setup.vocab_size), cache_dir=cache
    )
    streams = tokenize_corpus(corpus, tokenizer, tokenizer_key=key)
    train_blocks = blocks(streams.train, setup.seq_len)
    val = spread_windows(streams.validation, setup.seq_len, setup.eval_windows)
    sel = selection_windows(streams.validation, setup.seq_len, setup.eval_windows)
    return tokenizer, corpus.fingerprint + key, train_blocks, val, sel, corpus.description


def teacher_model(setup: Setup, tokenizer: Any) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=setup.hidden,
        intermediate_size=setup.ffn,
        num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads,
        num_key_value_heads=setup.kv_heads,
        max_position_embeddings=max(256, setup.seq_len),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def get_teacher(setup: Setup, tokenizer: Any, key: str, train_blocks: torch.Tensor, cache: Path):  # type: ignore[no-untyped-def]
    path = cache / f"teacher-{key}"
    if (path / "config.json").is_file():
        print(f"# teacher: loaded from {path}")
        return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32), 0.0
    start, cpu = time.perf_counter(), time.process_time()
    teacher = teacher_model(setup, tokenizer)
    train(
        teacher,
        train_blocks,
        setup=setup,
        steps=setup.teacher_steps,
        seed=0,
        lr=setup.teacher_lr,
        warmup=setup.teacher_warmup,
        cosine=True,
        log_every=100,
    )
    seconds = time.perf_counter() - start
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    teacher.save_pretrained(tmp)
    os.replace(tmp, path)
    cpu = time.process_time() - cpu
    print(f"# teacher: trained in {seconds:.0f} s ({cpu:.0f} CPU s), cached at {path}")
    return teacher, seconds


def make_students(setup: Setup, teacher: Any, train_blocks: torch.Tensor) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(12345)
    rows = torch.randperm(train_blocks.shape[0], generator=gen)[: setup.calibration_samples]
    calib = [{"input_ids": train_blocks[rows[i : i + 32]]} for i in range(0, rows.numel(), 32)]
    scores = collect_importance(teacher, calib, num_samples=None, layer_loss=True)
    bi = scores.block_importance.tolist()
    lm = scores.lm_loss_increase.tolist() if scores.lm_loss_increase is not None else []
    print(f"# layer Block Importance: {', '.join(f'{v:.3f}' for v in bi)}")
    print(f"# layer LM-loss increase when skipped: {', '.join(f'{v:.3f}' for v in lm)}")
    width = PruneTarget(
        hidden_size=setup.width_hidden,
        intermediate_size=setup.width_ffn,
        num_attention_heads=setup.width_heads,
    )
    depth = PruneTarget(num_hidden_layers=setup.depth_layers)
    return {"width": prune(teacher, scores, width), "depth": prune(teacher, scores, depth)}


def quiet() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One (student, seed, arm, lr) run. Runs in a worker process.

    Scored on the selection windows for the lr sweep (`job["split"]` "selection"), on the test
    windows otherwise.
    """
    quiet()
    torch.set_num_threads(job["threads"])
    setup = Setup(**{**job["setup"], "seeds": tuple(job["setup"]["seeds"])})
    run_dir = Path(job["run_dir"])
    train_blocks = torch.load(run_dir / "train_blocks.pt")
    windows = torch.load(run_dir / ("sel.pt" if job["split"] == "selection" else "val.pt"))
    arm = job["arm"]
    teacher = None
    if arm == "distill":
        teacher = LlamaForCausalLM.from_pretrained(job["teacher"], dtype=torch.float32).eval()
    checkpoints = tuple(setup.student_steps * k // 4 for k in (1, 2, 4))
    start, cpu = time.perf_counter(), time.process_time()
    model = LlamaForCausalLM.from_pretrained(run_dir / job["student"], dtype=torch.float32)
    if arm == "scratch":
        torch.manual_seed(job["seed"])
        model = LlamaForCausalLM(model.config)
    curve = [ppl(model, windows)]
    train(
        model,
        train_blocks,
        setup=setup,
        steps=setup.student_steps,
        seed=job["seed"],
        lr=job["lr"],
        warmup=setup.student_warmup,
        cosine=False,
        teacher=teacher,
        checkpoints=checkpoints,
        on_checkpoint=lambda _step, m=model, c=curve: c.append(ppl(m, windows)),
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(
        f"#   {job['split']:9s} {job['student']:5s} seed {job['seed']} {arm:7s} "
        f"lr {job['lr']:.0e}: "
        + " -> ".join(f"{p:.2f}" for p in curve)
        + f"  ({seconds:.0f} s, {cpu:.0f} CPU s)",
        flush=True,
    )
    keys = ("student", "seed", "arm", "lr", "split")
    return {**{k: job[k] for k in keys}, "ppl": curve, "cpu": cpu}


def choose_lrs(sweep: list[dict[str, Any]]) -> dict[str, float]:
    """{"student/arm": lr} with the lowest selection perplexity at the full budget."""
    chosen: dict[str, float] = {}
    for r in sorted(sweep, key=lambda r: r["ppl"][-1]):
        chosen.setdefault(f"{r['student']}/{r['arm']}", r["lr"])
    return chosen


def sweep_report(setup: Setup, sweep: list[dict[str, Any]], chosen: dict[str, float]) -> list[str]:
    """Selection perplexity of every swept lr at every budget; * = best at that budget."""
    budgets = [
        s * setup.batch * setup.seq_len for s in (setup.student_steps * k // 4 for k in (1, 2, 4))
    ]
    lines = [
        f"lr sweep on seed {setup.sweep_seed}, selection windows (* = best lr of the arm at that "
        "budget; the chosen lr is the best at the full budget):",
        "",
        "| student | arm | lr | " + " | ".join(f"{t / 1e3:.0f}k" for t in budgets) + " | chosen |",
        "|---|---|---:|" + "---:|" * len(budgets) + "---|",
    ]
    for student in ("width", "depth"):
        for arm in ARMS:
            rows = sorted(
                (r for r in sweep if r["student"] == student and r["arm"] == arm),
                key=lambda r: r["lr"],
            )
            best = [min(r["ppl"][i] for r in rows) for i in range(1, len(budgets) + 1)]
            for r in rows:
                cells = [
                    f"{v:.1f}" + ("*" if v == b else "")
                    for v, b in zip(r["ppl"][1:], best, strict=True)
                ]
                mark = "yes" if chosen[f"{student}/{arm}"] == r["lr"] else ""
                edge = r["lr"] in (rows[0]["lr"], rows[-1]["lr"]) and len(rows) > 1
                if mark and edge:
                    mark += " (edge of the grid)"
                lines.append(
                    f"| {student} | {arm} | {r['lr']:.0e} | " + " | ".join(cells) + f" | {mark} |"
                )
    return lines


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report(
    setup: Setup, results: list[dict[str, Any]], teacher_ppl: float, chosen: dict[str, float]
) -> list[str]:
    tokens = [
        s * setup.batch * setup.seq_len
        for s in (0, *(setup.student_steps * k // 4 for k in (1, 2, 4)))
    ]
    head = "| student | arm | lr | " + " | ".join(f"{t / 1e3:.0f}k tokens" for t in tokens) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(tokens)]
    for student in ("width", "depth"):
        for arm in ARMS:
            curves = [r["ppl"] for r in results if r["student"] == student and r["arm"] == arm]
            cells = []
            for i in range(len(tokens)):
                m, s = mean_std([c[i] for c in curves])
                cells.append(f"{m:.1f} ± {s:.1f}" if m < 1000 else f"{m:.0f} ± {s:.0f}")
            lr = chosen[f"{student}/{arm}"]
            lines.append(f"| {student} | {arm} | {lr:.0e} | " + " | ".join(cells) + " |")
    lines.append(f"| teacher | (reference) | | {teacher_ppl:.2f} |" + " |" * (len(tokens) - 1))
    lines += ["", "Paired difference per seed at each budget (negative = distill better):", ""]
    lines.append(
        "| student | comparison | " + " | ".join(f"{t / 1e3:.0f}k" for t in tokens[1:]) + " |"
    )
    lines.append("|---|---|" + "---:|" * (len(tokens) - 1))
    for student in ("width", "depth"):
        for other in ("plain", "scratch"):
            cells = []
            for i in range(1, len(tokens)):
                diffs = []
                for seed in setup.seeds:
                    pick = {
                        r["arm"]: r["ppl"][i]
                        for r in results
                        if r["student"] == student and r["seed"] == seed
                    }
                    diffs.append(pick["distill"] - pick[other])
                m, s = mean_std(diffs)
                cells.append(f"{m:+.2f} ± {s:.2f}")
            lines.append(f"| {student} | distill - {other} | " + " | ".join(cells) + " |")
    return lines


def plot(
    setup: Setup,
    results: list[dict[str, Any]],
    teacher_ppl: float,
    chosen: dict[str, float],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = (0, *(setup.student_steps * k // 4 for k in (1, 2, 4)))
    tokens = [s * setup.batch * setup.seq_len / 1e3 for s in steps]
    # Top row: all arms, log scale. Bottom row: the two pruned arms, linear scale (zoom).
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.4), sharex=True, sharey="row")
    styles = {"distill": ("C0", "o"), "plain": ("C1", "s"), "scratch": ("C2", "^")}
    for col, student in enumerate(("width", "depth")):
        for row, arms in enumerate((ARMS, ARMS[:2])):
            ax = axes[row, col]
            for arm in arms:
                curves = [r["ppl"] for r in results if r["student"] == student and r["arm"] == arm]
                stats = [mean_std([c[i] for c in curves]) for i in range(len(tokens))]
                color, marker = styles[arm]
                name = f"pruned + {arm}" if arm != "scratch" else "random init + plain"
                ax.errorbar(
                    tokens[row:],
                    [m for m, _ in stats][row:],
                    yerr=[s for _, s in stats][row:],
                    color=color,
                    marker=marker,
                    ms=4,
                    capsize=3,
                    label=f"{name}, lr {chosen[f'{student}/{arm}']:.0e}",
                )
            ax.axhline(teacher_ppl, color="k", ls="--", lw=1, label="teacher (unpruned)")
            ax.grid(alpha=0.3, which="both")
        axes[0, col].set_yscale("log")
        axes[0, col].set_title(f"{student}-pruned student")
        axes[1, col].set_xlabel("training tokens (thousands)")
    axes[0, 0].set_ylabel(f"val. perplexity, log ({setup.eval_windows} x {setup.seq_len} tok.)")
    axes[1, 0].set_ylabel("pruned arms only (zoom)")
    axes[0, 0].legend(fontsize=7)
    axes[0, 1].legend(fontsize=7)
    fig.suptitle(
        f"Minitron at toy scale: mean ± std over {len(setup.seeds)} seeds, each arm at its best "
        f"lr of {', '.join(f'{lr:.0e}' for lr in setup.student_lrs)} (seed {setup.sweep_seed})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~2-minute smoke run")
    parser.add_argument("--lrs", type=float, nargs="+", default=None, help="student lrs swept")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="reported seeds")
    parser.add_argument("--sweep-seed", type=int, default=None, help="seed of the lr sweep")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/prune-distill-minitron"))
    parser.add_argument("--workers", type=int, default=2, help="processes for the student runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--plot", type=Path, default=None, help="PNG path (default experiments/minitron.png)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument(
        "--from-json", type=Path, default=None, help="re-print the table and re-plot a --json file"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        setup = Setup(
            **{
                **saved["setup"],
                "seeds": tuple(saved["setup"]["seeds"]),
                "student_lrs": tuple(saved["setup"]["student_lrs"]),
            }
        )
        print("\n".join(sweep_report(setup, saved["sweep"], saved["chosen"])) + "\n")
        print("\n".join(report(setup, saved["results"], saved["teacher_ppl"], saved["chosen"])))
        plot(
            setup,
            saved["results"],
            saved["teacher_ppl"],
            saved["chosen"],
            args.plot or HERE / "minitron.png",
        )
        return
    setup = QUICK if args.quick else Setup()
    if args.lrs is not None:
        setup = replace(setup, student_lrs=tuple(args.lrs))
    if args.seeds is not None:
        setup = replace(setup, seeds=tuple(args.seeds))
    if args.sweep_seed is not None:
        setup = replace(setup, sweep_seed=args.sweep_seed)
    if setup.sweep_seed in setup.seeds:
        parser.error(f"--sweep-seed ({setup.sweep_seed}) must not be one of --seeds {setup.seeds}")
    if args.plot is None:
        args.plot = args.cache_dir / "minitron-quick.png" if args.quick else HERE / "minitron.png"
    torch.set_num_threads(args.threads)
    quiet()
    wall = time.perf_counter()
    dists = ["leanlm", "prune-distill", "transformers", "datasets"]
    print(bench.header("exp_minitron", "cpu", dists, where=HERE.parent))
    print(f"# {args.workers} worker(s) x {args.threads} thread(s)")
    print(f"# setup: {json.dumps(asdict(setup))}")
    cache = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer, corpus_key, train_blocks, val, sel, description = prepare_data(setup, cache)
    print(
        f"# corpus: {description}; {train_blocks.numel()} train tokens; validation: "
        f"{val.shape[0]} test windows x {val.shape[1]} tokens, spread evenly; lr selection: "
        f"the {sel.shape[0]} blocks halfway between them"
    )
    teacher, teacher_s = get_teacher(
        setup, tokenizer, setup.teacher_key(corpus_key), train_blocks, cache
    )
    teacher_ppl = ppl(teacher, val)
    teacher_tokens = setup.teacher_steps * setup.batch * setup.seq_len
    print(f"# teacher: {n_params(teacher)} params, {teacher_tokens} tokens, ppl {teacher_ppl:.2f}")

    students = make_students(setup, teacher, train_blocks)
    run_dir = cache / f"run-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save(train_blocks, run_dir / "train_blocks.pt")
    torch.save(val, run_dir / "val.pt")
    torch.save(sel, run_dir / "sel.pt")
    for name, model in students.items():
        model.save_pretrained(run_dir / name)
        c = model.config
        print(
            f"# {name} student: {n_params(model)} params "
            f"({n_params(model) / n_params(teacher):.0%} of the teacher), hidden {c.hidden_size}, "
            f"MLP {c.intermediate_size}, heads {c.num_attention_heads}/{c.num_key_value_heads} KV, "
            f"{c.num_hidden_layers} layers"
        )
    teacher_dir = cache / f"teacher-{setup.teacher_key(corpus_key)}"
    if not teacher_dir.is_dir():
        teacher.save_pretrained(teacher_dir)
    base = {
        "setup": asdict(setup),
        "run_dir": str(run_dir),
        "teacher": str(teacher_dir),
        "threads": args.threads,
    }
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        sweep_jobs = [
            {**base, "student": student, "arm": arm, "lr": lr, "seed": setup.sweep_seed}
            | {"split": "selection"}
            for arm in ARMS
            for lr in setup.student_lrs
            for student in ("width", "depth")
        ]
        sweep = list(pool.map(run_job, sweep_jobs))
        chosen = choose_lrs(sweep)
        print("\n".join(["", *sweep_report(setup, sweep, chosen), ""]), flush=True)
        final_jobs = [
            {**base, "student": student, "arm": arm, "seed": seed, "split": "test"}
            | {"lr": chosen[f"{student}/{arm}"]}
            for seed in setup.seeds
            for arm in ARMS
            for student in ("width", "depth")
        ]
        results = list(pool.map(run_job, final_jobs))

    lines = report(setup, results, teacher_ppl, chosen)
    print()
    print("\n".join(lines))
    plot(setup, results, teacher_ppl, chosen, args.plot)
    total = time.perf_counter() - wall
    main_cpu = time.process_time()
    sweep_cpu = sum(r["cpu"] for r in sweep)
    worker_cpu = sum(r["cpu"] for r in results)
    print(
        f"\n# plot: {args.plot} ({args.plot.stat().st_size / 1e3:.0f} KB); teacher training "
        f"{teacher_s:.0f} s (0 = cached); total wall {total:.0f} s; CPU time: main process "
        f"{main_cpu:.0f} s + lr sweep {sweep_cpu:.0f} s + reported runs {worker_cpu:.0f} s "
        f"(idle-machine estimate with {args.workers} workers: "
        f"~{main_cpu + (sweep_cpu + worker_cpu) / args.workers:.0f} s); load avg "
        f"{os.getloadavg()[0]:.1f}"
    )
    if args.json is not None:
        payload = {
            "setup": asdict(setup),
            "teacher_ppl": teacher_ppl,
            "chosen": chosen,
            "sweep": sweep,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    for name in ("width", "depth"):
        for f in (run_dir / name).iterdir():
            f.unlink()
        (run_dir / name).rmdir()
    for f in run_dir.iterdir():
        f.unlink()
    run_dir.rmdir()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
