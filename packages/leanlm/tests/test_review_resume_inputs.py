"""Review findings on resumes whose inputs changed, and on what a run counts and keeps.

- a data file edited between a run and its `--resume` changes the stage hashes (named, refused
  without `--restart-changed`); only its content counts, not its modification time;
- a cached teacher's logits are rewritten when the teacher's stage is rerun;
- `control` counts the tokens of `distill`'s teacher correction;
- a validation split shorter than one window stops the run before any training;
- a stage that starts over drops the discarded run's TensorBoard events.
"""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

from leanlm.config import (
    ConfigError,
    ControlConfig,
    DistillConfig,
    PruneConfig,
)
from leanlm.run.datafiles import DATA_RECORD, data_fingerprint, file_digests
from leanlm.run.pipeline import run_pipeline
from leanlm.run.rundir import ConfigChangedError, holds_work, stage_hash
from leanlm.stages import StageResult


def _loss_steps(stage_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if "loss" in row]


def test_a_changed_data_file_changes_the_stage_hash_and_resume_names_it(
    files_config, tmp_path, capsys
):
    config = files_config(tmp_path / "data")
    out = tmp_path / "run"
    first = run_pipeline(config, out)[0]
    digests = file_digests(config.data)
    # a run killed after its step-2 checkpoint: only the checkpoint holds the stage's work
    (out / "pretrain" / "result.json").unlink()
    edited = Path(config.data.files[1])
    edited.write_text(edited.read_text() + "\n# one more line of training text\n")

    with pytest.raises(ConfigChangedError) as err:
        run_pipeline(config, out, resume=True)
    message = str(err.value)
    assert f"the content of `data.files` (changed: {edited})" in message
    assert "resuming would restart pretrain" in message
    assert "--restart-changed" in message
    assert json.loads((out / DATA_RECORD).read_text()) == digests  # nothing written
    assert first.config_hash == stage_hash(config, "pretrain", "", 1, data_fingerprint(digests))

    capsys.readouterr()
    again = run_pipeline(config, out, resume=True, restart_changed=True)[0]
    assert "resuming from" not in capsys.readouterr().out  # started over, not from step 2
    new_digests = file_digests(config.data)
    assert new_digests["data.files"][str(edited)] != digests["data.files"][str(edited)]
    new_hash = stage_hash(config, "pretrain", "", 1, data_fingerprint(new_digests))
    assert again.config_hash == new_hash != first.config_hash
    assert json.loads((out / DATA_RECORD).read_text()) == new_digests
    assert _loss_steps(out / "pretrain") == [1, 2, 3, 4]

    # the same bytes with a new modification time: the same data, so the stage is skipped
    stamp = os.stat(edited).st_mtime_ns + 10**9
    os.utime(edited, ns=(stamp, stamp))
    capsys.readouterr()
    assert run_pipeline(config, out, resume=True)[0] == again
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out


def _cached_distill_config(tiny_config, lr: float):
    distill = DistillConfig(
        teacher_stage="pretrain",
        teacher="cached",
        top_k=16,
        steps=2,
        micro_batch_size=4,
        warmup_steps=1,
        eval_every=2,
        eval_batch_size=4,
        checkpoint_every=0,
    )
    return dataclasses.replace(
        tiny_config(pretrain={"steps": 4, "warmup_steps": 1, "lr": lr, "checkpoint_every": 0}),
        stages=("pretrain", "prune", "distill"),
        prune=PruneConfig(hidden_size=16, intermediate_size=32, calibration_samples=8),
        distill=distill,
    )


