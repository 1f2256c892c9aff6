"""Two gloo processes (torchrun -> accelerate) train like one process with the same global batch.

Replicated (DDP) and sharded with shard-zero (ZeRO-2 with CAME, ZeRO-3 with Adafactor: the
factored optimizers stay exact because shards are whole rows; ZeRO-3 with the accumulator in
host memory). The prune stage's architecture search on two processes saves what one saves. A
two-process run resumes on three processes with the same global batch (DDP, ZeRO-3, FSDP2).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import dumps_toml


def _leanlm_run(tmp_path, name, config, *, processes, out=None, resume=False, fails=False):
    """`leanlm run` of `config` into `out` (`tmp_path / name`) on `processes` (torchrun); its
    output. `fails`: the run must stop with a user error (exit status 2) instead; it goes
    through `--processes`, whose launcher checks the run folder before starting workers."""
    (tmp_path / f"{name}.toml").write_text(dumps_toml(config))
    command = [sys.executable, "-m", "leanlm"]
    if processes > 1 and not fails:
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
        command = [torchrun, "--standalone", "--nproc_per_node", str(processes), "-m", "leanlm"]
    command += ["run", str(tmp_path / f"{name}.toml"), "--out", str(out or tmp_path / name)]
    command += ["--resume"] if resume else []
    command += ["--processes", str(processes)] if fails else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == (2 if fails else 0), done.stderr[-3000:]
    return done.stdout + done.stderr


def _losses(run_dir):
    rows = [
        json.loads(line)
        for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
    ]
    return torch.tensor([r["loss"] for r in rows if "loss" in r], dtype=torch.float64)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "zero_stage", "offload"),
    [("adamw", 0, False), ("came", 2, False), ("adafactor", 3, False), ("came", 3, True)],
)
def test_two_processes_match_one_with_the_same_global_batch(
    tmp_path, tiny_config, reference_run, optimizer, zero_stage, offload
):
    # Global batch 8 either way: 1 process x 4 sequences x 2 accumulation steps, or
    # 2 processes x 4 sequences x 1 step (gradients averaged over gloo by DDP or shard-zero),
    # or (offload) 2 processes x 2 sequences x 2 micro-batches, the first under no_sync with
    # the sharded accumulator in host memory. The 1-process run (checkpoints and evaluations
    # every 10 steps, as in test_fsdp2.py) is shared with the other cases and files that ask
    # for the same config.
    common = {"steps": 20, "micro_batch_size": 4, "optimizer": optimizer}
    common |= {"checkpoint_every": 10, "eval_every": 10}
    one = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    sharded = {"grad_accum_steps": 1, "zero_stage": zero_stage}
    if offload:
        sharded |= {"micro_batch_size": 2, "grad_accum_steps": 2, "zero_offload_accum": True}
    two = tiny_config(pretrain={**common, **sharded})
    one_dir = reference_run(one)
    log = _leanlm_run(tmp_path, "two", two, processes=2)
    expected = f"on 2 process(es) ZeRO-{zero_stage}" if zero_stage else "on 2 process(es) DDP"
    assert expected in log

    result = json.loads((tmp_path / "two" / "pretrain" / "result.json").read_text())
    assert result["metrics"]["processes"] == 2
    if zero_stage:
        assert result["metrics"]["model_state_mib"] > 0
    # fp32 sums in a different order (per-rank then all-reduce vs. sequential accumulation, and
    # for the sharded runs cross-rank sums of the factored statistics) perturb gradients by
    # ~1e-7 relative; over 20 steps that stays below 1e-5 in the loss.
    torch.testing.assert_close(_losses(tmp_path / "two"), _losses(one_dir), atol=1e-5, rtol=1e-5)
    a = load_file(one_dir / "pretrain" / "model" / "model.safetensors")
    b = load_file(tmp_path / "two" / "pretrain" / "model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.distributed
def test_prune_search_on_two_processes_saves_what_one_saves(tmp_path, tiny_config, tiny_search):
    # Every process runs the same search (the same seeded batches, no gradient exchange) and
    # the main process's ranking is broadcast: two processes must rank the shapes and save the
    # pruned model exactly as one process does.
    _leanlm_run(tmp_path, "pre", tiny_config(stages=("pretrain",)), processes=1)
    pretrained = tmp_path / "pre" / "pretrain"
    params = json.loads((pretrained / "result.json").read_text())["metrics"]["params"]
    prune = tiny_search(search_params=int(0.6 * params), search_steps=4)
    config = tiny_config(stages=("prune",), init_model=str(pretrained / "model"), prune=prune)
    _leanlm_run(tmp_path, "one", config, processes=1)
    _leanlm_run(tmp_path, "two", config, processes=2)
    one, two = (
        json.loads((tmp_path / d / "prune" / "result.json").read_text())["metrics"]
        for d in ("one", "two")
    )
    assert len(one["search"]) >= 2  # several shapes were distilled and ranked
    assert two["search"] == one["search"]
    assert two["processes"] == 2
    a, b = (
        load_file(tmp_path / d / "prune" / "model" / "model.safetensors") for d in ("one", "two")
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _cut(run_dir, out, step):
    """A copy of `run_dir` as a kill right after its `step` checkpoint leaves it, in `out`."""
    shutil.copytree(run_dir, out)
    stage = out / "pretrain"
    (stage / "result.json").unlink()
    shutil.rmtree(stage / "model")
    assert (stage / "checkpoints" / f"step-{step:08d}").is_dir()
    for later in (stage / "checkpoints").glob("step-*"):
        if later.name > f"step-{step:08d}":
            shutil.rmtree(later)
    rows = (stage / "metrics.jsonl").read_text().splitlines()
    kept = [r for r in rows if json.loads(r).get("step", 0) <= step]
    (stage / "metrics.jsonl").write_text("".join(r + "\n" for r in kept))
    return out


def _assert_ends_like(run_dir, reference, processes):
    """`run_dir` ended where `reference` did, within the last bits (other splits and sums)."""
    result = json.loads((run_dir / "pretrain" / "result.json").read_text())
    assert result["metrics"]["processes"] == processes
    torch.testing.assert_close(_losses(run_dir), _losses(reference), atol=1e-5, rtol=1e-5)
    a = load_file(reference / "pretrain" / "model" / "model.safetensors")
    b = load_file(run_dir / "pretrain" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "sharding", [{}, {"zero_stage": 3}, {"engine": "fsdp2"}], ids=["ddp", "zero3", "fsdp2"]
)
def test_a_run_moves_between_two_three_and_one_process_with_the_same_global_batch(
    tmp_path, tiny_config, sharding
):
    # 2 processes x 3 micro-batches of 2 = 3 processes x 2 x 2 = 1 process x 6 x 2: the same
    # 12 sequences per step. The 2-process run's step-2 checkpoint (CAME state sharded 2 ways)
    # continues on 3 processes, and on 1 (which runs unsharded: its checkpoints keep the
    # engine's format, written from the whole model); the 1-process run's step-4 checkpoint
    # continues on 2 again. Each must end where the uninterrupted 2-process run ended.
    common = {"steps": 8, "micro_batch_size": 2, "optimizer": "came", **sharding}
    common |= {"checkpoint_every": 2, "keep_checkpoints": 4, "eval_every": 4, "warmup_steps": 2}
    two = tiny_config(pretrain={**common, "grad_accum_steps": 3})
    _leanlm_run(tmp_path, "two", two, processes=2)
    cut = _cut(tmp_path / "two", tmp_path / "cut", 2)

    if not sharding:  # checked before any engine starts: once is enough
        # the same config on 3 processes would make 18 sequences per step: refused, with the fix
        log = _leanlm_run(tmp_path, "two", two, processes=3, out=cut, resume=True, fails=True)
        assert "pretrain ran on 2, this run has 3" in log, log[-2000:]
        assert "`grad_accum_steps` x processes" in log

    three = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    log = _leanlm_run(tmp_path, "three", three, processes=3, out=cut, resume=True)
    assert "resuming from step-00000002 (step 2, written on 2 process(es))" in log
    _assert_ends_like(cut, tmp_path / "two", 3)

    one = tiny_config(pretrain={**common, "grad_accum_steps": 6})
    alone = _cut(tmp_path / "two", tmp_path / "alone", 2)
    log = _leanlm_run(tmp_path, "one", one, processes=1, out=alone, resume=True)
    assert "resuming from step-00000002 (step 2, written on 2 process(es))" in log
    _assert_ends_like(alone, tmp_path / "two", 1)
    # its own checkpoints: the engine's folder written from the whole model (DDP: accelerate's)
    files = {p.name for p in (alone / "pretrain" / "checkpoints" / "step-00000004").iterdir()}
    folder = "zero" if "zero_stage" in sharding else "fsdp2" if sharding else "model.safetensors"
    assert folder in files, files
    assert sharding == {} or "model.safetensors" not in files, files

    back = _cut(alone, tmp_path / "back", 4)
    log = _leanlm_run(tmp_path, "two", two, processes=2, out=back, resume=True)
    assert "resuming from step-00000004 (step 4, written on 1 process(es))" in log
    _assert_ends_like(back, tmp_path / "two", 2)


@pytest.mark.distributed
def test_zero_came_int8_state_resumes_bit_equal(tmp_path, tiny_config):
    # 8-bit CAME under ZeRO-2 on 2 processes: even row shards give every rank an
    # `exp_avg_scale` of one shape, which the checkpoint loader once could not place (a
    # ValueError on resume). Cut back to the step-2 checkpoint, the run ends bit-equal.
    common = {"steps": 4, "micro_batch_size": 2, "optimizer": "came", "state_dtype": "int8"}
    common |= {"zero_stage": 2, "checkpoint_every": 2, "eval_every": 4, "warmup_steps": 1}
    config = tiny_config(pretrain=common)
    _leanlm_run(tmp_path, "two", config, processes=2)
    cut = _cut(tmp_path / "two", tmp_path / "cut", 2)
    log = _leanlm_run(tmp_path, "two", config, processes=2, out=cut, resume=True)
    assert "resuming from step-00000002 (step 2)" in log
    assert torch.equal(_losses(cut), _losses(tmp_path / "two"))
    a = load_file(tmp_path / "two" / "pretrain" / "model" / "model.safetensors")
    b = load_file(cut / "pretrain" / "model" / "model.safetensors")
    for name in a:
        assert torch.equal(b[name], a[name]), name


@pytest.mark.distributed
def test_zero_offload_optimizer_trains_as_without_it(tmp_path, tiny_config):
    # ZeRO-Offload keeps the fp32 masters and CAME's state on the host and steps there (on a
    # CPU model: separate CPU tensors): the same sums in the same order as the on-device engine.
    common = {"steps": 8, "micro_batch_size": 2, "grad_accum_steps": 2, "optimizer": "came"}
    common |= {"zero_stage": 2, "eval_every": 8, "checkpoint_every": 0, "warmup_steps": 2}
    plain = tiny_config(pretrain=common)
    offload = tiny_config(pretrain={**common, "zero_offload_optimizer": True})
    _leanlm_run(tmp_path, "plain", plain, processes=2)
    log = _leanlm_run(tmp_path, "offload", offload, processes=2)
    assert "on 2 process(es) ZeRO-2" in log
    _assert_ends_like(tmp_path / "offload", tmp_path / "plain", 2)


@pytest.mark.slow  # ~2 min on 2 CPU cores: compiling in both processes, for each engine
@pytest.mark.distributed
def test_compiled_layers_train_under_every_engine(tmp_path, tiny_config):
    # `compile = true` composes with each engine (layers compiled before DDP wraps or ZeRO /
    # FSDP2 shard them, their hooks outside the compiled code), and under ZeRO-3 and FSDP2 with
    # activation checkpointing (recomputed inside backward, the unit re-gathered): 2 processes
    # train as 1 eager process with the same global batch.
    common = {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1, "eval_every": 4}
    common |= {"checkpoint_every": 0, "optimizer": "adamw"}
    eager = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    _leanlm_run(tmp_path, "eager", eager, processes=1)
    checkpointed = {"activation_checkpointing": True}
    engines = {
        "ddp": {},
        "zero3": {"zero_stage": 3, **checkpointed},
        "fsdp2": {"engine": "fsdp2", **checkpointed},
    }
    for name, engine in engines.items():
        compiled = tiny_config(pretrain={**common, **engine, "compile": True})
        log = _leanlm_run(tmp_path, name, compiled, processes=2)
        assert "compile: torch.compile of 2 decoder layers" in log
        _assert_ends_like(tmp_path / name, tmp_path / "eager", 2)
