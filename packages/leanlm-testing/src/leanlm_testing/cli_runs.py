"""`leanlm` command-line runs in subprocesses, for the tests that stop, kill and resume them.

`ENV` is the environment they run in (one thread per process), `leanlm_command(...)` the
command, `run_leanlm(...)` a run to its end,
`start_two_process_run` a 2-process launch returned once its step-10 checkpoint exists, and
`loss_rows` / `assert_same_weights` what a resumed run must share with an uninterrupted one.
psutil and safetensors (leanlm's dependencies) are imported when used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
"""The environment of the runs: one thread per process (CI has 2 cores)."""


def leanlm_command(*args: object) -> list[str]:
    """The command `python -m leanlm ARGS`."""
    return [sys.executable, "-m", "leanlm", *map(str, args)]


def run_leanlm(*args: object, **run: Any) -> subprocess.CompletedProcess[str]:
    """`python -m leanlm ARGS` to its end (output captured as text, 300 s at most)."""
    options = {"capture_output": True, "text": True, "env": ENV, "timeout": 300, **run}
    return subprocess.run(leanlm_command(*args), check=False, **options)


def messages(err: str) -> list[str]:
    """The `leanlm: ...` lines of a run's stderr (its errors and reports)."""
    return [line for line in err.splitlines() if line.startswith("leanlm:")]


def start_two_process_run(
    path: Path, out: Path, **popen: Any
) -> tuple[subprocess.Popen[str], list[Any]]:
    """A started `leanlm run PATH --out OUT --processes 2` (stderr piped), and its processes.

    Returns once its step-10 checkpoint is written: the launcher's `Popen` and its process
    tree (launcher, torchrun, workers) as `psutil.Process`es.
    """
    import psutil  # type: ignore[import-untyped]

    popen.setdefault("env", ENV)
    launcher = subprocess.Popen(
        leanlm_command("run", path, "--out", out, "--processes", "2"),
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    target = out / "pretrain" / "checkpoints" / "step-00000010"
    deadline = time.monotonic() + 240
    while not target.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    root = psutil.Process(launcher.pid)
    return launcher, [root, *root.children(True)]


def loss_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The `pretrain` metrics rows of a run: step, loss, lr, grad_norm, val_loss."""
    text = (run_dir / "pretrain" / "metrics.jsonl").read_text()
    keep = ("step", "loss", "lr", "grad_norm", "val_loss")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, text.splitlines())]


def assert_same_weights(a_dir: Path, b_dir: Path) -> None:
    """The `pretrain` model folders of two runs hold bit-identical weights."""
    from safetensors.torch import load_file

    a, b = (load_file(d / "pretrain" / "model" / "model.safetensors") for d in (a_dir, b_dir))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after the resume"
