"""The report's figures: loss curves of the training stages, and perplexity against size.

Each `*_figure` function builds and returns a matplotlib `Figure` (Agg backend, constrained
layout so no label is clipped); `write_report` saves and closes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leanlm.report.metrics import read_metrics
from leanlm.stages.base import StageResult

CROSS_ENTROPY = "cross-entropy"
"""The `loss_label` of a stage trained with next-token loss (the default)."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_figure(run_dir: Path, results: list[StageResult]) -> Any:
    """Training and validation loss of every stage that trains, stages one after another.

    Next-token cross-entropy (training curves of stages whose `loss_label` is cross-entropy,
    and every validation point) is drawn on the first axes. A training loss of another kind
    (distill's KL to the teacher) gets axes of its own below, labelled with what it is, so it
    is never read as a cross-entropy near zero.
    """
    plt = _pyplot()
    curves = []
    offset = 0
    for result in results:
        rows = read_metrics(run_dir / result.stage / "metrics.jsonl")
        train = [(offset + r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(offset + r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            curves.append((result, train, val))
            offset = max(step for step, _ in train)
    other = [c for c in curves if c[0].loss_label != CROSS_ENTROPY]
    fig, axes = plt.subplots(
        2 if other else 1,
        1,
        figsize=(8, 6.5 if other else 4),
        dpi=120,
        sharex=True,
        squeeze=False,
        layout="constrained",
        height_ratios=[2, 1] if other else None,
    )
    ce_ax = axes[0][0]
    other_ax = axes[1][0] if other else None
    for i, (result, train, val) in enumerate(curves):
        kl = result.loss_label != CROSS_ENTROPY
        ax = other_ax if kl else ce_ax
        assert ax is not None
        color = f"C{i}"  # one colour per stage, on both axes
        ax.plot(*zip(*train, strict=True), color=color, label=f"{result.stage} train", lw=1)
        if val:
            ce_ax.plot(*zip(*val, strict=True), "o--", color=color, label=f"{result.stage} val")
    fig.suptitle("Loss during training (stages one after another)")
    ce_ax.set_title("Next-token cross-entropy (validation points: every stage)")
    ce_ax.set_ylabel("cross-entropy (nats / token)")
    if other_ax is not None:
        labels = sorted({c[0].loss_label for c in other})
        other_ax.set_title("Training loss that is not cross-entropy: " + "; ".join(labels))
        other_ax.set_ylabel("loss (nats / token)")
        other_ax.legend(fontsize="small")
        other_ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("optimizer step")
    ce_ax.grid(alpha=0.3)
    if ce_ax.lines:
        ce_ax.legend(fontsize="small")
    return fig


def size_figure(results: list[StageResult]) -> Any:
    """Validation perplexity against non-zero parameters (millions), one point per stage."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=120, layout="constrained")
    for r in results:
        size = r.metrics.get("nonzero_params", r.metrics.get("params"))
        ppl = r.metrics.get("val_perplexity")
        if size is None or ppl is None:
            continue
        ax.scatter([size / 1e6], [ppl], s=40, zorder=3)
        ax.annotate(r.stage, (size / 1e6, ppl), textcoords="offset points", xytext=(6, 4))
        for label, other in r.perplexity_points.items():  # e.g. sparse before its fine-tune
            ax.scatter([size / 1e6], [other], s=40, marker="x", color="grey", zorder=3)
            ax.annotate(
                f"{r.stage} ({label})",
                (size / 1e6, other),
                textcoords="offset points",
                xytext=(6, 4),
                color="grey",
            )
    ax.margins(x=0.15, y=0.1)  # room for the point labels
    ax.set_title("Validation perplexity against model size")
    ax.set_xlabel("non-zero parameters (millions)")
    ax.set_ylabel("validation perplexity")
    ax.grid(alpha=0.3)
    return fig


def save(fig: Any, path: Path) -> None:
    """Write `fig` to `path` and close it."""
    fig.savefig(path)
    _pyplot().close(fig)
