"""Downstream evaluation: lm-evaluation-harness tasks on every stage's model (`[eval]`).

After each stage the main process wraps the stage's local model folder and tokenizer in lm-eval's
`HFLM` and runs `lm_eval.simple_evaluate` on `eval.lm_eval_tasks` while the others wait. Each
task's `eval.lm_eval_metric` (with standard error and document count) goes into the stage's
`result.json` as `metrics["lm_eval"]` and a report column, the full results into
`<stage>/lm_eval.json`; a resumed stage that already holds every task is not scored again.
Needs the optional dependency `leanlm[eval]`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from leanlm.config import ConfigError, EvalConfig

if TYPE_CHECKING:
    from accelerate import Accelerator

    from leanlm.config import RunConfig
    from leanlm.stages.base import StageResult

RESULTS_FILE = "lm_eval.json"
"""lm-eval's results for a stage's model, in the stage's folder."""
SAMPLES_FILE = "lm_eval_samples.jsonl"
"""With `lm_eval_log_samples`: every document's requests and responses, one JSON line each."""
INSTALL_HINT = "pip install leanlm[eval]"


def task_manager(cfg: EvalConfig) -> Any:
    """lm-eval's `TaskManager` for `cfg`, after checking that every task exists.

    Raises:
        ConfigError: lm-eval is not installed (`pip install leanlm[eval]`), the include path is
            not a folder, or a task is unknown (naming `eval.lm_eval_tasks` and the task).
    """
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "eval.lm_eval_tasks",
            f"{list(cfg.lm_eval_tasks)} needs lm-evaluation-harness, which is not installed: "
            f"{INSTALL_HINT}",
        )
    include = cfg.lm_eval_include_path
    if include and not Path(include).is_dir():
        raise ConfigError(
            "eval.lm_eval_include_path", f"{include!r} is not a folder of task YAML files"
        )
    from lm_eval.tasks import TaskManager

    manager = TaskManager(
        include_path=include or None, include_defaults=cfg.lm_eval_include_defaults
    )
    known = set(manager.all_tasks)
    for task in cfg.lm_eval_tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            places = [f"under {include!r}"] if include else []
            places += ["built in"] if cfg.lm_eval_include_defaults else []
            where = " or ".join(places)
            raise ConfigError(
                "eval.lm_eval_tasks",
                f"unknown lm-eval task {task!r} (not a task, group or tag {where}){hint}",
            )
        if task in manager.all_tags:  # a set of tasks with no score of its own
            members = sorted(n for n, e in manager.task_index.items() if task in e.tags)
            shown = ", ".join(members[:8]) + (", ..." if len(members) > 8 else "")
            raise ConfigError(
                "eval.lm_eval_tasks",
                f"{task!r} is an lm-eval tag, a set of tasks without a score of its own: list "
                f"its tasks instead ({shown})",
            )
    return manager


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states (lm-eval seeds all three)."""
    py, npy = random.getstate(), np.random.get_state()  # noqa: NPY002 (the global state)
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)  # noqa: NPY002


def run_tasks(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: EvalConfig,
    *,
    manager: Any,
    mixed_precision: str = "no",
    log_samples: bool | None = None,
) -> dict[str, Any]:
    """lm-eval's results for `model` (a loaded causal LM) on `cfg.lm_eval_tasks`.

    `model` and `tokenizer` are wrapped in `HFLM` as they are (no download, no copy); the global
    RNG states are left as they were. `mixed_precision` (`bf16` / `fp16`) autocasts the forward
    passes. Returns `simple_evaluate`'s dict (`results`, `n-samples`, and `samples` when
    `log_samples`, default `cfg.lm_eval_log_samples`).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=cfg.lm_eval_batch_size,
        mixed_precision_dtype=dtype,
    )
    with _rng_kept():
        results = simple_evaluate(
            model=lm,
            tasks=list(cfg.lm_eval_tasks),
            num_fewshot=cfg.lm_eval_num_fewshot,
            limit=cfg.lm_eval_limit or None,
            task_manager=manager,
            log_samples=cfg.lm_eval_log_samples if log_samples is None else log_samples,
        )
    assert results is not None  # one process: lm-eval's rank is 0
    return dict(results)


