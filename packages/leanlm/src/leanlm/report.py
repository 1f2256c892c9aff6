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
    ("nonzero_params", "non-zero params"),
    ("disk_mb", "weights on disk (MB)"),
    ("tokens", "tokens"),
    ("wall_time_s", "wall time (s)"),
    ("tokens_per_s", "tokens/s"),
    ("peak_rss_mib", "peak memory / process (MiB)"),
    ("val_loss", "val loss"),
    ("val_perplexity", "val perplexity"),
)
"""Report table columns: (metrics key, title)."""


def _row(result: StageResult) -> dict[str, Any]:
    """A stage's metrics plus the derived columns."""
    m = {"stage": result.stage, **result.metrics}
    # The smallest lossless file the stage wrote: the compact sparse format where there is one.
    size = m.get("compressed_bytes", m.get("weights_bytes"))
    if size is not None:
        m["disk_mb"] = size / 1e6
    return m


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
    rows = ["| " + " | ".join(_fmt(_row(r).get(key)) for key, _ in COLUMNS) + " |" for r in results]
    return "\n".join([header, rule, *rows])


def plot_losses(run_dir: Path, results: list[StageResult], path: Path) -> None:
    """Training loss (and validation loss points) of every stage that trains, end to end.

    Stages are laid out one after another on the x axis (each starts where the previous one's
    steps ended), one colour per stage.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    offset = 0
    for result in results:
        rows = read_metrics(run_dir / result.stage / "metrics.jsonl")
        train = [(offset + r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(offset + r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            # distill's training loss is the KL to the teacher, not next-token cross-entropy
            kind = " (KL to teacher)" if result.stage == "distill" else ""
            label = f"{result.stage} train{kind}"
            line = ax.plot(*zip(*train, strict=True), label=label, lw=1)[0]
            if val:
                ax.plot(
                    *zip(*val, strict=True),
                    "o--",
                    color=line.get_color(),
                    label=f"{result.stage} val",
                )
            offset = max(step for step, _ in train)
    ax.set_xlabel("optimizer step (stages one after another)")
    ax.set_ylabel("loss (nats / token); val = cross-entropy")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_size_vs_perplexity(results: list[StageResult], path: Path) -> None:
    """Validation perplexity against non-zero parameters, one labelled point per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    points = [
        (r.stage, r.metrics.get("nonzero_params", r.metrics.get("params")), r.metrics)
        for r in results
    ]
    for stage, size, metrics in points:
        ppl = metrics.get("val_perplexity")
        if size is None or ppl is None:
            continue
        ax.scatter([size], [ppl], s=40, zorder=3)
        ax.annotate(stage, (size, ppl), textcoords="offset points", xytext=(6, 4))
        one_shot = metrics.get("one_shot_val_perplexity")
        if one_shot is not None:  # the sparse model before its fine-tune
            ax.scatter([size], [one_shot], s=40, marker="x", color="grey", zorder=3)
            ax.annotate(
                f"{stage} (one-shot)",
                (size, one_shot),
                textcoords="offset points",
                xytext=(6, 4),
                color="grey",
            )
    ax.set_xlabel("non-zero parameters")
    ax.set_ylabel("validation perplexity")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _notes(results: list[StageResult]) -> str:
    lines = []
    for r in results:
        m = r.metrics
        if "one_shot_val_perplexity" in m:
            lines.append(
                f"- `{r.stage}`: {m.get('masked_sparsity', 0):.1%} of the decoder Linear weights "
                f"are zero; validation perplexity {m['one_shot_val_perplexity']:.2f} right after "
                f"one-shot pruning, {m['val_perplexity']:.2f} after the sparse fine-tune. Its "
                f"size on disk is the compact format (`{r.stage}/compressed.safetensors`, "
                f"{m.get('compressed_bytes', 0) / 1e6:.2f} MB; the reloadable dense-format "
                f"folder is {m.get('weights_bytes', 0) / 1e6:.2f} MB)."
            )
        if m.get("parallel", "none") != "none":
            extra = (
                f", {m['model_state_mib']:.1f} MiB of model state per process"
                if "model_state_mib" in m
                else ""
            )
            lines.append(
                f"- `{r.stage}`: {m.get('processes')} processes, {m['parallel']}, optimizer "
                f"{m.get('optimizer')}{extra}."
            )
        elif "optimizer" in m:
            lines.append(f"- `{r.stage}`: optimizer {m['optimizer']}.")
        if m.get("bad_steps"):
            lines.append(f"- `{r.stage}`: {m['bad_steps']} step(s) skipped (NaN/inf loss).")
    return "\n".join(lines)


def write_report(
    run_dir: Path, config: RunConfig, results: list[StageResult], *, corpus: str
) -> Path:
    """Write `run_dir/report.md`, `loss.png` and `size.png`; returns the report's path."""
    plot_losses(run_dir, results, run_dir / "loss.png")
    plot_size_vs_perplexity(results, run_dir / "size.png")
    processes = max((int(r.metrics.get("processes", 1)) for r in results), default=1)
    machine = (
        f"{platform.machine()}, {torch.get_num_threads()} threads, {processes} process(es), "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )
    text = f"""# leanlm report: {config.name}

- Data: {corpus}; validation perplexity over {config.data.eval_windows or "all"} windows of \
{config.data.seq_len} tokens spread evenly over the held-out files (each window scored on its \
own; first token unscored).
- Machine: {machine}.

## Stages

{stage_table(results)}

Peak memory is each stage's peak resident set (CPU) or allocated CUDA memory of one process;
wall time includes evaluation and saving.

{_notes(results)}

## Loss

![loss curves](loss.png)

## Perplexity against size

![perplexity vs non-zero parameters](size.png)

## Configuration

```toml
{dumps_toml(config).strip()}
```
"""
    path = run_dir / "report.md"
    path.write_text(text)
    return path
