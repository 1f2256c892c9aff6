"""FSDP2 as an engine (`engine = "fsdp2"`).

Two gloo processes train like one with the same global batch, a run resumed from an FSDP2
checkpoint ends where the uninterrupted run ended, and evaluation runs in lockstep. The sparse
fine-tune keeps its masks under FSDP2 (and under ZeRO-3, the other engine that frees gathered
weights) and exports the gathered model.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import ConfigError, RunConfig, dumps_toml, from_dict


def _run(args, *, processes, env):
    env = {**env, "PYTHONFAULTHANDLER": "1"}  # a native crash prints where it happened
    if processes == 1:
        command = [sys.executable, "-m", "leanlm", *map(str, args)]
    else:
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
        command = [torchrun, "--standalone", "--nproc_per_node", str(processes), "-m", "leanlm"]
        command += list(map(str, args))
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return done.stdout + done.stderr


def _scenario(tmp_path, scenario, *args, **kwargs):
    """`scenario(folder, *args, **kwargs)` in a fresh folder under `tmp_path`.

    These runs once died now and then with SIGSEGV on a busy machine: every torchrun worker ran
    `rundir.check_out_dir`, which wrote and unlinked one shared probe file, so one worker failed
    ("--out ... is not writable") and torchrun's SIGTERM hit the other while it imported torch.
    The probe is per process now (`test_faults.py` races it); a crash fails the test at once.
    """
    folder = tmp_path / "run"
    folder.mkdir()
    return scenario(folder, *args, **kwargs)


def _two(tmp_path, two, env, label="FSDP2"):
    """Run config `two` sharded (`label`) in 2 processes into `two/`; its output."""
    (tmp_path / "two.toml").write_text(dumps_toml(two))
    log = _run(["run", tmp_path / "two.toml", "--out", tmp_path / "two"], processes=2, env=env)
    assert f"on 2 process(es) {label}" in log
    return log


def _rows(run_dir):
    path = run_dir / "pretrain" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(run_dir):
    return load_file(run_dir / "pretrain" / "model" / "model.safetensors")


# Bytes of model state per parameter on one process (fp32): the parameter and AdamW's two
# moments; CAME's first moment (its factored statistics are O(rows + cols)); Adafactor keeps
# only factored statistics. The gradients are freed after the last step.
_STATE_BYTES = {"adamw": 12, "came": 8, "adafactor": 4}


def _one_vs_two_then_resume(
    tmp_path, tiny_config, reference_run, optimizer, *, steps, atol, rtol, weights
):
    # Global batch 8 either way: 1 process x 4 sequences x 2 accumulation steps (the shared
    # `reference_run`), or 2 FSDP2 processes x 4 sequences x 1 step (gradients
    # reduce-scattered and averaged).
    every = steps // 2
    common = {"steps": steps, "micro_batch_size": 4, "optimizer": optimizer}
    common |= {"checkpoint_every": every, "eval_every": every}
    one = tiny_config(pretrain={**common, "grad_accum_steps": 2})
    two = tiny_config(pretrain={**common, "grad_accum_steps": 1, "engine": "fsdp2"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one_dir = reference_run(one)
    log = _two(tmp_path, two, env)

    result = json.loads((tmp_path / "two" / "pretrain" / "result.json").read_text())
    assert result["metrics"]["processes"] == 2
    assert result["metrics"]["parallel"] == "FSDP2"
    # each process holds half of the parameters and of the per-element state, plus (CAME,
    # Adafactor) its rows' row statistics and the full column statistics: < 10% more here
    full_bytes = _STATE_BYTES[optimizer] * result["metrics"]["params"]
    assert 0.45 * full_bytes < result["metrics"]["model_state_mib"] * 2**20 < 0.6 * full_bytes
    losses = [
        torch.tensor([r["loss"] for r in _rows(d) if "loss" in r], dtype=torch.float64)
        for d in (one_dir, tmp_path / "two")
    ]
    assert len(losses[0]) == steps
    torch.testing.assert_close(losses[1], losses[0], atol=atol, rtol=rtol)
    a, b = _weights(one_dir), _weights(tmp_path / "two")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **weights, msg=name)

    # Resume: the same run folder cut back to its mid-run FSDP2 checkpoint (result, model and
    # the later metric rows gone) must end with the uninterrupted run's weights, bit for bit.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "two", cut)
    stage = cut / "pretrain"
    sharded = stage / "checkpoints" / f"step-{every:08d}" / "fsdp2"
    assert sharded.is_dir()
    # the optimizer state is in the DCP files (CAME and Adafactor: as DTensors over the mesh)
    assert sorted(f.name for f in sharded.glob("optim-rank*")) == []
    (stage / "result.json").unlink()
    shutil.rmtree(stage / "model")
    rows = [r for r in _rows(cut) if r["step"] <= every]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = _run(["run", tmp_path / "two.toml", "--out", cut, "--resume"], processes=2, env=env)
    assert f"resuming from step-{every:08d}" in log
    resumed = _weights(cut)
    for name in b:
        assert torch.equal(resumed[name], b[name]), f"{name} differs after an FSDP2 resume"
    assert [r["loss"] for r in _rows(cut) if "loss" in r] == losses[1].tolist()


@pytest.mark.distributed
def test_fsdp2_two_processes_match_one_and_resume_exactly(tmp_path, tiny_config, reference_run):
    # fp32 sums in a different order (per-rank then reduce-scatter vs. sequential accumulation)
    # perturb gradients by ~1e-7 relative; over 20 steps that stays below 1e-5 in the loss.
    weights = {"atol": 2e-5, "rtol": 1e-4}
    _scenario(
        tmp_path,
        _one_vs_two_then_resume,
        tiny_config,
        reference_run,
        "adamw",
        steps=20,
        atol=1e-5,
        rtol=1e-5,
        weights=weights,
    )


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["came", pytest.param("adafactor", marks=pytest.mark.slow)])
def test_fsdp2_factored_optimizers_match_one_process_and_resume_exactly(
    tmp_path, tiny_config, reference_run, optimizer
):
    # The sharded step all-reduces the column sums and the RMS sums over the two shards of each
    # matrix (`optim_adafactor.dtensor`) and FSDP2 averages the gradients in another order, so
    # values differ from one process in the last bits only. Measured after 12 steps: weights
    # <= 2.3e-8 apart (they are ~0.02 and move ~1e-2), losses <= 4.8e-7 (CAME) and 0
    # (Adafactor). Column statistics from a shard's own rows alone would put each update off by
    # 11-34% of its norm (optim-came README, "FSDP2").
    weights = {"atol": 1e-6, "rtol": 1e-5}
    _scenario(
        tmp_path,
        _one_vs_two_then_resume,
        tiny_config,
        reference_run,
        optimizer,
        steps=12,
        atol=1e-5,
        rtol=1e-5,
        weights=weights,
    )


@pytest.mark.parametrize(
    ("section", "key", "text"),
    [
        ({"engine": "fsdp2", "zero_stage": 2}, "pretrain.zero_stage", 'is for `engine = "zero"`'),
        ({"engine": "zero"}, "pretrain.zero_stage", 'must be 1, 2 or 3 with `engine = "zero"`'),
        ({"engine": "tp"}, "pretrain.engine", "must be one of"),
        (
            {"zero_offload_accum": True},
            "pretrain.zero_offload_accum",
            '(True) is for `engine = "zero"` with `zero_stage` 2 or 3',
        ),
        (
            {"zero_stage": 1, "zero_accum_dtype": "bf16"},
            "pretrain.zero_accum_dtype",
            "engine 'zero', zero_stage 1",
        ),
        ({"zero_stage": 2, "zero_accum_dtype": "fp16"}, "pretrain.zero_accum_dtype", "must be"),
    ],
)
def test_engine_settings_are_checked(section, key, text):
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, {"pretrain": {"optimizer": "adamw", **section}})
    assert info.value.key == key
    assert text in str(info.value)


def test_engine_defaults_from_zero_stage_and_every_training_stage_takes_fsdp2():
    pretrain = {"zero_stage": 3, "zero_accum_dtype": "bf16", "zero_offload_accum": True}
    config = from_dict(RunConfig, {"pretrain": pretrain, "distill": {}})
    assert config.pretrain.resolved_engine == "zero"
    assert (config.pretrain.zero_accum_dtype, config.pretrain.zero_offload_accum) == ("bf16", True)
    assert config.distill.resolved_engine == "ddp"
    for stage in ("pretrain", "distill", "sparsify", "control"):
        config = from_dict(RunConfig, {stage: {"engine": "fsdp2", "optimizer": "adamw"}})
        assert getattr(config, stage).resolved_engine == "fsdp2"


def _evaluate_sharded(rank, world_size, windows, expected):
    from leanlm.train.engines import fsdp2_shard
    from leanlm.train.evaluate import evaluate_perplexity
    from leanlm_testing.models import tiny_llama

    model = fsdp2_shard(tiny_llama(seed=0))
    # 5 windows over 2 ranks in batches of 2: rank 0 runs 2 passes, rank 1 one real pass and one
    # unscored pass, or rank 0 would wait forever in its second pass's all-gather
    result = evaluate_perplexity(model, windows, batch_size=2, lockstep=True)
    assert result.tokens == expected["tokens"]
    assert abs(result.loss - expected["loss"]) < 1e-5, (result.loss, expected["loss"])


@pytest.mark.distributed
def test_fsdp2_evaluation_runs_in_lockstep_and_equals_one_process(tmp_path):
    from leanlm.train.evaluate import evaluate_perplexity
    from leanlm_testing import spawn
    from leanlm_testing.models import tiny_llama

    windows = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(0))
    single = evaluate_perplexity(tiny_llama(seed=0), windows, batch_size=2)
    expected = {"tokens": single.tokens, "loss": single.loss}
    spawn(_evaluate_sharded, windows, expected, world_size=2, tmp_path=tmp_path)


def _built_came():
    from leanlm.train.engines import fsdp2_shard
    from leanlm.train.optim import decay_param_groups, optimizer_over
    from leanlm_testing.models import tiny_llama

    model = fsdp2_shard(tiny_llama(seed=0))
    groups = decay_param_groups(model.parameters(), 0.1)
    return model, optimizer_over("came", groups, lr=1e-3, betas=(0.9, 0.95))


def _logical_state(model, optimizer):
    """Every parameter and optimizer state tensor as its whole (logical) tensor (a collective)."""
    from optim_adafactor.dtensor import distributed_state_dict

    state = distributed_state_dict(optimizer, model)["state"]
    full = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    for name, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                full[f"{name}/{key}"] = (
                    value.full_tensor() if hasattr(value, "full_tensor") else value
                )
            else:
                full[f"{name}/{key}"] = torch.tensor(value)
    return full


def _save_and_load_factored_state(rank, world_size, folder):
    from pathlib import Path

    from leanlm.train.sharded_state import Fsdp2State

    model, optimizer = _built_came()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # each rank its own data: its row statistics differ from the other's
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = Path(folder)
    Fsdp2State(model, optimizer).save(path)
    assert sorted(path.glob("optim-rank*")) == []  # all in the DCP files
    logical = _logical_state(model, optimizer)
    if rank == 0:
        torch.save(logical, path.parent / "logical.pt")
    fresh_model, fresh_optimizer = _built_came()
    Fsdp2State(fresh_model, fresh_optimizer).load(path)
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert len(saved) > 0
    assert saved.keys() == loaded.keys()
    for index, state in saved.items():
        assert loaded[index].keys() == state.keys(), index
        assert loaded[index]["step"] == state["step"] == 2
        for key, value in state.items():
            if key != "step":
                assert torch.equal(loaded[index][key], value), (index, key)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a.to_local(), b.to_local())
    torch.distributed.barrier()


def _load_factored_state_at(rank, world_size, folder):
    from pathlib import Path

    from leanlm.train.sharded_state import Fsdp2State

    path = Path(folder)
    model, optimizer = _built_came()
    Fsdp2State(model, optimizer).load(path)  # written by 2 processes
    got, saved = _logical_state(model, optimizer), torch.load(path.parent / "logical.pt")
    assert got.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    torch.distributed.barrier()
    if rank == 0:  # the per-process files of an earlier leanlm
        torch.save({}, path / "optim-rank00000-of-00003.pt")
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="per-process files"):
        Fsdp2State(model, optimizer).load(path)


@pytest.mark.distributed
def test_fsdp2_factored_optimizer_state_reshards_through_dcp(tmp_path):
    # Written by 2 processes, each with its own data (so their row statistics differ); read
    # back by 2 (every local tensor equal) and by 3 (other row splits: every logical parameter
    # and state tensor, row statistics included, equal to the saved one).
    from leanlm_testing import spawn

    folder = str(tmp_path / "ckpt")
    for world, worker in ((2, _save_and_load_factored_state), (3, _load_factored_state_at)):
        rendezvous = tmp_path / f"world{world}"
        rendezvous.mkdir()
        spawn(worker, folder, world_size=world, tmp_path=rendezvous)


def _sparse_export(run_dir):
    """The sparsify stage's dense-with-zeros weights, masks, mask info and compact file."""
    folder = run_dir / "sparsify" / "model"
    return (
        load_file(folder / "model.safetensors"),
        load_file(folder / "sparse_masks.safetensors"),
        json.loads((folder / "sparsity.json").read_text()),
        load_file(run_dir / "sparsify" / "compressed.safetensors"),
    )


