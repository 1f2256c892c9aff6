"""Atomic training checkpoints and atomic model folders.

A training checkpoint is `accelerator.save_state` (model, optimizer, RNG state of every process)
plus the scheduler and a `trainer_state.json` (step, tokens, elapsed time, config hash). It is
written into a hidden temporary folder and renamed to `step-XXXXXXXX` only when complete, so a
run killed at any moment leaves either a whole checkpoint or none; resuming picks the newest
whole one. The batch of a step is a pure function of the step (`data.global_batch_indices`),
so the step number is the whole data position.

A model sharded by shard-zero is not known to accelerate: its checkpoint adds a `zero/` folder
written by `shard_zero.save_checkpoint` (one file per rank, reshardable), next to the RNG states.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

_STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"
ZERO_DIR = "zero"


class Checkpointer:
    """Saves and finds training checkpoints in `directory` (one process writes the shared files)."""

    def __init__(self, directory: Path, accelerator: Accelerator, *, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"`keep` ({keep}) must be >= 1")
        self.directory = directory
        self.accelerator = accelerator
        self.keep = keep

    def complete(self) -> list[Path]:
        """Whole checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if _STEP_DIR.match(p.name) and (p / TRAINER_STATE).is_file()
        ]
        return sorted(found, key=lambda p: p.name)

    def latest(self, *, config_hash: str | None = None) -> Path | None:
        """The newest whole checkpoint (written under `config_hash`, if given), or `None`."""
        done = [p for p in self.complete() if config_hash is None or _hash_of(p) == config_hash]
        return done[-1] if done else None

    def discard_mismatched(self, config_hash: str) -> int:
        """Delete checkpoints written under another configuration; returns how many there were.

        Every process may call this; only the main process deletes.
        """
        stale = [p for p in self.complete() if _hash_of(p) != config_hash]
        if self.accelerator.is_main_process:
            for path in stale:
                shutil.rmtree(path, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return len(stale)

    def save(
        self,
        step: int,
        scheduler: Any,
        state: dict[str, Any],
        *,
        zero: tuple[torch.nn.Module, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of `step` atomically; every process must call this.

        `zero` is the `(model, optimizer)` pair of a shard-zero run. Half-written folders of a
        killed run (`.tmp-step-*`) are deleted first.
        """
        acc = self.accelerator
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if acc.is_main_process:
            for stale in self.directory.glob(".tmp-step-*"):  # left by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # prepared model and optimizer, per-process RNG states
        if zero is not None:
            from shard_zero import save_checkpoint

            save_checkpoint(tmp / ZERO_DIR, *zero)
        acc.wait_for_everyone()
        if acc.is_main_process:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            _write_json(tmp / TRAINER_STATE, {"step": step, **state})
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def load(
        self, path: Path, scheduler: Any, *, zero: tuple[torch.nn.Module, Any] | None = None
    ) -> dict[str, Any]:
        """Restore prepared objects, RNG and `scheduler` from `path`; returns the trainer state.

        Raises:
            ValueError: the checkpoint was (not) written by a shard-zero run and this one is
                (not) sharded.
        """
        if (zero is not None) != (path / ZERO_DIR).is_dir():
            raise ValueError(
                f"{path} was written {'with' if (path / ZERO_DIR).is_dir() else 'without'} "
                f"shard-zero, but this run is {'' if zero is not None else 'not '}sharded"
            )
        self.accelerator.load_state(str(path))
        if zero is not None:
            from shard_zero import load_checkpoint

            load_checkpoint(path / ZERO_DIR, *zero)
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        state: dict[str, Any] = json.loads((path / TRAINER_STATE).read_text())
        return state


def _hash_of(path: Path) -> str | None:
    value = json.loads((path / TRAINER_STATE).read_text()).get("config_hash")
    return value if isinstance(value, str) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_dir)`, then move `tmp_dir` to `target`.

    A new `target` appears in one rename. An existing one is first renamed aside to
    `.old-<name>`, so a crash between the two renames leaves no `target` (the stage then has no
    result and reruns) but never a half-written one.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    _fsync_dir(tmp)
    if target.exists():
        old = target.parent / f".old-{target.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
