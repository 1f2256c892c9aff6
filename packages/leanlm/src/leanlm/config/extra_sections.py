"""The sections of optional features: `[eval]` (lm-evaluation-harness) and `[logging]` (W&B).

Light to import, as every section (no torch): `leanlm.report.downstream` runs the evaluation and
`leanlm.report.metrics` the W&B logging; each needs an optional dependency only when switched on.
"""

from __future__ import annotations

import dataclasses
import re

from leanlm.config.configio import ConfigError, positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Downstream evaluation of every stage's model with lm-evaluation-harness (`leanlm[eval]`)."""

    lm_eval_tasks: tuple[str, ...] = ()
    """lm-evaluation-harness task or group names (e.g. `["mmlu", "winogrande"]`) run on every
    stage's model; the report gets a column per name. Empty: no downstream evaluation. A tag
    (a set of tasks without a score of its own) is refused: list its tasks."""
    lm_eval_include_path: str = ""
    """A folder of extra task YAML files (lm-eval's `include_path`), searched with the
    built-in tasks, e.g. a multiple-choice task over a local jsonl."""
    lm_eval_include_defaults: bool = True
    """Also index lm-eval's built-in tasks (14,683 names in lm-eval 0.4.13; 6-11 s per run on a
    2-core CPU). False: only the tasks under `lm_eval_include_path`."""
    lm_eval_metric: str = "acc"
    """The metric the report shows for each task (`acc`, `acc_norm`, `exact_match`, ...); a
    task that does not compute it shows its first metric, named in the column title."""
    lm_eval_num_fewshot: int | None = None
    """Few-shot examples per prompt; unset: each task's own default (0 for most)."""
    lm_eval_limit: int = 0
    """Score only the first N documents of each task (0 = all). For quick checks: scores on a
    subset are not comparable with published ones."""
    lm_eval_batch_size: int = 8
    """Requests per forward pass."""
    lm_eval_log_samples: bool = False
    """Also write each document's requests and responses (e.g. every choice's summed
    log-likelihood) to `<stage>/lm_eval_samples.jsonl`."""

    def __post_init__(self) -> None:
        positive(self, "lm_eval_batch_size")
        if self.lm_eval_limit < 0:
            raise ConfigError("lm_eval_limit", f"must be >= 0 (0 = all), got {self.lm_eval_limit}")
        if self.lm_eval_num_fewshot is not None and self.lm_eval_num_fewshot < 0:
            raise ConfigError(
                "lm_eval_num_fewshot", f"must be >= 0 or unset, got {self.lm_eval_num_fewshot}"
            )
        if not self.lm_eval_metric:
            raise ConfigError("lm_eval_metric", 'must name a metric, e.g. "acc"')
        for i, task in enumerate(self.lm_eval_tasks):
            if not task.strip():
                raise ConfigError(f"lm_eval_tasks[{i}]", "must be a task name, got an empty one")
        if len(set(self.lm_eval_tasks)) != len(self.lm_eval_tasks):
            raise ConfigError("lm_eval_tasks", f"lists a task twice: {list(self.lm_eval_tasks)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where the training scalars go besides `metrics.jsonl` and TensorBoard."""

    wandb: bool = False
    """Also log them to Weights & Biases (`pip install leanlm[wandb]`), from the main process
    only: one W&B run per leanlm run. `WANDB_MODE` (e.g. `offline`) and the other `WANDB_*`
    variables apply; the run's files go to `$WANDB_DIR`, else to the run folder's `wandb/`."""
    project: str = "leanlm"
    """The W&B project."""
    entity: str = ""
    """The W&B entity (user or team); empty: your default entity."""
    run_name: str = ""
    """The W&B run's display name; empty: the config's `name`."""

    def __post_init__(self) -> None:
        if not self.project or re.search(r"[/\\#?%:]", self.project):
            raise ConfigError(
                "project",
                f"({self.project!r}) must be a W&B project name: not empty, without / \\ # ? % :",
            )
