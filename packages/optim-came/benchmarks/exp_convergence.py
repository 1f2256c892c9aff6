#!/usr/bin/env python
"""Tiny-Llama convergence: CAME vs AdamW vs Adafactor, each at its own lr and at a shared lr.

Command (from the repository root; RESULTS.md's numbers were taken with it):

    nice -n 10 python packages/optim-came/benchmarks/exp_convergence.py \
        --cache /tmp/came_convergence.json --png packages/optim-came/benchmarks/convergence.png

`--quick` is a ~1 minute smoke run (40 steps, one seed, the shared lr only). `--optimizers`
picks a subset (comma-separated names); `--shared-only` skips the lr sweep (every optimizer at
the shared lr). RESULTS.md gives the exact command of each of its tables.

Setup: a byte-level Llama built from `LlamaConfig` (leanlm_testing's `tiny_llama`: 2 layers,
hidden 64, GQA 4/2 heads, tied 256-entry embeddings, 0.11M parameters) trained on the bytes of
the standard library's `pydoc_data/topics.py` (English prose of the Python reference), first 90%
for training, last 10% for validation. Every run uses the same warmup (10% of the steps, linear)
+ cosine-to-zero schedule, batch 16 x 64 bytes, no weight decay. Seed `s` sets both the model
initialisation and the order of the training windows.

Optimizers:

- AdamW: `torch.optim.AdamW(betas=(0.9, 0.999))`.
- AdamW8bit: `bitsandbytes.optim.AdamW8bit` with AdamW's betas/eps/weight decay (when bitsandbytes
  imports): blockwise 8-bit moments for tensors of >= 4096 elements, fp32 for the others
  (`min_8bit_size`); "AdamW8bit all": `min_8bit_size=0`.
- Adafactor: `optim_adafactor.Adafactor` with the HF Trainer settings (`relative_step=False,
  scale_parameter=False`, no momentum), i.e. `Trainer(optim="adafactor")`.
- CAME: `optim_came.CAME` with came-pytorch's defaults (betas 0.9/0.999/0.9999, `R, C` start
  at 0).
- CAME ii=1: the same with `instability_init=1.0`, the setting the leanlm pipeline uses.
- CAME ii=1 int8 (SR): the same with `state_dtype=torch.int8` (blockwise 8-bit `exp_avg`), codes
  rounded to nearest (stochastically).
- Adafactor b1: Adafactor's entry plus `beta1=0.9` (fp32 momentum); "Adafactor b1 int8 (SR)":
  the same with `state_dtype=torch.int8`, codes rounded to nearest (stochastically). Their lr
  grid reaches 3e-2: their seed-0 best of Adafactor's grid was its edge, 1e-2.

Protocol: every seed runs at the shared lr; a sweep over a small lr grid with seed 0 picks each
optimizer's own lr (lowest validation loss), and the other seeds then run at that lr too.
Reported: validation loss (256 fixed windows of the held-out split) mean ± std over seeds, the
mean training loss of the last 50 steps, optimizer-state bytes per parameter counted from the
state's tensors (`leanlm_testing.bench.state_bytes`), and the share of parameters whose state
holds a full-size 8-bit tensor. Runs are independent processes (`--workers`, one torch thread
each); `--cache` keeps finished runs so an interrupted experiment resumes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing
import pathlib
import statistics
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch

from leanlm_testing import bench

SHARED_LR = 3e-3
LRS = (1e-3, 3e-3, 1e-2)  # the usual seed-0 sweep grid (every grid includes SHARED_LR)
ADAM: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # both AdamWs
HF = {"relative_step": False, "scale_parameter": False}  # Trainer(optim="adafactor")
B1 = {**HF, "beta1": 0.9}  # the same with momentum
INT8 = {"state_dtype": torch.int8}  # blockwise 8-bit exp_avg, codes rounded to nearest
SR = {"stochastic_rounding": True}  # codes rounded stochastically (the parameters are fp32)
TAIL = 50  # steps averaged for the final training loss
SMOOTH = 25  # moving-average window of the plotted training loss
VAL_WINDOWS = 256


@dataclass(frozen=True)
class Entry:
    """One optimizer of the comparison."""

    cls: str  # "AdamW", "Adafactor", "CAME" or "AdamW8bit" (bitsandbytes)
    kwargs: dict[str, Any]  # besides lr
    grid: tuple[float, ...]  # lr grid of the seed-0 sweep
    color: str  # of the plot


OPTIMIZERS = {
    "AdamW": Entry("AdamW", ADAM, LRS, "C0"),
    "Adafactor": Entry("Adafactor", HF, LRS, "C1"),
    "Adafactor b1": Entry("Adafactor", B1, (*LRS, 3e-2), "C8"),
    "Adafactor b1 int8": Entry("Adafactor", B1 | INT8, (*LRS, 3e-2), "C9"),
    "Adafactor b1 int8 SR": Entry("Adafactor", B1 | INT8 | SR, (*LRS, 3e-2), "olive"),
    "CAME": Entry("CAME", {}, (1e-4, 3e-4, 1e-3, 3e-3), "C3"),
    "CAME ii=1": Entry("CAME", {"instability_init": 1.0}, LRS, "C2"),
    "CAME ii=1 int8": Entry("CAME", {"instability_init": 1.0} | INT8, LRS, "C4"),
    "CAME ii=1 int8 SR": Entry("CAME", {"instability_init": 1.0} | INT8 | SR, LRS, "C5"),
    "AdamW8bit": Entry("AdamW8bit", ADAM, LRS, "C6"),
    "AdamW8bit all": Entry("AdamW8bit", ADAM | {"min_8bit_size": 0}, LRS, "C7"),
}
BNB = [name for name, e in OPTIMIZERS.items() if e.cls == "AdamW8bit"]  # need bitsandbytes


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run."""

    optimizer: str
    lr: float
    seed: int
    steps: int
    batch: int = 16
    seq: int = 64

    @property
    def key(self) -> str:
        """Cache key (every field)."""
        return json.dumps(asdict(self), sort_keys=True)


