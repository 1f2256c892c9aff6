import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leanlm.config import dumps_toml
from leanlm.run.pipeline import run_pipeline
from leanlm.run.rundir import ConfigChangedError
from leanlm.stages import StageResult


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_config):
    import dataclasses

    config = tiny_config(
        pretrain={
            "steps": 30,
            "grad_accum_steps": 2,
            "warmup_steps": 3,
            "eval_every": 10,
            "checkpoint_every": 10,
        }
    )
    out = tmp_path_factory.mktemp("run")
    results = run_pipeline(config, out)
    return dataclasses.replace(config), out, results


def test_outputs_and_report(finished_run):
    config, out, results = finished_run
    assert [r.stage for r in results] == ["pretrain"]
    metrics = results[0].metrics
    assert metrics["tokens"] == 30 * 4 * 2 * 32
    assert metrics["params"] > 20_000
    assert metrics["val_perplexity"] < 512  # better than uniform over the vocabulary
    report = (out / "report.md").read_text()
    assert "| pretrain |" in report
    assert "val perplexity" in report
    assert "\n\n\n" not in report  # no empty block (no lm-eval tasks: no tasks note)
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "config.toml").read_text() == dumps_toml(config)
    rows = [
        json.loads(line) for line in (out / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert list((out / "pretrain" / "tensorboard").iterdir())
    # Checkpoints at steps 10 and 20 (none at the final step: the model folder is the output).
    names = sorted(p.name for p in (out / "pretrain" / "checkpoints").iterdir())
    assert names == ["step-00000010", "step-00000020"]


def test_loss_decreases(finished_run):
    _, out, _ = finished_run
    rows = [
        json.loads(line) for line in (out / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    # Observed with the default optimizer (CAME, 30 steps, warmup 3): mean of the first five
    # steps 6.24, of the last five 5.78 nats/token. Asserted: a drop of at least 0.3.
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


def test_stage_output_reloads_with_auto_classes(finished_run):
    _, out, results = finished_run
    assert results[0].model_dir == "pretrain/model"  # relative: the run folder can move
    folder = out / results[0].model_dir
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("def main():\n    return 0\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert model.config.num_key_value_heads == 2
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_existing_run_needs_resume(finished_run):
    config, out, _ = finished_run
    with pytest.raises(FileExistsError, match="pass --resume"):
        run_pipeline(config, out)


def test_resume_skips_a_finished_stage(finished_run):
    config, out, results = finished_run
    stamp = (out / "pretrain" / "model" / "model.safetensors").stat().st_mtime_ns
    again = run_pipeline(config, out, resume=True)
    assert again == results
    assert (out / "pretrain" / "model" / "model.safetensors").stat().st_mtime_ns == stamp
    assert StageResult.load(out / "pretrain") == results[0]


def test_a_finished_stage_stays_valid_at_another_process_count_with_the_same_global_batch(
    finished_run,
):
    import dataclasses

    from leanlm.run.rundir import check_reuse

    config, out, _ = finished_run  # 1 process x 2 micro-batches per step
    halved = dataclasses.replace(
        config, pretrain=dataclasses.replace(config.pretrain, grad_accum_steps=1)
    )
    check_reuse(out, halved, resume=True, processes=2)  # 2 processes x 1: the same batch
    with pytest.raises(ConfigChangedError) as err:
        check_reuse(out, config, resume=True, processes=2)  # 2 x 2: twice the batch
    message = str(err.value)
    assert "pretrain ran on 1, this run has 2" in message
    assert "`grad_accum_steps` x processes" in message
    assert "--restart-changed" in message
    with pytest.raises(ConfigChangedError, match=r"`pretrain.grad_accum_steps`"):
        check_reuse(out, halved, resume=True, processes=1)  # a real change on 1 process


def test_stored_work_under_another_hash_rule_is_named_as_such(tmp_path, finished_run):
    import shutil

    from leanlm.run.rundir import check_reuse

    config, out, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    stage = copy / "pretrain"
    for path in [stage / "result.json", *stage.glob("checkpoints/*/trainer_state.json")]:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "config_hash": "0" * 16}))  # an older rule's hash
    with pytest.raises(ConfigChangedError, match=r"no key and not the number of processes"):
        check_reuse(copy, config, resume=True)


def test_a_one_process_checkpoint_in_a_sharded_run_names_both(tmp_path):
    from types import SimpleNamespace

    from leanlm.train.checkpoint import TRAINER_STATE, Checkpointer

    step = tmp_path / "step-00000004"  # written by one process: unsharded (DDP's format)
    step.mkdir()
    (step / TRAINER_STATE).write_text(json.dumps({"step": 4, "processes": 1}))
    checkpoints = Checkpointer(tmp_path, accelerator=None, keep=1)  # refused before any load
    with pytest.raises(
        ValueError,
        match=r"without sharding on 1 process\(es\), but this run is sharded with fsdp2: "
        r"resume with the engine it was written with",
    ):
        checkpoints.load(step, scheduler=None, sharded=SimpleNamespace(folder="fsdp2"))


def test_pretrain_with_adafactor(tmp_path, tiny_config):
    config = tiny_config(pretrain={"optimizer": "adafactor", "lr": 1e-2, "steps": 20})
    results = run_pipeline(config, tmp_path / "run")
    rows = [
        json.loads(line)
        for line in (tmp_path / "run" / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    assert results[0].metrics["val_perplexity"] < 512
    # The checkpoint holds Adafactor's factored state (row/col statistics), not AdamW's.
    state = torch.load(
        tmp_path / "run" / "pretrain" / "checkpoints" / "step-00000018" / "optimizer.bin",
        weights_only=False,
    )
    shapes = {
        tuple(p.shape)
        for p in AutoModelForCausalLM.from_pretrained(
            tmp_path / "run" / "pretrain" / "model"
        ).parameters()
        if p.ndim == 2
    }
    matrices = [s for s in state["state"].values() if "exp_avg_sq_row" in s]
    assert matrices
    assert all("exp_avg" not in s for s in state["state"].values())  # no first moment (beta1=None)
    for s in matrices:  # factored: one statistic per row and per column, not per element
        assert (s["exp_avg_sq_row"].numel(), s["exp_avg_sq_col"].numel()) in shapes


def test_resume_after_a_config_change_reruns_the_stage(tmp_path, tiny_config):
    first = tiny_config(pretrain={"steps": 12})
    out = tmp_path / "run"
    before = run_pipeline(first, out)[0]
    changed = tiny_config(pretrain={"steps": 14})
    with pytest.raises(ConfigChangedError, match=r"`pretrain.steps`.*--restart-changed"):
        run_pipeline(changed, out, resume=True)
    after = run_pipeline(changed, out, resume=True, restart_changed=True)[0]
    assert after.config_hash != before.config_hash
    assert after.metrics["tokens"] == 14 * 4 * 32  # trained from step 0, not from a checkpoint
    names = sorted(p.name for p in (out / "pretrain" / "checkpoints").iterdir())
    assert names == ["step-00000006", "step-00000012"]  # the new run's, old ones dropped
    rows = (out / "pretrain" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows if '"loss"' in r] == list(range(1, 15))


def test_pretrain_with_came_int8_state(tmp_path, tiny_config):
    """`state_dtype = "int8"`: CAME keeps 8-bit codes and block scales, and trains as fp32 does."""
    losses = {}
    for dtype in ("fp32", "int8"):
        section = {"optimizer": "came", "state_dtype": dtype, "lr": 1e-2, "steps": 20}
        run_pipeline(tiny_config(pretrain=section), tmp_path / dtype)
        rows = (tmp_path / dtype / "pretrain" / "metrics.jsonl").read_text().splitlines()
        losses[dtype] = [r["loss"] for r in map(json.loads, rows) if "loss" in r]
    first, last = sum(losses["int8"][:4]) / 4, sum(losses["int8"][-4:]) / 4
    assert last < first - 0.3, losses
    assert abs(last - sum(losses["fp32"][-4:]) / 4) < 0.05, losses
    assert losses["int8"] != losses["fp32"]  # the state really is another one
    state = torch.load(
        tmp_path / "int8" / "pretrain" / "checkpoints" / "step-00000018" / "optimizer.bin",
        weights_only=False,
    )
    matrices = [s for s in state["state"].values() if "exp_avg_sq_row" in s]
    assert matrices
    for s in matrices:  # one int8 code per element, one fp32 scale per 128 elements of a row
        assert s["exp_avg"].dtype == torch.int8
        assert s["exp_avg_scale"].dtype == torch.float32
        rows_, cols = s["exp_avg"].shape
        assert tuple(s["exp_avg_scale"].shape) == (rows_, -(-cols // 128))
        assert s["exp_avg"].abs().max() == 127  # each block's absmax is coded exactly


def test_logged_lr_is_the_lr_each_step_applied(tmp_path, tiny_config, monkeypatch):
    """metrics.jsonl gave each step the lr of the step after it (the scheduler had moved)."""
    applied = []
    adamw_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        applied.append(self.param_groups[0]["lr"])
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    section = {"optimizer": "adamw", "steps": 5, "warmup_steps": 2, "lr": 1e-2}
    section |= {"min_lr_ratio": 0.1, "eval_every": 5, "checkpoint_every": 0}
    run_pipeline(tiny_config(pretrain=section), tmp_path / "run")
    rows = (tmp_path / "run" / "pretrain" / "metrics.jsonl").read_text().splitlines()
    logged = [(r["step"], r["lr"]) for r in map(json.loads, rows) if "lr" in r]
    assert logged == list(enumerate(applied, start=1))
    # transformers' warmup + cosine: step s (from 0) at lr x s / 2, then cosine from lr over
    # the 3 steps left toward lr x 0.1 (reached after the last step)
    assert applied == pytest.approx([0.0, 5e-3, 1e-2, 7.75e-3, 3.25e-3], rel=1e-12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast runs on CUDA")
def test_fp16_without_cuda_is_refused_before_any_work(tmp_path, tiny_config):
    """accelerate skips fp16 on the CPU without a word: the run trained in fp32 as "fp16"."""
    from leanlm.config import ConfigError

    with pytest.raises(ConfigError) as info:
        run_pipeline(tiny_config(mixed_precision="fp16"), tmp_path / "run")
    assert info.value.key == "mixed_precision"
    assert info.value.message.startswith("('fp16') needs a CUDA GPU, and this machine has none")
    assert not (tmp_path / "run").exists()
