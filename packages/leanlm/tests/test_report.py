"""Console progress, per-stage peak memory and the `control` stage's config rules."""

import io

import pytest

from leanlm.config import ConfigError, ControlConfig
from leanlm.run import pipeline
from leanlm.train.progress import Progress


def test_progress_prints_plain_lines_with_tokens_per_s_when_not_a_terminal():
    out = io.StringIO()  # not a terminal
    bar = Progress("pretrain", total=5, initial=0, enabled=True, stream=out, interval_s=3600)
    for step in range(1, 6):
        logged = step % 2 == 0 or step == 5  # as with log_every = 2
        loss, speed = (4.0 - step / 10, 1000.0 * step) if logged else (None, None)
        bar.update(step, loss=loss, tokens_per_s=speed)
    bar.write("[pretrain] step 5: validation loss 3.5000, perplexity 33.12")
    bar.close()
    lines = out.getvalue().splitlines()
    # the first logged step, then nothing for an hour, then the last step; no carriage returns
    assert lines == [
        "[pretrain] step 2/5, loss 3.800, tokens/s 2,000",
        "[pretrain] step 5/5, loss 3.500, tokens/s 5,000",
        "[pretrain] step 5: validation loss 3.5000, perplexity 33.12",
    ]
    assert "\r" not in out.getvalue()


def test_progress_is_silent_on_other_processes():
    out = io.StringIO()
    bar = Progress("x", total=2, initial=0, enabled=False, stream=out)
    bar.update(1, loss=1.0, tokens_per_s=1.0)
    bar.write("hello")
    assert out.getvalue() == ""


def test_peak_memory_is_reset_and_read_per_stage(tmp_path, tiny_config, monkeypatch):
    # A fake memory meter: each reset starts a new window whose peak is 100 x its number, so a
    # stage reports its own window's peak only if the pipeline resets before and reads after it.
    windows = []
    monkeypatch.setattr(pipeline, "reset_peak_memory", windows.append)
    monkeypatch.setattr(pipeline, "peak_memory_mib", lambda device: 100.0 * len(windows))
    from leanlm.config import PruneConfig

    config = tiny_config(
        stages=("pretrain", "prune"),
        prune=PruneConfig(hidden_size=16, intermediate_size=32, calibration_samples=8),
    )
    pre, pruned = pipeline.run_pipeline(config, tmp_path / "run")
    assert len(windows) == 2
    assert pre.metrics["peak_rss_mib"] == 100.0
    assert pruned.metrics["peak_rss_mib"] == 200.0


def test_control_must_come_last(tiny_config):
    with pytest.raises(ConfigError, match="'control' must be the last stage"):
        tiny_config(stages=("pretrain", "control", "prune"))
    with pytest.raises(ConfigError, match="'control' must be the last stage"):
        tiny_config(stages=("control",), init_model="x")
    with pytest.raises(ConfigError, match="after the compression stages"):
        tiny_config(stages=("pretrain", "control"))


def test_control_steps_are_computed_so_its_warmup_is_not_checked_against_them():
    cfg = ControlConfig(warmup_steps=50)  # `steps` (1) is not read
    assert cfg.warmup_steps == 50
    with pytest.raises(ConfigError, match="lr"):
        ControlConfig(lr=0)


def test_progress_bar_on_a_terminal_shows_tokens_per_s():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    bar = Progress("distill", total=3, initial=0, enabled=True, stream=out)
    for step in range(1, 4):
        bar.update(step, loss=1.5, tokens_per_s=2500.0)
    bar.close()
    text = out.getvalue()
    assert "\r" in text  # a bar, redrawn in place
    assert "3/3" in text
    assert "tokens/s=2,500" in text
    assert "loss=1.500" in text
