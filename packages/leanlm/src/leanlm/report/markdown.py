"""`report.md` for a run: how it was made, a table of every stage, notes, models, samples, plots.

Nothing here knows a stage by name: a stage's row comes from its `StageResult.metrics`, its notes
from `StageResult.notes`, its loss curve's axis from `StageResult.loss_label`.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from leanlm.config import DataConfig, RunConfig, dumps_toml
from leanlm.report import plots
from leanlm.stages.base import StageResult

COLUMNS = (
    ("stage", "stage"),
    ("params_m", "params (M)"),
    ("nonzero_params_m", "non-zero params (M)"),
    ("disk_mb", "weights on disk (MB)"),
    ("tokens", "tokens"),
    ("wall_time_s", "wall time (s)"),
    ("tokens_per_s", "tokens/s"),
    ("peak_rss_mib", "peak memory / process (MiB)"),
    ("val_loss", "val loss"),
    ("val_perplexity", "val perplexity"),
)
"""Report table columns: (row key, title)."""

SAMPLE_PROMPT = "def main():\n    "
"""The prompt every stage's model continues greedily in the report."""
SAMPLE_TOKENS = 24
"""Tokens generated per sample."""

VERSIONED = ("leanlm", "torch", "transformers", "accelerate")
"""Packages whose versions the report lists."""


METRIC_MEANINGS = {
    "acc": "accuracy, the share of documents whose gold answer the model scores highest "
    "(summed log-likelihood of each choice)",
    "acc_norm": "accuracy with each choice's log-likelihood divided by its length in characters",
}
"""What the usual lm-eval metrics mean, for the report's note under the table."""


def task_columns(results: list[StageResult]) -> list[tuple[str, str]]:
    """One column per lm-eval task scored on any stage: (row key, title naming the metric)."""
    found: dict[str, str] = {}
    for r in results:
        for task, score in r.metrics.get("lm_eval", {}).items():
            found.setdefault(task, score["metric"])
    return [(f"lm_eval/{task}", f"{task} ({metric})") for task, metric in found.items()]


def _row(result: StageResult) -> dict[str, Any]:
    """A stage's metrics plus the derived columns."""
    m = {"stage": result.stage, **result.metrics}
    for task, score in result.metrics.get("lm_eval", {}).items():
        m[f"lm_eval/{task}"] = score["value"]
    # The smallest lossless file the stage wrote: the compact sparse format where there is one.
    size = m.get("disk_bytes", m.get("weights_bytes"))
    if size is not None:
        m["disk_mb"] = size / 1e6
    for key in ("params", "nonzero_params"):
        if key in m:
            m[f"{key}_m"] = f"{m[key] / 1e6:.3f}"
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
    """A markdown table with one row per stage (and a column per lm-eval task)."""
    columns = [*COLUMNS, *task_columns(results)]
    header = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "|".join("---" if key == "stage" else "---:" for key, _ in columns) + "|"
    rows = ["| " + " | ".join(_fmt(_row(r).get(key)) for key, _ in columns) + " |" for r in results]
    return "\n".join([header, rule, *rows])


def _block(text: str) -> str:
    """`text` as a Markdown block (followed by a blank line), or nothing when it is empty."""
    return f"{text}\n\n" if text else ""


def tasks_note(config: RunConfig, results: list[StageResult]) -> str:
    """What the task columns are: lm-eval's version, metrics, documents and shots."""
    scored = [r.metrics["lm_eval"] for r in results if r.metrics.get("lm_eval")]
    if not scored:
        return ""
    try:
        harness = f"lm-evaluation-harness {metadata.version('lm_eval')}"
    except metadata.PackageNotFoundError:
        harness = "lm-evaluation-harness"
    cfg = config.eval
    shots = (
        "each task's default few-shot count"
        if cfg.lm_eval_num_fewshot is None
        else f"{cfg.lm_eval_num_fewshot}-shot"
    )
    counts = {task: score["samples"] for s in scored for task, score in s.items()}
    docs = ", ".join(f"`{t}` {n:,}" if isinstance(n, int) else f"`{t}`" for t, n in counts.items())
    metrics = sorted({score["metric"] for s in scored for score in s.values()})
    meaning = "; ".join(f"`{m}` is {METRIC_MEANINGS[m]}" for m in metrics if m in METRIC_MEANINGS)
    limit = f" (the first {cfg.lm_eval_limit} only)" if cfg.lm_eval_limit else ""
    return (
        f"Task columns: {harness} through its Python API on each stage's saved model, {shots}; "
        f"documents per task{limit}: {docs}. {meaning + '. ' if meaning else ''}Full results "
        "(standard errors included) in each stage's `lm_eval.json`."
    )


