"""Training metrics: `metrics.jsonl` rows, mirrored to scalar sinks by the main process.

A sink takes the numeric fields of each row: TensorBoard (always, in `<stage>/tensorboard/`) and,
with `[logging] wandb = true`, one Weights & Biases run per leanlm run (`leanlm[wandb]`), opened
by the pipeline on the main process, each stage's scalars under `<stage>/` with `<stage>/step`
as their x-axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import resource
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from leanlm.config import ConfigError, LoggingConfig

WANDB_ID_FILE = "wandb_run_id"
"""In the run folder: the W&B run id, so that `--resume` continues the same W&B run."""


class ScalarSink(Protocol):
    """Something that records scalars against a step (TensorBoard, a W&B run, ...)."""

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record `scalars` (name -> value) at `step`."""

    def close(self) -> None:
        """Flush; the sink takes no more scalars."""


class TensorBoardSink:
    """A TensorBoard `SummaryWriter` in `log_dir`; `purge_step` drops the events after it."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # SummaryWriter's `purge_step` T drops the events at T and after: T + 1 keeps step T
        purge = None if purge_step is None else purge_step + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One TensorBoard scalar per key at `step`."""
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbRun:
    """One W&B run for a leanlm run; `stage(name)` is the sink a stage logs to.

    Construction raises `ConfigError` if wandb is not installed (`pip install leanlm[wandb]`).
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        *,
        name: str,
        config: Mapping[str, Any],
        resume: bool,
    ) -> None:
        require_wandb(cfg)
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity or None,
            name=cfg.run_name or name,
            config=dict(config),
            # read here, not once per process by wandb's settings: each run sees the current
            # WANDB_DIR / WANDB_MODE
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            mode=cast(Any, os.environ.get("WANDB_MODE") or None),  # wandb checks the value
            id=run_id,
            resume="allow",
            reinit="finish_previous",
        )
        id_file.write_text(f"{self.run.id}\n")

    def stage(self, name: str) -> ScalarSink:
        """The sink of stage `name`: its scalars as `name/<key>` against `name/step`."""
        self.run.define_metric(f"{name}/step", hidden=True)
        self.run.define_metric(f"{name}/*", step_metric=f"{name}/step")
        return _WandbStage(self.run, name)

    def close(self) -> None:
        """Finish the W&B run (uploads it, or closes its offline files)."""
        self.run.finish()


@dataclasses.dataclass
class _WandbStage:
    run: Any
    name: str

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        row = {f"{self.name}/{key}": value for key, value in scalars.items()}
        self.run.log({f"{self.name}/step": step, **row})

    def close(self) -> None:
        """Nothing: the run outlives the stage (`WandbRun.close` finishes it)."""


def require_wandb(cfg: LoggingConfig) -> None:
    """`ConfigError` naming `logging.wandb` if it is on and wandb is not installed."""
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb", "is true but wandb is not installed: pip install leanlm[wandb]"
        )


class MetricsLog:
    """Appends JSON rows to `path` and mirrors their numeric fields to TensorBoard and `sinks`.

    On resume (`resume_step` > 0) rows after that step are dropped first, and TensorBoard purges
    its events after it, so a resumed run's logs read like an uninterrupted run's (a W&B run
    cannot drop logged points: it shows the repeated steps twice). A start from step 0 (a new
    stage, or one `--restart-changed` reruns) empties `metrics.jsonl` and deletes the folder's
    earlier TensorBoard events.
    """

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool,
        resume_step: int = 0,
        sinks: Sequence[ScalarSink] = (),
    ) -> None:
        self.path = path
        self.enabled = enabled
        self._sinks: list[ScalarSink] = []
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = (
            [row for row in read_metrics(path) if row.get("step", 0) <= resume_step]
            if resume_step
            else []
        )
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        board_dir = path.parent / "tensorboard"
        if not resume_step:  # a discarded run's events: TensorBoard would show both curves
            shutil.rmtree(board_dir, ignore_errors=True)
        board = TensorBoardSink(board_dir, purge_step=resume_step or None)
        self._sinks = [board, *sinks]

    def log(self, row: dict[str, Any]) -> None:
        """Write one row (must contain `step`)."""
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as err:  # a full disk: say which file (a write's error names none)
            raise OSError(err.errno, err.strerror, str(self.path)) from err
        scalars = {
            k: v
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        }
        for sink in self._sinks:
            sink.add_scalars(row["step"], scalars)

    def close(self) -> None:
        """Flush the sinks."""
        for sink in self._sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` (empty if missing).

    A last line cut short (no newline: the append a kill or a full disk interrupted) is
    dropped; any other line that is not JSON raises a `ValueError` naming the file and line.
    """
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as err:
            if number == len(lines) and not text.endswith("\n"):
                break  # a torn append
            raise ValueError(f"{path} line {number} is not a JSON row ({err})") from None
    return rows


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (per stage): CUDA peak stats, or Linux's VmHWM.

    Elsewhere the peak stays the process's lifetime peak (`getrusage` cannot be reset).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # Linux >= 4.0: "5" resets the peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process since `reset_peak_memory`: CUDA max allocated, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux
