"""`[distill] teacher = "cached"`: the teacher's top-k logits written once, then no teacher.

With `top_k` = the vocabulary the cached distillation equals the online one; a resume reuses a
complete cache and rewrites a damaged one.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import leanlm.train.model
from leanlm.config import ConfigError, DistillConfig, dumps_toml
from leanlm.run.pipeline import run_pipeline
from leanlm.train.teacher_cache import CACHE_DIR, MANIFEST
from leanlm_testing.cli_runs import run_leanlm


def _config(prune_distill_config, **distill):
    settings = {
        "steps": 4,
        "grad_accum_steps": 2,
        "eval_every": 4,
        "checkpoint_every": 2,
        "temperature": 2.0,
        "lm_loss_weight": 0.25,
    }
    return prune_distill_config(**(settings | distill))


def _losses(out):
    rows = [
        json.loads(line) for line in (out / "distill" / "metrics.jsonl").read_text().splitlines()
    ]
    return [row["loss"] for row in rows if "loss" in row]


def _weights(out):
    return load_file(out / "distill" / "model" / "model.safetensors")


def test_cached_teacher_with_the_whole_vocabulary_equals_online(
    prune_distill_config, tmp_path, capsys
):
    run_pipeline(_config(prune_distill_config, teacher="online"), tmp_path / "online")
    loads = []
    original = leanlm.train.model.load_teacher

    def spy(path, **kwargs):
        loads.append(path)
        return original(path, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(leanlm.train.model, "load_teacher", spy)
        run_pipeline(_config(prune_distill_config, teacher="cached"), tmp_path / "cached")
    assert len(loads) == 1  # once, to write the cache
    log = capsys.readouterr().out
    cache = tmp_path / "cached" / "distill" / CACHE_DIR
    manifest = json.loads((cache / MANIFEST).read_text())
    assert manifest["top_k"] == 512  # top_k = 0: the whole vocabulary
    assert len(manifest["files"]) == 4 * 2  # steps x micro-batches per step, one process
    on_disk = sum(f.stat().st_size for f in cache.iterdir())
    assert f"{on_disk / 2**20:.1f} MiB on disk" in log
    assert "(written)" in log
    result = json.loads((tmp_path / "cached" / "distill" / "result.json").read_text())
    assert result["metrics"]["teacher_cache_bytes"] == on_disk

    online, cached = _losses(tmp_path / "online"), _losses(tmp_path / "cached")
    assert len(online) == 4
    torch.testing.assert_close(cached, online, atol=1e-5, rtol=1e-5)
    a, b = _weights(tmp_path / "online"), _weights(tmp_path / "cached")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4, msg=name)


def test_resume_reuses_the_cache_and_rewrites_a_damaged_one(prune_distill_config, tmp_path, capsys):
    config = _config(prune_distill_config, teacher="cached", top_k=16)
    out = tmp_path / "run"
    run_pipeline(config, out)
    expected = _weights(out)
    cache = out / "distill" / CACHE_DIR
    mtimes = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert json.loads((cache / MANIFEST).read_text())["top_k"] == 16

    def interrupt_distill():  # as if stopped after its step-2 checkpoint
        shutil.rmtree(out / "distill" / "model")
        (out / "distill" / "result.json").unlink()
        shutil.rmtree(out / "distill" / "checkpoints" / "step-00000004", ignore_errors=True)
        capsys.readouterr()

    interrupt_distill()
    run_pipeline(config, out, resume=True)
    log = capsys.readouterr().out
    assert "(reused)" in log
    assert "resuming from step-00000002" in log
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == mtimes
    for name, value in _weights(out).items():
        assert torch.equal(value, expected[name]), name

    interrupt_distill()
    first = sorted(cache.glob("*.pt"))[0]
    first.write_bytes(first.read_bytes()[:100])  # a damaged (truncated) file
    run_pipeline(config, out, resume=True)
    log = capsys.readouterr().out
    assert f"{first.name} is missing or not" in log
    assert "writing it again" in log
    assert "(written)" in log
    for name, value in _weights(out).items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize(
    ("key", "value"), [("hidden_loss_weight", 1.0), ("teacher_correction_steps", 2)]
)
def test_a_cached_teacher_rejects_what_needs_the_teacher_model(key, value):
    with pytest.raises(ConfigError, match=f"`distill.{key}`|`{key}`"):
        DistillConfig(teacher="cached", **{key: value})


@pytest.mark.distributed
def test_two_processes_share_one_cache_and_train_like_one(prune_distill_config, tmp_path):
    # the main process writes the cache, the other waits; both train from it, like one process
    # with the same global batch (2 x 4 sequences per step, or 1 process x 4 x 2 micro-batches)
    one = _config(prune_distill_config, teacher="cached", top_k=16, checkpoint_every=0)
    two = dataclasses.replace(one, distill=dataclasses.replace(one.distill, grad_accum_steps=1))
    run_pipeline(one, tmp_path / "one")
    (tmp_path / "two.toml").write_text(dumps_toml(two))
    done = run_leanlm("run", tmp_path / "two.toml", "--out", tmp_path / "two", "--processes", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("(written)") == 1
    manifest = json.loads((tmp_path / "two" / "distill" / CACHE_DIR / MANIFEST).read_text())
    assert len(manifest["files"]) == 4 * 2  # steps x processes, one micro-batch each
    torch.testing.assert_close(
        _losses(tmp_path / "two"), _losses(tmp_path / "one"), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("teacher", ["online", "cached"])
def test_top_k_above_the_vocabulary_is_refused_naming_the_key(
    prune_distill_config, tmp_path, capsys, teacher
):
    """The online teacher crashed at the first step in `torch.topk` (no key named); the cached
    one silently distilled on the whole vocabulary instead."""
    from leanlm.cli import main
    from leanlm_testing.cli_runs import messages

    config = dataclasses.replace(
        prune_distill_config(teacher=teacher, top_k=513), stages=("distill",)
    )
    says = "config key `distill.top_k`: (513) must be <= the vocabulary (512 tokens, {}); 0 "
    says += "distills on the whole vocabulary"
    # Python: in the stage, from the student, before any teacher pass or cache
    with pytest.raises(ConfigError) as info:
        run_pipeline(config, tmp_path / "run")
    assert str(info.value) == says.format("the student's")
    assert not (tmp_path / "run" / "distill" / CACHE_DIR).exists()
    assert not (tmp_path / "run" / "distill" / "metrics.jsonl").exists()
    # `leanlm run`: before any work, from `init_model`'s config.json
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(config))
    assert main(["run", str(path), "--out", str(tmp_path / "cli")]) == 2
    local = f"`vocab_size` of {config.init_model}/config.json"
    assert messages(capsys.readouterr().err) == [f"leanlm: error: {says.format(local)}"]
    assert list((tmp_path / "cli").iterdir()) == []