def notes(results: list[StageResult]) -> str:
    """The stages' own notes, then how each training stage ran (processes, optimizer, skips)."""
    lines = []
    for r in results:
        m = r.metrics
        lines += [f"- `{r.stage}`: {note}" for note in r.notes]
        if m.get("parallel", "none") != "none":
            extra = (
                f", {m['model_state_mib']:.1f} MiB of model state per process"
                if "model_state_mib" in m
                else ""
            )
            if "model_state_host_mib" in m:
                extra += f" ({m['model_state_host_mib']:.1f} MiB of it in host memory)"
            lines.append(
                f"- `{r.stage}`: {m.get('processes')} processes, {m['parallel']}, optimizer "
                f"{m.get('optimizer')}{extra}."
            )
        elif "optimizer" in m:
            lines.append(f"- `{r.stage}`: optimizer {m['optimizer']}.")
        if r.loss_label != plots.CROSS_ENTROPY:
            lines.append(f"- `{r.stage}`: its training loss is {r.loss_label}.")
        if m.get("bad_steps"):
            lines.append(f"- `{r.stage}`: {m['bad_steps']} step(s) skipped (NaN/inf loss).")
    return "\n".join(lines)


def greedy_sample(
    model_dir: Path, *, prompt: str = SAMPLE_PROMPT, tokens: int = SAMPLE_TOKENS
) -> str:
    """The text a model folder's model adds to `prompt` with greedy decoding (`tokens` tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar per sample
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False))


def models_section(run_dir: Path, results: list[StageResult]) -> str:
    """Each stage's model folder, how to load it, and a greedy sample from it."""
    parts = [
        f"Greedy continuation of {SAMPLE_PROMPT!r} ({SAMPLE_TOKENS} tokens) by each stage's model."
    ]
    for r in results:
        folder = (run_dir / r.model_dir).as_posix()
        raw = greedy_sample(run_dir / r.model_dir)
        sample = raw.rstrip() or f"(only whitespace: {raw!r})"
        parts.append(
            f"### {r.stage}\n\n"
            f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{folder}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{folder}")\n```\n\n'
            f"```text\n{SAMPLE_PROMPT}{sample}\n```"
        )
    return "\n\n".join(parts)


def git_commit() -> str:
    """The checkout's commit (`git describe --always --dirty`), or `unknown` outside git."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return out.stdout.strip()


def versions() -> str:
    """`name version` of the packages in `VERSIONED`, and Python's."""
    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join([*found, f"Python {platform.python_version()}"])


def windows_line(data: DataConfig, windows: int) -> str:
    """What the validation windows are: how many were scored, of what, taken from where."""
    stream = "the first ones of the validation stream"
    where = stream if data.streaming else "spread evenly over the validation split"
    asked = data.eval_windows
    short = f", all there are (`data.eval_windows` is {asked})" if asked > windows else ""
    return (
        f"validation perplexity over {windows} windows of {data.seq_len} tokens, {where}{short} "
        "(each window scored on its own; first token unscored)"
    )


def write_report(
    run_dir: Path,
    config: RunConfig,
    results: list[StageResult],
    *,
    corpus: str,
    eval_windows: int,
    command: str | None = None,
) -> Path:
    """Write `run_dir/report.md`, `loss.png` and `size.png`; returns the report's path.

    `eval_windows` is the number of validation windows every stage was scored on (fewer than
    `data.eval_windows` when the validation data holds fewer); `command` is how the run was
    started (default: this process's `sys.argv`).
    """
    plots.save(plots.loss_figure(run_dir, results), run_dir / "loss.png")
    plots.save(plots.size_figure(results), run_dir / "size.png")
    processes = max((int(r.metrics.get("processes", 1)) for r in results), default=1)
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, {processes} process(es)"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# leanlm report: {config.name}

- Command: `{command or shlex.join(sys.argv)}`
- Commit: `{git_commit()}`; written {now}.
- Versions: {versions()}.
- Machine: {machine}.
- Data: {corpus}; {windows_line(config.data, eval_windows)}. Every stage is scored on the same \
windows.

## Stages

{stage_table(results)}

{_block(tasks_note(config, results))}Peak memory is each stage's own peak resident set (CPU; reset \
before each stage) or allocated CUDA memory of one process; wall time includes evaluation and \
saving.

{notes(results)}

## Loss

![loss curves](loss.png)

## Perplexity against size

![perplexity vs non-zero parameters](size.png)

## Models

{models_section(run_dir, results)}

## Configuration

```toml
{dumps_toml(config).strip()}
```
"""
    path = run_dir / "report.md"
    path.write_text(text)
    return path
