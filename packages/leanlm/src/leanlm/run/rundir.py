"""The run directory, checked before any work: one run at a time, usable, and safe to resume.

`preflight` runs in the process the user started, before any worker: an `--out` that is a file,
cannot be created or written, or sits on a nearly full disk; a directory that holds a run
(without `--resume`); a `--resume` whose config differs from the stored one (unless
`--restart-changed`); an `init_model` that is not a causal-LM folder with a tokenizer; a hub
model or dataset with no network and no cached copy (those two in `leanlm.run.inputs`, whose
checks stay importable from here). `leanlm.run.lock.RunLock` then keeps a second run out of the
directory while this one lives.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

from leanlm.config import RunConfig, to_dict
from leanlm.run.datafiles import Digests, changed_files, data_digests, data_fingerprint
from leanlm.run.inputs import check_hub_dataset, check_init_model, hub_reachable
from leanlm.run.lock import LOCK_FILE

__all__ = [
    "CONFIG_FILE",
    "DISK_ERRNOS",
    "MIN_FREE_MIB",
    "PROBE_PREFIX",
    "RUN_MARKER",
    "ConfigChangedError",
    "changed_keys",
    "check_hub_dataset",
    "check_init_model",
    "check_out_dir",
    "check_reuse",
    "discarded_stages",
    "disk_full",
    "foreign_entries",
    "holds_work",
    "hub_reachable",
    "mark_run_dir",
    "preflight",
    "stage_hash",
    "stored_processes",
]

CONFIG_FILE = "config.toml"
RUN_MARKER = ".leanlm-run"
"""Written into `--out` before anything else a run writes there: the folder is a leanlm run's,
so a later fresh run may replace its `config.toml` and stage folders (a start that failed
before its first checkpoint). leanlm deletes or overwrites nothing in a folder without it."""
PROBE_PREFIX = ".leanlm-write-test-"
MIN_FREE_MIB = 100
"""An `--out` on a disk with less free space than this is refused before the run starts."""
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})
"""`OSError`s that mean the disk, not the program, is at fault: reported in one line."""


class ConfigChangedError(ValueError):
    """`--resume` with a config that differs from the one the run was started with."""


def holds_work(out_dir: Path) -> bool:
    """Whether `out_dir` holds something a fresh run would destroy (a result or a checkpoint)."""
    if not out_dir.is_dir():
        return False
    return any(out_dir.glob("*/result.json")) or any(out_dir.glob("*/checkpoints/step-*"))


def mark_run_dir(out_dir: Path) -> None:
    """Record that `out_dir` is a leanlm run folder (`RUN_MARKER`); call before writing there."""
    (out_dir / RUN_MARKER).write_text("a leanlm run folder: config.toml and the stage folders\n")


def foreign_entries(out_dir: Path) -> list[str]:
    """What `out_dir` holds when it is not a leanlm run folder (no marker, no work).

    Names, sorted, a folder's with a trailing `/`. Empty for a run folder, an empty or missing
    one, or one holding only what a starting run makes itself (its lock, the write probes).
    """
    if not out_dir.is_dir():
        return []
    names = sorted(
        f"{p.name}/" if p.is_dir() else p.name
        for p in out_dir.iterdir()
        if p.name != LOCK_FILE and not p.name.startswith(PROBE_PREFIX)
    )
    # NOTE: after the listing: a run's main process writes the marker before any other file
    if not names or (out_dir / RUN_MARKER).exists() or holds_work(out_dir):
        return []
    return names


def stage_hash(
    config: RunConfig, stage: str, previous_hash: str, processes: int = 1, data: str = ""
) -> str:
    """Hash of what a stage's output depends on, run on `processes` processes.

    That is data (the `[data]` section and `data`, the `leanlm.run.datafiles.data_fingerprint`
    of the content of its files, or the revision of a hub dataset given by name), tokenizer,
    model, seed, precision, the stage's own section, and the previous stage's hash (so changing
    an early stage invalidates every later one). A training section's
    `grad_accum_steps` counts as `grad_accum_steps x processes`, the micro-batches of one
    optimizer step over all processes: the global batch is the same, and so are the stage's
    results and checkpoints, when a run resumes at another number of processes with
    `grad_accum_steps` scaled to keep that product (2 processes x 2 = 4 processes x 1).
    """
    section = getattr(config, stage)
    accum = getattr(section, "grad_accum_steps", None)
    if accum is not None and processes != 1:
        section = dataclasses.replace(section, grad_accum_steps=accum * processes)
        config = dataclasses.replace(config, **{stage: section})
    own = config.fingerprint(
        "seed", "mixed_precision", "init_model", "data", "tokenizer", "model", stage
    )
    return hashlib.sha256(f"{own}:{data}:{previous_hash}".encode()).hexdigest()[:16]


def _stored_hashes(stage_dir: Path) -> set[str]:
    """Config hashes of a stage's stored result and checkpoints (its work on disk)."""
    found = set()
    files = [stage_dir / "result.json", *stage_dir.glob("checkpoints/step-*/trainer_state.json")]
    for path in files:
        try:
            value = json.loads(path.read_text()).get("config_hash")
        except (OSError, ValueError):
            continue
        if isinstance(value, str):
            found.add(value)
    return found


def stored_processes(stage_dir: Path) -> int | None:
    """How many processes a stage's stored result, else its newest checkpoint, was made on."""
    files = [stage_dir / "result.json"]
    files += sorted(stage_dir.glob("checkpoints/step-*/trainer_state.json"), reverse=True)
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        value = data.get("processes", data.get("metrics", {}).get("processes"))
        if isinstance(value, int):
            return value
    return None