def scores(results: dict[str, Any], cfg: EvalConfig) -> dict[str, dict[str, Any]]:
    """Per task: `metric` (its name), `value`, `stderr` (or None) and `samples` (documents).

    The metric is `cfg.lm_eval_metric` under lm-eval's default filter (`none`) if the task has
    it, else under another filter, else the task's first metric.
    """
    out = {}
    for task in cfg.lm_eval_tasks:
        row = results["results"][task]
        found = [k for k in row if "," in k and "_stderr," not in k and _number(row[k])]
        wanted = [f"{cfg.lm_eval_metric},none"]
        wanted += [k for k in found if k.split(",")[0] == cfg.lm_eval_metric]
        key = next((k for k in wanted if k in row), found[0] if found else None)
        if key is None:
            raise ValueError(
                f"`eval.lm_eval_tasks`: lm-eval reported no score for {task!r} (a group without "
                f"an aggregate score?): list its tasks instead. It reported: {row}"
            )
        name, _, filt = key.partition(",")
        stderr = row.get(f"{name}_stderr,{filt}")
        counts = results.get("n-samples", {}).get(task, {})
        out[task] = {
            "metric": name if filt == "none" else key,
            "value": float(row[key]),
            "stderr": float(stderr) if _number(stderr) else None,
            "samples": counts.get("effective"),
        }
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Downstream:
    """The pipeline's downstream evaluation: checks `[eval]` up front, scores each stage."""

    def __init__(self, config: RunConfig, accelerator: Accelerator) -> None:
        """Check the tasks (every process, so all stop alike on a bad one) before any stage.

        Raises:
            ConfigError: see `task_manager`.
        """
        self.cfg = config.eval
        self.mixed_precision = config.mixed_precision
        self.acc = accelerator
        self.manager = task_manager(self.cfg) if self.cfg.lm_eval_tasks else None

    def score(self, result: StageResult, run_dir: Path) -> StageResult:
        """`result` with `metrics["lm_eval"]` for every task (saved), scored where missing."""
        if self.manager is None:
            return result
        stage_dir = run_dir / result.stage
        done = result.metrics.get("lm_eval", {})
        if all(task in done for task in self.cfg.lm_eval_tasks):
            return result
        holder: list[Any] = [None]
        if self.acc.is_main_process:
            holder[0] = self._evaluate(run_dir / result.model_dir, stage_dir)
        from accelerate.utils import broadcast_object_list

        if self.acc.num_processes > 1:  # the others wait here while the main process scores
            broadcast_object_list(holder)
        metrics = {**result.metrics, "lm_eval": {**done, **holder[0]}}
        result = dataclasses.replace(result, metrics=metrics)
        if self.acc.is_main_process:
            result.save(stage_dir)
        return result

    def _evaluate(self, model_dir: Path, stage_dir: Path) -> dict[str, dict[str, Any]]:
        """Score the model folder `model_dir`; write `lm_eval.json` (and samples) to `stage_dir`."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.acc.device).eval()
        self.acc.print(f"[{stage_dir.name}] lm-eval: {', '.join(self.cfg.lm_eval_tasks)}")
        results = run_tasks(
            model, tokenizer, self.cfg, manager=self.manager, mixed_precision=self.mixed_precision
        )
        del model
        found = scores(results, self.cfg)
        from importlib.metadata import version

        record: dict[str, Any] = {
            "lm_eval_version": version("lm_eval"),
            "scores": found,
            **{k: results[k] for k in ("results", "n-samples", "versions") if k in results},
        }
        path = stage_dir / RESULTS_FILE
        path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
        if "samples" in results and self.cfg.lm_eval_log_samples:
            rows = [
                json.dumps({"task": task, **sample}, default=str)
                for task, samples in results["samples"].items()
                for sample in samples
            ]
            (stage_dir / SAMPLES_FILE).write_text("".join(row + "\n" for row in rows))
        return found