def test_a_rerun_teacher_stage_has_its_cached_logits_written_again(tiny_config, tmp_path, capsys):
    from leanlm.train.model import load_model
    from leanlm.train.teacher_cache import CACHE_DIR, MANIFEST, CachedTeacher

    out = tmp_path / "run"
    run_pipeline(_cached_distill_config(tiny_config, 3e-3), out)
    cache = out / "distill" / CACHE_DIR
    before = json.loads((cache / MANIFEST).read_text())
    first_teacher = StageResult.load(out / "pretrain")
    assert first_teacher is not None

    capsys.readouterr()
    changed = _cached_distill_config(tiny_config, 1e-2)  # pretrain (the teacher) reruns
    run_pipeline(changed, out, resume=True, restart_changed=True)
    log = capsys.readouterr().out
    assert "(written)" in log
    assert "(reused)" not in log
    assert "made with another teacher (its stage was rerun, or its weights changed)" in log
    assert before["teacher"] == f"stage:{first_teacher.config_hash}"
    after = json.loads((cache / MANIFEST).read_text())
    new_teacher = StageResult.load(out / "pretrain")
    assert new_teacher is not None
    assert new_teacher.config_hash != first_teacher.config_hash
    assert after["teacher"] == f"stage:{new_teacher.config_hash}"
    assert after["fingerprint"] != before["fingerprint"]

    # the cached logits are the new teacher's
    from prune_distill.cache import TOPK_INDICES, TOPK_VALUES

    cached = CachedTeacher(cache)
    record = torch.load(cached.files[0], weights_only=True)
    teacher = load_model(out / "pretrain" / "model").eval()
    with torch.no_grad():
        logits = teacher(input_ids=record["input_ids"]).logits
    values, indices = torch.topk(logits, 16, dim=-1)
    torch.testing.assert_close(record[TOPK_VALUES], values, atol=1e-5, rtol=1e-5)
    assert torch.equal(record[TOPK_INDICES].long(), indices)


def test_control_counts_the_teacher_correction_tokens(prune_distill_config, tmp_path, capsys):
    config = prune_distill_config(teacher="online", teacher_correction_steps=3)
    config = dataclasses.replace(
        config,
        stages=("prune", "distill", "control"),
        control=ControlConfig(
            micro_batch_size=4,
            warmup_steps=1,
            eval_batch_size=4,
            checkpoint_every=0,
        ),
    )
    results = {r.stage: r.metrics for r in run_pipeline(config, tmp_path / "run")}
    correction = 3 * 4 * 1 * 32  # steps x (micro-batch x accumulation x processes) x seq_len
    prune, distill = results["prune"]["tokens"], results["distill"]["tokens"]
    assert results["control"]["target_tokens"] == prune + distill + correction
    assert results["distill"]["teacher_correction_tokens"] == correction
    log = capsys.readouterr().out
    total = prune + distill + correction
    assert (
        f"[control] the dense model trains on for {total:,} tokens "
        f"(prune {prune:,}, distill {distill + correction:,})"
    ) in log


def test_a_validation_split_shorter_than_one_window_stops_before_training(files_config, tmp_path):
    config = files_config(tmp_path / "data", validation_text="too short", checkpoint_every=1)
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        run_pipeline(config, out)
    assert err.value.key == "data.validation_files"
    val = config.data.validation_files[0]
    tokens = int(str(err.value).split("a token stream of ")[1].split()[0])
    assert 0 < tokens < 32
    assert str(err.value) == (
        f"config key `data.validation_files`: (['{val}']) gives a validation split too short to "
        f"score the stages on: a token stream of {tokens} tokens is shorter than one window of "
        "`data.seq_len` (32) tokens; use more data or a shorter seq_len"
    )
    assert not holds_work(out)  # no checkpoint: the corrected rerun is not blocked
    assert not (out / "pretrain").exists()


def test_a_stage_that_starts_over_drops_the_discarded_runs_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from leanlm.report.metrics import MetricsLog

    path = tmp_path / "pretrain" / "metrics.jsonl"

    def run(losses: list[float], resume_step: int = 0) -> None:
        log = MetricsLog(path, enabled=True, resume_step=resume_step)
        for step, loss in enumerate(losses, resume_step + 1):
            log.log({"step": step, "loss": loss})
        log.close()

    def points() -> list[tuple[int, float]]:
        board = EventAccumulator(str(path.parent / "tensorboard"))
        board.Reload()
        return [(e.step, round(e.value, 3)) for e in board.Scalars("loss")]

    run([5.0, 4.0, 3.0])  # the discarded run
    run([6.0, 5.5])  # started over (`--restart-changed`: resume_step 0)
    assert points() == [(1, 6.0), (2, 5.5)]
    # TensorBoard reads event files in name order: whole seconds, then a per-process counter
    # as a string ("...10" before "...9"); a resume is a later process (a later second) in a
    # run, so wait for the next second as it would
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)
    run([5.25], resume_step=2)  # a resume above step 0 keeps the steps up to it
    assert points() == [(1, 6.0), (2, 5.5), (3, 5.25)]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
