"""NaN/inf losses are skipped and counted; past the limit the stage stops with a checkpoint."""

import json

import pytest
import torch

import leanlm.train.evaluate
from leanlm.cli import main
from leanlm.config import dumps_toml
from leanlm.run.pipeline import run_pipeline
from leanlm.train.trainer import TrainingDivergedError, causal_lm_loss, skip_scaled_step


def _poison(monkeypatch, bad_calls):
    """Make the pretrain loss NaN on the given (1-based) calls."""
    calls = {"n": 0}

    def loss_fn(model, input_ids):
        calls["n"] += 1
        loss = causal_lm_loss(model, input_ids)
        return loss * float("nan") if calls["n"] in bad_calls else loss

    monkeypatch.setattr(leanlm.train.evaluate, "causal_lm_loss", loss_fn)


def _rows(run_dir):
    text = (run_dir / "pretrain" / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_nan_steps_are_skipped_and_counted(tmp_path, tiny_config, monkeypatch):
    config = tiny_config(pretrain={"steps": 8, "max_bad_steps": 3, "checkpoint_every": 0})
    _poison(monkeypatch, {3, 5})
    (result,) = run_pipeline(config, tmp_path / "run")
    assert result.metrics["bad_steps"] == 2
    assert torch.isfinite(torch.tensor(result.metrics["val_loss"]))
    rows = [r for r in _rows(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["bad_steps"] == 2
    # the skipped steps did not touch the weights: everything after them stays finite
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["step"] not in (3, 5))


def test_too_many_nan_steps_stop_with_a_checkpoint(tmp_path, tiny_config, monkeypatch):
    config = tiny_config(pretrain={"steps": 12, "max_bad_steps": 2})
    _poison(monkeypatch, set(range(4, 100)))
    with pytest.raises(
        TrainingDivergedError, match=r"NaN/inf on 3 steps.*`pretrain.max_bad_steps` \(2\)"
    ):
        run_pipeline(config, tmp_path / "run")
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "pretrain" / "checkpoints").iterdir())
    assert checkpoints[-1] == "step-00000006"  # 3 good steps, then the 3rd bad one stopped it
    assert not (tmp_path / "run" / "pretrain" / "result.json").exists()


def test_cli_reports_divergence(tmp_path, tiny_config, monkeypatch, capsys):
    config = tiny_config(pretrain={"steps": 12, "max_bad_steps": 0})
    (tmp_path / "c.toml").write_text(dumps_toml(config))
    _poison(monkeypatch, {2})
    assert main(["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run")]) == 2
    assert "max_bad_steps" in capsys.readouterr().err


def test_a_skipped_step_resets_the_fp16_loss_scaler():
    """fp16 (CUDA, DDP): `clip` unscales, a skipped step never reaches `scaler.step`/`update`.

    The scaler must still hear of it, or the next step's `unscale_` raises and the scale never
    drops. torch's CPU GradScaler has the same bookkeeping as accelerate's CUDA one.
    """
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for _ in range(2):  # two overflowing steps in a row, each skipped by the trainer
        scaler.scale(param.sum() * float("inf")).backward()
        scaler.unscale_(opt)  # what accelerate's clip_grad_norm_ does first
        assert not torch.isfinite(param.grad).all()
        skip_scaled_step(scaler)
        opt.zero_grad(set_to_none=True)
    assert scaler.get_scale() == 2.0**14  # halved twice, as two overflows would
    assert torch.equal(param.detach(), torch.ones(3))  # nothing stepped
    # and a finite step then goes through the scaler as usual
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(param.detach(), torch.full((3,), 0.9))
    skip_scaled_step(None)  # no scaler (fp32, bf16): nothing to do
