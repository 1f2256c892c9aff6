"""A run killed with SIGKILL and resumed ends bit-identical to an uninterrupted run (CPU, fp32)."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import DistillConfig, PruneConfig, SparsifyConfig, dumps_toml


def _leanlm(*args, **kwargs):
    return [sys.executable, "-m", "leanlm", *map(str, args)]


def _loss_rows(run_dir):
    rows = [
        json.loads(line)
        for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    keep = ("step", "loss", "lr", "grad_norm", "val_loss")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def _kill_after(path, out, target):
    """Run `leanlm run path --out out` and SIGKILL it as soon as `target` exists."""
    proc = subprocess.Popen(
        _leanlm("run", path, "--out", out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while not target.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert target.exists(), "the run ended before the checkpoint; cannot test the kill"


def _resume(path, out):
    done = subprocess.run(
        _leanlm("run", path, "--out", out, "--resume"),
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr


def _assert_same_weights(a_dir, b_dir):
    a = load_file(a_dir / "model" / "model.safetensors")
    b = load_file(b_dir / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{b_dir.name}: {name} differs after resume"


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, tiny_config):
    config = tiny_config(pretrain={"steps": 60, "checkpoint_every": 10, "eval_every": 40})
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(config))
    full, killed = tmp_path / "full", tmp_path / "killed"

    subprocess.run(
        _leanlm("run", path, "--out", full), check=True, capture_output=True, timeout=300
    )

    _kill_after(path, killed, killed / "pretrain" / "checkpoints" / "step-00000020")
    assert not (killed / "pretrain" / "result.json").exists(), "the run finished before the kill"

    assert "resuming from step-000000" in _resume(path, killed)
    _assert_same_weights(full / "pretrain", killed / "pretrain")
    assert _loss_rows(full) == _loss_rows(killed)
    assert not list((killed / "pretrain" / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("stage", ["distill", "sparsify"])
def test_sigkill_in_a_later_stage_then_resume_equals_uninterrupted(tmp_path, tiny_config, stage):
    # The kill lands in `stage` (after the earlier stages finished): resuming skips the finished
    # stages (same hashes) and continues `stage` from its checkpoint; for `sparsify` the masks
    # are rebuilt from the same calibration batches before the checkpoint restores the weights.
    train = {"steps": 60, "checkpoint_every": 10, "eval_every": 40, "micro_batch_size": 4}
    train |= {"warmup_steps": 4, "eval_batch_size": 4}
    config = tiny_config(
        stages=("pretrain", "prune", stage) if stage == "distill" else ("pretrain", stage),
        pretrain={"steps": 20, "checkpoint_every": 0},
        prune=PruneConfig(hidden_size=24, intermediate_size=48, calibration_samples=8),
        distill=DistillConfig(**train),
        sparsify=SparsifyConfig(**train, calibration_samples=8),
    )
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(config))
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(
        _leanlm("run", path, "--out", full), check=True, capture_output=True, timeout=300
    )
    _kill_after(path, killed, killed / stage / "checkpoints" / "step-00000020")
    assert not (killed / stage / "result.json").exists(), "the stage finished before the kill"
    finished_before = (killed / "pretrain" / "result.json").read_text()

    log = _resume(path, killed)
    assert "pretrain: finished earlier with the same config, skipped" in log
    assert f"[{stage}] resuming from step-000000" in log
    assert (killed / "pretrain" / "result.json").read_text() == finished_before
    _assert_same_weights(full / stage, killed / stage)