def make_optimizer(
    name: str, params: Iterator[torch.nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The optimizer `name` of the comparison at learning rate `lr`."""
    from optim_adafactor import Adafactor
    from optim_came import CAME

    if (entry := OPTIMIZERS.get(name)) is None:
        raise ValueError(f"`name` ({name!r}) must be one of {list(OPTIMIZERS)}")
    classes: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "AdamW": torch.optim.AdamW, "Adafactor": Adafactor, "CAME": CAME}  # fmt: skip
    make = bitsandbytes().optim.AdamW8bit if entry.cls == "AdamW8bit" else classes[entry.cls]
    return make(params, lr=lr, **entry.kwargs)


def bitsandbytes() -> ModuleType:
    """The `bitsandbytes` module; a ValueError naming the package when it does not import."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as err:
        raise ValueError(
            f"optimizers {sorted(BNB)} need the `bitsandbytes` package, which does not import "
            f"({err}); `pip install bitsandbytes` or leave them out of `--optimizers`"
        ) from err


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte tensors: the first 90% and the last 10% of pydoc's topics."""
    path = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def cosine_schedule(steps: int) -> Callable[[int], float]:
    """Linear warmup over 10% of `steps`, then cosine to zero (multiplier of the base lr)."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    return factor


def share_8bit(opt: torch.optim.Optimizer) -> float:
    """Share of the parameters whose state holds an 8-bit tensor of the parameter's size."""
    params: list[torch.Tensor] = [p for g in opt.param_groups for p in g["params"]]
    full = [(p, t) for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
    low = {p: p.numel() for p, t in full if t.element_size() == 1 and t.numel() == p.numel()}
    return sum(low.values()) / sum(p.numel() for p in params)


def train(run: Run) -> dict[str, object]:
    """Train one tiny Llama; return its per-step training losses, validation loss and state."""
    from leanlm_testing.models import tiny_llama

    torch.set_num_threads(1)
    start = time.perf_counter()
    train_data, val_data = load_data()
    model = tiny_llama(seed=run.seed).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(run.optimizer, model.parameters(), run.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(run.steps))
    gen = torch.Generator().manual_seed(run.seed)
    losses = []
    for _ in range(run.steps):
        starts = torch.randint(0, len(train_data) - run.seq, (run.batch,), generator=gen)
        x = torch.stack([train_data[s : s + run.seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    model.eval()
    stride = (len(val_data) - run.seq) // VAL_WINDOWS
    val = torch.stack([val_data[i * stride : i * stride + run.seq] for i in range(VAL_WINDOWS)])
    with torch.no_grad():
        val_loss = statistics.fmean(
            model(input_ids=chunk, labels=chunk).loss.item() for chunk in val.split(64)
        )
    return {
        "train": losses,
        "val": val_loss,
        "state_bytes_per_param": bench.state_bytes(opt) / n_params,
        "share_8bit": share_8bit(opt),
        "seconds": time.perf_counter() - start,
    }


class Cache:
    """Finished runs, kept in a JSON file (or in memory without one)."""

    def __init__(self, path: pathlib.Path | None) -> None:
        self.path = path
        self.runs: dict[str, dict[str, object]] = {}
        if path is not None and path.exists():
            self.runs = json.loads(path.read_text())

    def execute(self, runs: list[Run], workers: int) -> None:
        """Run what is not cached yet, `workers` processes at a time, saving after each."""
        todo = [r for r in dict.fromkeys(runs) if r.key not in self.runs]
        if not todo:
            return
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for run, result in zip(todo, pool.imap(train, todo), strict=True):
                self.runs[run.key] = result
                print(f"  {run.optimizer:<10} lr {run.lr:<7g} seed {run.seed}: val "
                      f"{result['val']:.4f}  ({result['seconds']:.0f} s)", flush=True)  # fmt: skip
                if self.path is not None:
                    self.path.write_text(json.dumps(self.runs))

    def get(self, run: Run) -> dict[str, object]:
        """The result of a finished run."""
        return self.runs[run.key]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def mean_std(values: list[float]) -> str:
    """'mean ± std' (sample std; '±0' for a single value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def plot(
    panels: list[tuple[str, dict[str, tuple[float, list[list[float]]]]]],
    steps: int,
    path: pathlib.Path,
) -> None:
    """One panel per (title, {optimizer: (lr, per-seed losses)}): smoothed mean and seed range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), sharey=True)
    low, high = math.inf, -math.inf
    for ax, (title, curves) in zip(axes if len(panels) > 1 else [axes], panels, strict=True):
        for name, (lr, seeds) in curves.items():
            smoothed = [smooth(s, SMOOTH) for s in seeds]
            mean = [statistics.fmean(col) for col in zip(*smoothed, strict=True)]
            x = range(1, steps + 1)
            ax.plot(x, mean, color=OPTIMIZERS[name].color, lw=1.2, label=f"{name} (lr {lr:g})")
            ax.fill_between(
                x,
                [min(col) for col in zip(*smoothed, strict=True)],
                [max(col) for col in zip(*smoothed, strict=True)],
                color=OPTIMIZERS[name].color,
                alpha=0.2,
                lw=0,
            )
            low = min(low, *mean)
            high = max(high, mean[steps // 5])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = axes[0] if len(panels) > 1 else axes
    first.set_ylabel(f"training loss (moving avg. {SMOOTH})")
    first.set_ylim(low - 0.05, high + 0.1)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache", type=pathlib.Path, default=None, help="JSON of finished runs")
    parser.add_argument("--png", type=pathlib.Path, default=None, help="write the plot here")
    parser.add_argument("--quick", action="store_true", help="40 steps, 1 seed, shared lr only")
    parser.add_argument("--shared-only", action="store_true", help="no lr sweep: shared lr only")
    parser.add_argument("--optimizers", default=None, help="comma-separated; default: all")
    args = parser.parse_args()
    names = list(OPTIMIZERS) if args.optimizers is None else args.optimizers.split(",")
    if unknown := sorted(set(names) - set(OPTIMIZERS)):
        raise ValueError(f"`--optimizers` has unknown names {unknown}; choose from {[*OPTIMIZERS]}")
    if set(BNB) & set(names):
        try:
            bitsandbytes()
        except ValueError:
            if args.optimizers is not None:
                raise  # asked for by name
            names = [n for n in names if n not in BNB]
            print(f"# {sorted(BNB)} left out: bitsandbytes does not import")
    steps, seeds = (40, 1) if args.quick else (args.steps, args.seeds)
    if steps < 10 or seeds < 1:
        raise ValueError(f"`--steps` ({steps}) must be >= 10 and `--seeds` ({seeds}) >= 1")
    shared_only = args.quick or args.shared_only
    grids = {n: (SHARED_LR,) if shared_only else OPTIMIZERS[n].grid for n in names}
    cache = Cache(args.cache)
    start = time.perf_counter()

    dists = ["optim-came", "optim-adafactor", "transformers", "bitsandbytes"]
    print(bench.header("exp_convergence", "cpu", dists, where=pathlib.Path(__file__).parents[1]))
    print(f"# {args.workers} workers x 1 torch thread; {steps} steps, {seeds} seed(s)\n")

    # 1. Every seed at the shared lr (first, so that an interrupted run still has this table),
    # then the seed-0 sweep that picks each optimizer's own lr.
    shared = [
        Run(optimizer=n, lr=SHARED_LR, seed=s, steps=steps) for s in range(seeds) for n in grids
    ]
    sweep = [Run(optimizer=n, lr=lr, seed=0, steps=steps) for n, g in grids.items() for lr in g]
    cache.execute(shared + sweep, args.workers)
    best = {
        name: min(
            grid,
            key=lambda lr, n=name: cache.get(Run(optimizer=n, lr=lr, seed=0, steps=steps))["val"],
        )  # type: ignore[misc]
        for name, grid in grids.items()
    }
    # 2. The other seeds at the own lr.
    more = [
        Run(optimizer=n, lr=best[n], seed=s, steps=steps) for s in range(1, seeds) for n in grids
    ]
    cache.execute(more, args.workers)
    wall = time.perf_counter() - start
    used = {r.key for r in shared + sweep + more}
    compute = sum(float(cache.runs[k]["seconds"]) for k in used)  # type: ignore[arg-type]

    print("\nSeed-0 sweep, validation loss:\n")
    all_lrs = sorted({lr for g in grids.values() for lr in g})
    print("| optimizer | " + " | ".join(f"lr {lr:g}" for lr in all_lrs) + " |")
    print("|---|" + "---:|" * len(all_lrs))
    for name, grid in grids.items():
        cells = []
        for lr in all_lrs:
            if lr not in grid:
                cells.append("")
                continue
            val = cache.get(Run(optimizer=name, lr=lr, seed=0, steps=steps))["val"]
            cells.append(f"**{val:.3f}**" if lr == best[name] else f"{val:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")

    panels = []
    for title, lrs in (("own lr", best), ("shared lr", dict.fromkeys(grids, SHARED_LR))):
        print(f"\n{title.capitalize()}, {seeds} seed(s):\n")
        print("| optimizer | lr | val loss | train loss (last 50) | state B/param | 8-bit |")
        print("|---|---:|---:|---:|---:|---:|")
        curves, per_seed = {}, {}
        for name in grids:
            results = [
                cache.get(Run(optimizer=name, lr=lrs[name], seed=s, steps=steps))
                for s in range(seeds)
            ]
            vals = [float(r["val"]) for r in results]  # type: ignore[arg-type]
            tails = [statistics.fmean(r["train"][-TAIL:]) for r in results]  # type: ignore[index]
            per = float(results[0]["state_bytes_per_param"])  # type: ignore[arg-type]
            share = results[0].get("share_8bit")  # absent in runs cached by older versions
            print(f"| {name} | {lrs[name]:g} | {mean_std(vals)} | {mean_std(tails)} | {per:.2f} "
                  f"| {'-' if share is None else f'{share:.1%}'} |")  # fmt: skip
            curves[name] = (lrs[name], [r["train"] for r in results])
            per_seed[name] = "/".join(f"{v:.3f}" for v in vals)
        panels.append((f"{title} ({seeds} seeds; band: seed range)", curves))
        if not args.quick:
            print("\nper seed (val): " + "; ".join(f"{n} {v}" for n, v in per_seed.items()))
    if args.png is not None:
        plot(panels, steps, args.png)  # type: ignore[arg-type]
        print(f"\nplot: {args.png} ({args.png.stat().st_size / 1e3:.0f} kB)")
    print(f"wall time {wall / 60:.1f} min (runs not in the cache); the {len(used)} runs took "
          f"{compute / 60:.0f} process-minutes in all")  # fmt: skip


if __name__ == "__main__":
    main()