_SHARDING = {"fsdp2": {"engine": "fsdp2"}, "zero": {"zero_stage": 3}}


def _zero_masters(folder):
    """Every parameter's fp32 master, whole, from a shard-zero checkpoint `folder`.

    Each `rank*.safetensors` holds rows `rows[name]` of `<name>::master` (shard_zero's format);
    a parameter kept whole (replicated) is in every file with the same rows.
    """
    from safetensors import safe_open

    pieces = {}
    for path in sorted(folder.glob("rank*.safetensors")):
        with safe_open(path, "pt") as f:
            rows = json.loads(f.metadata()["shard_zero"])["rows"]
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name, _, kind = key.partition("::")
                if kind == "master":
                    pieces.setdefault(name, {})[rows[name][0]] = f.get_tensor(key)
    return {name: torch.cat([part[r] for r in sorted(part)]) for name, part in pieces.items()}


def _sparse_losses(run_dir):
    path = run_dir / "sparsify" / "metrics.jsonl"
    return [row["loss"] for row in map(json.loads, path.read_text().splitlines()) if "loss" in row]


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["fsdp2", "zero"])
def test_sharded_sparse_fine_tune_holds_masks_matches_one_process_and_resumes(
    tmp_path, tiny_config, reference_run, engine
):
    _scenario(tmp_path, _sparse_one_vs_two_then_resume, tiny_config, reference_run, engine)