def discarded_stages(
    out_dir: Path, config: RunConfig, processes: int = 1, data: str = ""
) -> list[str]:
    """Stages of `config` whose stored work in `out_dir` was made under another config.

    Or on other data files (`data`: see `stage_hash`), or at a global batch that `processes`
    processes do not make.
    """
    stages, previous = [], ""
    for stage in config.stages:
        digest = stage_hash(config, stage, previous, processes, data)
        stored = _stored_hashes(out_dir / stage)
        if stored and digest not in stored:
            stages.append(stage)
        previous = digest
    return stages


def changed_keys(stored: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config mappings (missing counts as differing)."""
    keys: list[str] = []
    for key in sorted(stored.keys() | new.keys()):
        a, b = stored.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def check_reuse(
    out_dir: Path,
    config: RunConfig,
    *,
    resume: bool,
    restart_changed: bool = False,
    processes: int = 1,
    data: Digests | None = None,
) -> None:
    """Refuse to overwrite a run, and to resume one in a way that discards work.

    A config change that leaves every stored result and checkpoint valid (a stage appended,
    `name`, a stage that has not run yet) resumes; one that would restart a stage with work
    on disk needs `restart_changed`. So does a change of a data file's content, or of the
    revision of a hub dataset given by name (`data`: the run's
    `leanlm.run.datafiles.data_digests`, read here when not given), and a resume on another
    number of `processes` that changes a stored stage's global batch (see `stage_hash`).

    A folder that holds neither a run nor the `RUN_MARKER` of one must be empty, with or
    without `resume`: leanlm writes `config.toml` and the stage folders into `--out`, and
    never into files it did not create.

    Raises:
        FileExistsError: `out_dir` holds a run and `resume` is false, or holds files that are
            not a leanlm run's (named).
        ConfigChangedError: `resume` would discard the work of a stage (the changed keys and
            the stages are listed), unless `restart_changed`.
    """
    if not holds_work(out_dir):
        foreign = foreign_entries(out_dir)
        if foreign:
            shown = ", ".join(foreign[:5]) + (
                f" and {len(foreign) - 5} more" if foreign[5:] else ""
            )
            raise FileExistsError(
                f"--out {out_dir} is not empty and is not a leanlm run folder (it holds "
                f"{shown}); leanlm deletes or overwrites nothing it did not create: choose a new "
                "or empty --out (--resume continues only a leanlm run folder)"
            )
        return
    if not resume:
        raise FileExistsError(
            f"{out_dir} already holds a run: pass --resume to continue it, or start over with "
            f"`rm -r {out_dir}` (or another --out)"
        )
    if restart_changed:
        return
    data = data_digests(config, out_dir) if data is None else data
    stages = discarded_stages(out_dir, config, processes, data_fingerprint(data))
    if not stages:
        return
    stored_file = out_dir / CONFIG_FILE
    stored = tomllib.loads(stored_file.read_text("utf-8")) if stored_file.is_file() else {}
    keys = [f"`{k}`" for k in changed_keys(stored, to_dict(config))]
    keys += changed_files(out_dir, data)
    before = {n: stored_processes(out_dir / n) for n in stages}
    moved = {n: p for n, p in before.items() if p is not None and p != processes}
    if moved:
        runs = ", ".join(f"{n} ran on {p}" for n, p in moved.items())
        keys.append(
            f"the number of processes ({runs}, this run has {processes}: keep "
            "`grad_accum_steps` x processes as it was to keep the global batch)"
        )
    if not keys:  # same config and process count: the hash rule itself changed
        keys.append(
            "no key and not the number of processes (nor a recorded data file): the stored "
            "work was hashed by an earlier leanlm (before `grad_accum_steps` x processes, or "
            "the content of the data files, entered the stage hashes)"
        )
    raise ConfigChangedError(
        f"--resume: the config differs from the one {out_dir} was run with, in "
        f"{', '.join(keys)}; resuming would restart {', '.join(stages)} and discard the results "
        "and checkpoints there. Pass --restart-changed to do that, or restore the config"
    )


def check_out_dir(out_dir: Path) -> None:
    """`--out` must be a directory (or creatable), writable, on a disk with room.

    Raises:
        ValueError: naming `--out` and what is wrong.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a directory; choose another --out")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # one probe file per process: the workers of a launch run this check at the same time
        probe = out_dir / f"{PROBE_PREFIX}{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"--out {out_dir} is not writable: {err.strerror}") from None
    free_mib = shutil.disk_usage(out_dir).free / 2**20
    if free_mib < MIN_FREE_MIB:
        raise ValueError(
            f"--out {out_dir}: only {free_mib:.0f} MiB free on its disk (the run needs at least "
            f"{MIN_FREE_MIB} MiB); free some space or choose another --out"
        )


def disk_full(out_dir: Path) -> bool:
    """Whether the disk of `out_dir` has (almost) no space left (< 1 MiB)."""
    try:
        return shutil.disk_usage(out_dir).free < 2**20
    except OSError:
        return False


def preflight(
    config: RunConfig,
    out_dir: Path,
    *,
    resume: bool,
    restart_changed: bool = False,
    processes: int = 1,
) -> None:
    """Every check that needs no worker (see the module docstring); call before the run."""
    check_out_dir(out_dir)
    check_hub_dataset(config)  # first: `check_reuse` resolves a hub dataset's revision offline
    check_reuse(
        out_dir, config, resume=resume, restart_changed=restart_changed, processes=processes
    )
    if config.init_model:
        check_init_model(config.init_model)
        local = Path(config.init_model).expanduser() / "config.json"
        vocab = json.loads(local.read_text()).get("vocab_size") if local.is_file() else None
        if "distill" in config.stages and isinstance(vocab, int):
            config.distill.check_top_k(vocab, f"`vocab_size` of {local}")
