"""`report.md` for a run: config, a table of every stage, and the loss curves (PNG)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from leanlm.config import RunConfig, dumps_toml
from leanlm.metrics import read_metrics
from leanlm.stages import StageResult

COLUMNS = (
    ("stage", "stage"),
    ("params", "params"),
    ("tokens", "tokens"),
    ("wall_time_s", "wall time (s)"),
    ("tokens_per_s", "tokens/s"),
    ("peak_rss_mib", "peak memory / process (MiB)"),
    ("val_loss", "val loss"),
    ("val_perplexity", "val perplexity"),
)


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


def stage_table(results: list[StageResult]) -> str:
    """A markdown table with one row per stage."""
    header = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" if key == "stage" else "---:" for key, _ in COLUMNS) + "|"
    rows = [
        "| "
        + " | ".join(_fmt({"stage": r.stage, **r.metrics}.get(key)) for key, _ in COLUMNS)
        + " |"
        for r in results
    ]
    return "\n".join([header, rule, *rows])


def plot_losses(run_dir: Path, results: list[StageResult], path: Path) -> None:
    """Training loss (and validation loss points) against step, one colour per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for result in results:
        rows = read_metrics(run_dir / result.stage / "metrics.jsonl")
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            line = ax.plot(*zip(*train, strict=True), label=f"{result.stage} train", lw=1)[0]
            if val:
                ax.plot(
                    *zip(*val, strict=True),
                    "o--",
                    color=line.get_color(),
                    label=f"{result.stage} val",
                )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(
    run_dir: Path, config: RunConfig, results: list[StageResult], *, corpus: str
) -> Path:
    """Write `run_dir/report.md` and `run_dir/loss.png`; returns the report's path."""
    plot_losses(run_dir, results, run_dir / "loss.png")
    processes = max((int(r.metrics.get("processes", 1)) for r in results), default=1)
    machine = (
        f"{platform.machine()}, {torch.get_num_threads()} threads, {processes} process(es), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )
    text = f"""# leanlm report: {config.name}

- Data: {corpus}; validation perplexity over the first {config.data.eval_windows or "all"} \
windows of {config.data.seq_len} tokens (each window scored on its own; first token unscored).
- Machine: {machine}.

## Stages

{stage_table(results)}

## Loss

![loss curves](loss.png)

## Configuration

```toml
{dumps_toml(config).strip()}
```
"""
    path = run_dir / "report.md"
    path.write_text(text)
    return path
