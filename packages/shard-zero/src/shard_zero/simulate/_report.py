"""Render a `SimReport`: a Markdown table, a JSON summary and a live-bytes timeline (PNG)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from shard_zero.simulate._run import SimReport, SystemResult

GIB = 2**30
_COLUMNS = ("params", "masters", "grads", "optimizer state", "activations", "temporaries")
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _anchor(report: SimReport, name: str) -> SystemResult | None:
    for result in report.systems:
        if result.name == name and result.error is None:
            return result
    return None


def conditions(report: SimReport) -> str:
    """One line stating what was simulated."""
    c = report.config
    opt = c.optimizer if isinstance(c.optimizer, str) else "custom"
    fsdp2_opt = c.fsdp2_optimizer or opt
    layers = "" if c.num_layers is None else f", {c.num_layers} decoder layers"
    return (
        f"{c.model}{layers} (Ψ = {report.psi:,} parameters), world {c.world_size}, "
        f"{c.param_dtype} compute / fp32 masters and gradient reduction, optimizer {opt} "
        f"(FSDP2 rows: {fsdp2_opt}), micro-batch {c.micro_batch} x {c.seq_len} tokens, "
        f"{c.micro_batches} micro-batch(es) per step"
        f"{', bf16 gradient accumulator' if c.accum_dtype == 'bf16' else ''}"
        f"{', accumulator offloaded to host memory' if c.offload_accum else ''}"
        f"{', shard-zero optimizer offloaded to the host' if c.offload_optimizer else ''}"
        f"{'' if c.bucket_numel is None else f', shard-zero bucket_numel {c.bucket_numel:,}'}, "
        "activation checkpointing "
        f"{'on' if c.activation_checkpointing else 'off'}; torch {report.versions['torch']}, "
        f"transformers {report.versions['transformers']}; per-rank bytes of rank 0, "
        "measured on fake tensors"
    )


def table(report: SimReport) -> str:
    """The Markdown table: peak per rank by category, collectives per step, the formula."""
    anchors = [_anchor(report, n) for n in ("fsdp2-reshard", "fsdp2-no-reshard")]
    offload = report.config.offload_accum or report.config.offload_optimizer
    columns = (*_COLUMNS, "host") if offload else _COLUMNS
    kinds = (*_KINDS, "to_host", "from_host") if offload else _KINDS
    head = (
        "| system | peak / rank (GiB) | x fsdp2-reshard | x fsdp2-no-reshard | "
        + " | ".join(columns)
        + " | ZeRO formula, model states (GiB) | "
        + " | ".join(f"{k} GiB (calls)" for k in kinds)
        + " | backward matmuls after 1st reduce |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report.systems:
        if r.error is not None:
            rows.append(f"| {r.name} | failed: {r.error} |" + " |" * (head.count("|") - 3))
            continue
        cells = [r.name, _gib(r.peak["total"])]
        cells += ["-" if a is None else f"{r.peak['total'] / a.peak['total']:.3f}" for a in anchors]
        cells += [_gib(r.peak[c]) for c in columns]
        formula = _gib(r.formula)
        cells.append(f"{formula} (stage {r.formula_stage})" if r.formula is not None else "-")
        cells += [f"{_gib(r.bytes.get(k, 0))} ({r.calls.get(k, 0)})" for k in kinds]
        cells.append(f"{r.overlap:.2f}" if r.calls.get("reduce_scatter") else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(report: SimReport) -> dict[str, Any]:
    """A JSON-able summary (timelines left out)."""
    c = report.config
    config = {k: v for k, v in vars(c).items() if k not in {"optimizer", "optimizer_kwargs"}}
    config["optimizer_kwargs"] = dict(c.optimizer_kwargs or {})
    config["optimizer"] = c.optimizer if isinstance(c.optimizer, str) else "custom"
    config["stages"] = list(c.stages)
    return {
        "conditions": conditions(report),
        "config": config,
        "psi": report.psi,
        "versions": report.versions,
        "systems": [
            {
                "name": r.name,
                "error": r.error,
                "peak": r.peak,
                "category_max": r.maxima,
                "calls": r.calls,
                "bytes": r.bytes,
                "backward_overlap": r.overlap,
                "formula": r.formula,
                "formula_stage": r.formula_stage,
                "seconds": round(r.seconds, 2),
                "extra": r.extra,
            }
            for r in report.systems
        ],
    }


def write_json(report: SimReport, path: str | Path) -> None:
    """Write `summary(report)` to `path`."""
    Path(path).write_text(json.dumps(summary(report), indent=1) + "\n")


def plot(report: SimReport, path: str | Path) -> None:
    """Live bytes over the measured step, one panel per system, phases shaded (a PNG)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("the timeline plot needs matplotlib (pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report.systems if r.error is None and r.timeline]
    fig, axes = plt.subplots(
        len(done), 1, figsize=(10, 1.9 * len(done) + 0.8), sharey=True, squeeze=False
    )
    shades = {"backward": "#e8eef8", "step": "#f8eee0"}
    for ax, r in zip(axes[:, 0], done, strict=True):
        ax.plot([v / GIB for v in r.timeline], lw=1.0, color="#1f4e99")
        ends = [m[1] for m in r.marks[1:]] + [len(r.timeline)]
        for (phase, start), end in zip(r.marks, ends, strict=True):
            if phase in shades:
                ax.axvspan(start, end, color=shades[phase], lw=0)
        ax.axhline(r.peak["total"] / GIB, color="#b03030", lw=0.8, ls="--")
        ax.set_title(f"{r.name}: peak {r.peak['total'] / GIB:.2f} GiB", fontsize=9, loc="left")
        ax.set_ylabel("GiB")
        ax.set_xlim(0, len(r.timeline))
    axes[-1, 0].set_xlabel(
        "dispatched ops in the measured step (blue: backward, orange: optimizer step)"
    )
    title = "Live bytes per rank over one step\n" + textwrap.fill(conditions(report), 150)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
