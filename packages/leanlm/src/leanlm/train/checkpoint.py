"""Atomic training checkpoints and atomic model folders.

A training checkpoint (`accelerator.save_state`, the scheduler, `trainer_state.json`) is written
into a hidden temporary folder and renamed to `step-XXXXXXXX` only when complete, so a run killed
at any moment leaves a whole checkpoint or none. Each lists the SHA-256 of its files
(`checksums.json`); `latest` moves a damaged one aside and falls back to the newest intact one.
The step number is the whole data position (a step's batch is a function of the step; a stream
saves its position too). Engines accelerate does not know add their own folder (`zero/`, `fsdp2/`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state

if TYPE_CHECKING:
    from leanlm.stages.base import StageContext

_STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"


class _NoSharedTensorNotice(logging.Filter):
    """Drops accelerate's "Removed shared tensor" warning.

    It comes at every save of a model with tied embeddings: accelerate stores the tied weight
    once, and loading ties it again (resumed runs are bit-identical), so nothing is wrong.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


logging.getLogger("accelerate.utils.other").addFilter(_NoSharedTensorNotice())
SHARDED_DIRS = ("zero", "fsdp2")
"""The folders a sharding engine adds to a checkpoint (`ShardedState.folder`)."""


class ShardedState(Protocol):
    """The model and optimizer state of an engine that shards them (`leanlm.train.engines`)."""

    folder: str
    """Its folder inside a checkpoint."""

    def save(self, path: Path) -> None:
        """Write this process's shards under `path` (a collective)."""
        ...

    def load(self, path: Path) -> None:
        """Read them back into the live model and optimizer (a collective)."""
        ...


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
        """The newest intact checkpoint (written under `config_hash`, if given), or `None`.

        Damaged checkpoints met on the way (a file missing, truncated or changed since it was
        written) are named in the log and moved aside (`.damaged-step-XXXXXXXX`) by the main
        process. Every process must call this.
        """
        found = None
        for path in reversed(self.complete()):
            problem = verify(path)
            if problem is not None:
                self._set_aside(path, problem)
            elif config_hash is None or _hash_of(path) == config_hash:
                found = path
                break
        self.accelerator.wait_for_everyone()
        return found

    def _set_aside(self, path: Path, problem: str) -> None:
        aside = path.with_name(f".damaged-{path.name}")
        self.accelerator.print(
            f"[leanlm] checkpoint {path} is damaged ({problem}); moved it to {aside.name} and "
            "falling back to the one before"
        )
        if self.accelerator.is_main_process:
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)

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
        sharded: ShardedState | None = None,
        whole: ShardedState | None = None,
    ) -> Path:
        """Write the checkpoint of `step` atomically; every process must call this.

        `sharded` is the model and optimizer state of a sharding engine. `whole` is a sharding
        engine's format over an unsharded model (one process): it replaces accelerate's model
        and optimizer files, next to the RNG state. Half-written folders of a killed run
        (`.tmp-step-*`) are deleted first.
        """
        acc = self.accelerator
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if acc.is_main_process:
            for stale in self.directory.glob(".tmp-step-*"):  # left by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if whole is not None:
            save_accelerator_state(str(tmp), [], [], [], [], acc.process_index, acc.step)
            with warnings.catch_warnings():  # DCP: "... assuming ... a single process" (it is)
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                whole.save(tmp / whole.folder)
        else:
            acc.save_state(str(tmp))  # prepared model and optimizer, per-process RNG states
        if sharded is not None:
            sharded.save(tmp / sharded.folder)
        acc.wait_for_everyone()
        if acc.is_main_process:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            _write_json(tmp / TRAINER_STATE, {"step": step, **state})
            _write_json(tmp / CHECKSUMS, _checksums(tmp))
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def load(
        self,
        path: Path,
        scheduler: Any,
        *,
        sharded: ShardedState | None = None,
        whole: ShardedState | None = None,
    ) -> dict[str, Any]:
        """Restore prepared objects, RNG and `scheduler` from `path`; returns the trainer state.

        `whole` (see `save`) reads the engine's folder, written by any number of processes,
        into the unsharded model and optimizer; the RNG states are then restored alone. A
        checkpoint without that folder (accelerate's files) loads as one of an unsharded run.

        Raises:
            ValueError: the checkpoint was written by another engine than this run's.
        """
        written = sorted(e for e in SHARDED_DIRS if (path / e).is_dir())
        if whole is not None and not written:
            whole = None  # written unsharded (by an earlier leanlm): accelerate's own files
        mine = [s.folder for s in (sharded, whole) if s is not None]
        if written != mine:
            processes = json.loads((path / TRAINER_STATE).read_text()).get("processes", "?")
            raise ValueError(
                f"{path} was written {f'with {written[0]}' if written else 'without'} sharding "
                f"on {processes} process(es), but this run is "
                f"{f'sharded with {mine[0]}' if mine else 'not sharded'}: resume with the "
                "engine it was written with"
            )
        if whole is not None:
            with warnings.catch_warnings():  # DCP: "... assuming ... a single process" (it is)
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                whole.load(path / whole.folder)
            acc = self.accelerator
            load_accelerator_state(str(path), [], [], [], [], process_index=acc.process_index)
        else:
            self.accelerator.load_state(str(path))
        if sharded is not None:
            sharded.load(path / sharded.folder)
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        state: dict[str, Any] = json.loads((path / TRAINER_STATE).read_text())
        return state


def _hash_of(path: Path) -> str | None:
    try:
        value = json.loads((path / TRAINER_STATE).read_text()).get("config_hash")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def _checksums(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under `folder` (but `CHECKSUMS`), by relative path."""
    sums = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            with open(path, "rb") as f:
                sums[path.relative_to(folder).as_posix()] = hashlib.file_digest(
                    f, "sha256"
                ).hexdigest()
    return sums


def verify(path: Path) -> str | None:
    """What is wrong with the checkpoint `path` (a missing or changed file), or `None`."""
    try:
        expected = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return f"{CHECKSUMS} missing or unreadable"
    actual = _checksums(path)
    for name, digest in expected.items():
        if name not in actual:
            return f"{name} is missing"
        if actual[name] != digest:
            return f"{name} does not match its checksum"
    return None


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
    from transformers.utils import logging as hf_logging

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for one local file
    try:
        write(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _fsync_dir(tmp)
    if target.exists():
        old = target.parent / f".old-{target.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def save_model_folder(ctx: StageContext, save_model: Callable[[Path], None]) -> None:
    """Write the stage's model folder: `save_model(folder)`, then the run's tokenizer.

    The main process writes it with `save_atomically`; every process waits until it is there.
    """
    acc = ctx.accelerator
    if acc.is_main_process:
        tokenizer = ctx.resources.tokenizer

        def write(folder: Path) -> None:
            save_model(folder)
            tokenizer.save_pretrained(folder)

        save_atomically(ctx.model_dir, write)
    acc.wait_for_everyone()