def _sparse_one_vs_two_then_resume(tmp_path, tiny_config, reference_run, engine):
    # The 1-process run (the same for both engines: `reference_run`) pretrains briefly, then
    # prunes 2:4 (Wanda) and fine-tunes with CAME (global batch 8 as 1 x 4 x 2); the sharded
    # run (2 x 4 x 1, FSDP2 or ZeRO-3) starts its sparsify stage from that pretrained model
    # (`init_model`): both prune the same weights with the same calibration batches, so their
    # masks must be identical and their training equal. ZeRO-3 frees the gathered weights
    # between uses: the export is written from `shard_zero.full_state_dict`, as FSDP2's from
    # the gathered state dict.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from leanlm.config import SparsifyConfig
    from sparse_kernels.export import unpack_bits

    steps, every = 8, 4
    train = {"steps": steps, "micro_batch_size": 4, "warmup_steps": 2, "eval_batch_size": 4}
    train |= {"eval_every": every, "checkpoint_every": every, "calibration_samples": 8}
    one = tiny_config(
        stages=("pretrain", "sparsify"),
        pretrain={"steps": 6, "checkpoint_every": 0},
        sparsify=SparsifyConfig(**train, grad_accum_steps=2),
    )
    one_dir = reference_run(one)
    two = tiny_config(
        stages=("sparsify",),
        init_model=str(one_dir / "pretrain" / "model"),
        sparsify=SparsifyConfig(**train, grad_accum_steps=1, **_SHARDING[engine]),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    label = "FSDP2" if engine == "fsdp2" else "ZeRO-3"
    log = _two(tmp_path, two, env, label=label)
    result = json.loads((tmp_path / "two" / "sparsify" / "result.json").read_text())
    assert result["metrics"]["parallel"] == label

    # training: the masked forward and the sharded updates equal one process's (CAME's
    # tolerances in the test above; a forward that skipped the masks fails here)
    losses = _sparse_losses(tmp_path / "two")
    reference = _sparse_losses(one_dir)
    assert len(reference) == steps
    torch.testing.assert_close(losses, reference, atol=1e-5, rtol=1e-5)
    weights, packed, info, compact = _sparse_export(tmp_path / "two")
    ref_weights, ref_packed, ref_info, ref_compact = _sparse_export(one_dir)
    for name in ("config.json", "generation_config.json"):
        written = (tmp_path / "two" / "sparsify" / "model" / name).read_text()
        assert written == (one_dir / "sparsify" / "model" / name).read_text(), name
    # the masks: bit for bit the 1-process run's, on all 7 Linears of both decoder layers
    assert info == ref_info
    assert len(info["masks"]) == 7 * 2
    assert packed.keys() == ref_packed.keys()
    for name in packed:
        assert torch.equal(packed[name], ref_packed[name]), name
    # the export is the whole gathered model (every tensor at full shape) and equals the
    # 1-process run's; its masked weights are zero exactly where the masks prune
    pretrained = load_file(one_dir / "pretrain" / "model" / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    tolerance = {"atol": 1e-6, "rtol": 1e-5}
    for name in weights:
        assert weights[name].shape == ref_weights[name].shape, name
        torch.testing.assert_close(weights[name], ref_weights[name], **tolerance, msg=name)
    for name, meta in info["masks"].items():
        mask = unpack_bits(packed[name], tuple(meta["shape"]))
        weight = weights[f"{name}.weight"]
        assert torch.count_nonzero(weight[~mask]) == 0, name
        assert torch.count_nonzero(weight[mask]) == mask.sum(), name
        # the fine-tune moved the kept weights (its updates reached the export)
        moved = (weight - pretrained[f"{name}.weight"] * mask).abs().max()
        assert moved > 1e-4, name
    assert compact.keys() == ref_compact.keys()
    for key in compact:
        if key.endswith(".meta24"):  # which 2 of every 4 are kept
            assert torch.equal(compact[key], ref_compact[key]), key
        else:
            torch.testing.assert_close(compact[key], ref_compact[key], **tolerance, msg=key)

    # Resume from the mid-run sharded checkpoint: the masks are rebuilt, the checkpoint
    # restores the shards and CAME's state; the export must equal the uninterrupted one's.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "two", cut)
    stage = cut / "sparsify"
    sharded = stage / "checkpoints" / f"step-{every:08d}" / engine
    # The trainable weights behind the masks stayed exactly zero where the masks prune through
    # the sharded optimizer steps (weight decay, CAME's momentum); read from the checkpoint's
    # shards, since the export bakes the masks in whatever they hold.
    if engine == "fsdp2":
        assert sorted(f.name for f in sharded.glob("optim-rank*")) == []  # all in DCP files
        dcp_to_torch_save(sharded, tmp_path / "checkpoint.pt")
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    else:
        state = _zero_masters(sharded)
    for name, meta in info["masks"].items():
        mask = unpack_bits(packed[name], tuple(meta["shape"]))
        stored = state[f"{name}.parametrizations.weight.original"]
        assert stored.shape == mask.shape, name
        assert torch.count_nonzero(stored[~mask]) == 0, name
    (stage / "result.json").unlink()
    (stage / "compressed.safetensors").unlink()
    shutil.rmtree(stage / "model")
    rows = [json.loads(r) for r in (stage / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if r["step"] <= every]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    log = _run(["run", tmp_path / "two.toml", "--out", cut, "--resume"], processes=2, env=env)
    assert f"[sparsify] resuming from step-{every:08d}" in log
    resumed_weights, resumed_packed, resumed_info, resumed_compact = _sparse_export(cut)
    assert resumed_info == info
    pairs = ((resumed_weights, weights), (resumed_packed, packed), (resumed_compact, compact))
    for got, want in pairs:
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"{key} differs after a {label} resume"
    assert _sparse_losses(cut) == losses
