"""Training metrics: `metrics.jsonl` rows and TensorBoard scalars, written by the main process."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


class MetricsLog:
    """Appends JSON rows to `path` and mirrors numeric fields to TensorBoard.

    On resume (`resume_step` > 0) rows after that step are dropped first, and TensorBoard purges
    its events after it, so a resumed run's logs read like an uninterrupted run's.
    """

    def __init__(self, path: Path, *, enabled: bool, resume_step: int = 0) -> None:
        self.path = path
        self.enabled = enabled
        self._writer: Any = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = (
            [row for row in read_metrics(path) if row.get("step", 0) <= resume_step]
            if resume_step
            else []
        )
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(
            log_dir=str(path.parent / "tensorboard"), purge_step=resume_step or None
        )

    def log(self, row: dict[str, Any]) -> None:
        """Write one row (must contain `step`)."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                self._writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        """Flush TensorBoard."""
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` (empty if missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
