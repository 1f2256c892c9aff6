"""`[sparsify] block_sparse_layers`: the fine-tune trains sparse-kernels' `BlockSparseLinear`
layers (issue 24) and saves the same folder as the masked fine-tune."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import sparse_kernels
from leanlm.config import ConfigError, RunConfig, SparsifyConfig, dumps_toml, from_dict, load_toml
from leanlm.run.pipeline import run_pipeline
from leanlm.stages.sparsify import CHOICE_FILE, block_sparse_choice
from sparse_kernels import BlockSparseLinear

# the tiny model's k_proj (16 x 32) is one 16 x 16 tile wide: 0.75 of its 2 tiles prunes both,
# and sparse-kernels says so (`sparsify_` warns naming the layer)
pytestmark = pytest.mark.filterwarnings("ignore:sparsity .* prunes every weight of:UserWarning")
_BLOCK_SPARSE_ON = SparsifyConfig.block_sparse_on


@pytest.mark.parametrize(
    ("sparsify", "text"),
    [
        ({"block_sparse_layers": True}, "(true) needs `pattern = \"block\"`, got '2:4'"),
        (
            {"block_sparse_layers": True, "pattern": "block", "block_size": 8},
            "needs `block_size` in [16, 32, 64, 128] (the block-sparse kernels' tiles), got 8",
        ),
        ({"block_sparse_layers": "yes"}, "must be one of ['auto', True, False]"),
    ],
)
def test_bad_block_sparse_layers_name_the_key(sparsify, text):
    data = {"init_model": "m", "stages": ["sparsify"], "sparsify": sparsify}
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert info.value.key == "sparsify.block_sparse_layers"
    assert text in str(info.value)


def test_block_sparse_layers_auto_converts_on_cuda_only_where_allowed(tmp_path):
    block = SparsifyConfig(pattern="block")
    assert block.block_sparse_layers == "auto"
    assert block.block_sparse_on("cuda")
    assert not block.block_sparse_on("cpu")
    assert not SparsifyConfig().block_sparse_on("cuda")  # 2:4
    for other in ({"block_size": 8}, {"steps": 0}):
        assert not dataclasses.replace(block, **other).block_sparse_on("cuda"), other
    for engine in ({"engine": "fsdp2"}, {"zero_stage": 1}, {"zero_stage": 3}):  # every engine
        assert dataclasses.replace(block, **engine).block_sparse_on("cuda"), engine
    forced = SparsifyConfig(pattern="block", block_sparse_layers=True)
    assert forced.block_sparse_on("cpu")
    for engine in ({"engine": "fsdp2"}, {"zero_stage": 2}):
        assert dataclasses.replace(forced, **engine).block_sparse_on("cpu"), engine
    assert not dataclasses.replace(block, block_sparse_layers=False).block_sparse_on("cuda")
    # a TOML file round-trips it
    run = RunConfig(init_model="m", stages=("sparsify",), sparsify=forced)
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(run))
    assert "block_sparse_layers = true" in path.read_text()
    assert load_toml(path).sparsify.block_sparse_layers is True


def _config(tiny_pretrained, **sparsify):
    settings = {
        "pattern": "block",
        "block_size": 16,
        "sparsity": 0.75,  # tile density < 0.3: the PyTorch path's BSR products, not dense ones
        "method": "magnitude",
        "optimizer": "adamw",
        "steps": 4,
        "warmup_steps": 1,
        "micro_batch_size": 4,
        "eval_every": 4,
        "eval_batch_size": 4,
        "checkpoint_every": 2,
        "calibration_samples": 8,
    }
    return dataclasses.replace(
        tiny_pretrained.config,
        init_model=str(tiny_pretrained.model),
        stages=("sparsify",),
        sparsify=SparsifyConfig(**(settings | sparsify)),
    )


def _masks(run_dir):
    folder = run_dir / "sparsify" / "model"  # a plain from_pretrained, then its masks
    return sparse_kernels.load_masks_(AutoModelForCausalLM.from_pretrained(folder), folder)


def _weights(run_dir):
    return load_file(run_dir / "sparsify" / "model" / "model.safetensors")


def _auto_as_on(monkeypatch, device_type):
    """`"auto"` resolves as on a `device_type` device (the run itself stays on the CPU)."""
    monkeypatch.setattr(
        SparsifyConfig, "block_sparse_on", lambda cfg, _: _BLOCK_SPARSE_ON(cfg, device_type)
    )


def _resume_copy(run_dir, to):
    """A copy of `run_dir` whose sparsify stage stopped after its step-2 checkpoint."""
    shutil.copytree(run_dir, to)
    for name in ("result.json", "model", "compressed.safetensors"):
        path = to / "sparsify" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return to


def test_block_sparse_fine_tune_equals_the_masked_one_and_saves_the_same_folder(
    tmp_path, tiny_pretrained, monkeypatch, capsys
):
    calls = []  # BlockSparseLinear forwards with a gradient (the fine-tune's, not evaluations)
    real_forward = BlockSparseLinear.forward

    def forward(self, x):
        if torch.is_grad_enabled():
            calls.append(self.values.shape)
        return real_forward(self, x)

    monkeypatch.setattr(BlockSparseLinear, "forward", forward)
    block, masked = tmp_path / "block", tmp_path / "masked"
    config = _config(tiny_pretrained)  # "auto": converts on CUDA, so here as if on one
    _auto_as_on(monkeypatch, "cuda")
    (result,) = run_pipeline(config, block)
    layers = 2 * 7  # 2 decoder layers x (q, k, v, o, gate, up, down)
    # k and v (16 x 32: 2 tiles, round(0.75 x 2) = 2 pruned) keep no tile: they stay masked
    converted = 2 * 5
    assert result.metrics["block_sparse_layers"] == converted
    assert len(calls) == converted * 4  # 4 steps x 1 micro-batch
    _auto_as_on(monkeypatch, "cpu")
    (plain,) = run_pipeline(config, masked)  # the same config: "auto" on a CPU, masked
    assert plain.metrics["block_sparse_layers"] == 0
    assert len(calls) == converted * 4

    # the same folder: the same files, keys and masks; a plain from_pretrained reloads it
    files = {p.name for p in (block / "sparsify" / "model").iterdir()}
    assert files == {p.name for p in (masked / "sparsify" / "model").iterdir()}
    got, want = _weights(block), _weights(masked)
    assert got.keys() == want.keys()
    found, reference = _masks(block), _masks(masked)
    assert len(found) == layers
    assert found.keys() == reference.keys()
    for name, mask in found.items():
        assert torch.equal(mask, reference[name]), name
        assert (got[f"{name}.weight"][~mask] == 0).all(), name  # exact zeros outside the tiles
    # AdamW: the block-sparse updates are the masked ones (sums in another order)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)
    assert any(not torch.equal(got[k], want[k]) for k in want)  # another product ran
    assert (block / "sparsify" / "compressed.safetensors").exists()

    # Resumed from the step-2 checkpoint (rebuilt masks, converted again) where "auto" would
    # not convert (no GPU): the run keeps its first run's choice and the same bits.
    resumed = _resume_copy(block, tmp_path / "resumed")
    calls.clear()
    capsys.readouterr()
    run_pipeline(config, resumed, resume=True)
    out = capsys.readouterr().out
    assert '"auto": true as in the run this one resumes (on cpu it would be false' in out
    assert "[sparsify] resuming from step-00000002" in out
    assert len(calls) == converted * 2  # steps 3 and 4 only
    again = _weights(resumed)
    assert again.keys() == got.keys()
    for key in got:
        assert torch.equal(again[key], got[key]), key
    # and the reverse: the masked run resumed where "auto" would convert stays masked
    _auto_as_on(monkeypatch, "cuda")
    resumed = _resume_copy(masked, tmp_path / "resumed-masked")
    (result,) = run_pipeline(config, resumed, resume=True)
    out = capsys.readouterr().out
    # (the device is still the CPU: only "auto"'s resolution is patched)
    assert '"auto": false as in the run this one resumes (on cpu it would be true' in out
    assert "[sparsify] resuming from step-00000002" in out
    assert result.metrics["block_sparse_layers"] == 0
    assert len(calls) == converted * 2  # no block-sparse forward
    again = _weights(resumed)
    for key in want:
        assert torch.equal(again[key], want[key]), key


def test_an_explicit_block_sparse_layers_against_the_recorded_choice_is_a_config_error(tmp_path):
    # A run's first start records its choice under its config hash; a resume keeps it with
    # "auto", and an explicit value that contradicts it (its checkpoints could not load) stops.
    def context(config_hash, resume):
        acc = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, print=print)
        return SimpleNamespace(
            stage_dir=tmp_path, config_hash=config_hash, resume=resume, accelerator=acc
        )

    def recorded():
        return json.loads((tmp_path / CHOICE_FILE).read_text())

    forced = SparsifyConfig(pattern="block", block_sparse_layers=True)
    auto, off = (dataclasses.replace(forced, block_sparse_layers=v) for v in ("auto", False))
    assert block_sparse_choice(context("abc", resume=False), forced)  # on a CPU, forced
    assert recorded() == {"block_sparse_layers": True, "config_hash": "abc"}
    with pytest.raises(ConfigError) as info:
        block_sparse_choice(context("abc", resume=True), off)
    assert info.value.key == "sparsify.block_sparse_layers"
    message = str(info.value)
    assert "is false, but this run's fine-tune started with true" in message
    assert "its checkpoints hold block-sparse layers, which a masked fine-tune cannot" in message
    assert f"delete `{tmp_path / 'checkpoints'}`" in message
    assert recorded()["block_sparse_layers"] is True  # the error changed nothing
    assert block_sparse_choice(context("abc", resume=True), auto)  # on a CPU "auto" is false
    # another config's record is not this run's (its checkpoints are discarded): decided anew
    assert not block_sparse_choice(context("xyz", resume=True), auto)
    assert recorded() == {"block_sparse_layers": False, "config_hash": "xyz"}
    with pytest.raises(ConfigError, match="is true, but this run's fine-tune started with false"):
        block_sparse_choice(context("xyz", resume=True), forced)
    assert block_sparse_choice(context("xyz", resume=False), forced)  # a fresh start decides


def _leanlm_run(config, out):
    """`leanlm run` of `config` into `out` on 2 processes (torchrun); its output."""
    from leanlm_testing.cli_runs import run_leanlm

    toml = out.parent / f"{out.name}.toml"
    toml.write_text(dumps_toml(config))
    done = run_leanlm("run", toml, "--out", out, "--processes", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("sharding", "optimizer", "label"),
    [({"zero_stage": 3}, "adamw", "ZeRO-3"), ({"engine": "fsdp2"}, "came", "FSDP2")],
    ids=["zero3-adamw", "fsdp2-came"],
)
def test_sharded_block_sparse_fine_tune_saves_the_ddp_runs_folder_and_resumes(
    tmp_path, tiny_pretrained, capsys, sharding, optimizer, label
):
    # Global batch 4 either way: the ddp run on 1 process x 2 sequences x 2 accumulation
    # steps, the sharded run on 2 gloo processes x 2 sequences (FSDP2 splits every
    # (tiles, b, b) parameter by tiles; ZeRO-3 keeps these tiny ones whole, below its
    # `min_shard_numel`, and frees the gathered weights between uses: tiles split under ZeRO
    # are tested in integration_tests/test_sparse_under_zero.py). The folder is written from
    # the gathered state dict, through a copy with the same block-sparse layers converted back
    # (a masked copy cannot load it).
    block = {"block_sparse_layers": True, "micro_batch_size": 2, "lr": 1e-2}
    block |= {"optimizer": optimizer}
    one, two = tmp_path / "one", tmp_path / "two"
    run_pipeline(_config(tiny_pretrained, **block, grad_accum_steps=2), one)
    log = _leanlm_run(_config(tiny_pretrained, **block, **sharding), two)
    assert f"on 2 process(es) {label}" in log
    assert "[sparsify] fine-tuning 10 block-sparse layers" in log
    for run, parallel in ((one, "none"), (two, label)):
        metrics = json.loads((run / "sparsify" / "result.json").read_text())["metrics"]
        assert (metrics["block_sparse_layers"], metrics["parallel"]) == (2 * 5, parallel)
    files = {p.name for p in (two / "sparsify" / "model").iterdir()}
    assert files == {p.name for p in (one / "sparsify" / "model").iterdir()}
    found, reference = _masks(two), _masks(one)
    assert found.keys() == reference.keys()
    got, want = _weights(two), _weights(one)
    assert got.keys() == want.keys()
    pretrained = load_file(tiny_pretrained.model / "model.safetensors")
    for name, mask in found.items():
        assert torch.equal(mask, reference[name]), name
        assert (got[f"{name}.weight"][~mask] == 0).all(), name
        moved = (got[f"{name}.weight"] - pretrained[f"{name}.weight"] * mask).abs().max()
        assert moved > 1e-4 or not mask.any(), name  # the fine-tune's updates were saved
    tolerance = {"atol": 1e-6, "rtol": 1e-5}  # the repo's sharded-vs-one-process sparse runs'
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tolerance, msg=key)

    # Resumed from the step-2 sharded checkpoint (written by 2 processes) on 1 process with
    # the same global batch, in this process (the engine's checkpoint format; the layers are
    # converted again before it loads): it ends where the 2-process run ended.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    folder = "zero" if "zero_stage" in sharding else "fsdp2"
    assert (resumed / "sparsify" / "checkpoints" / "step-00000002" / folder).is_dir()
    for name in ("result.json", "model", "compressed.safetensors"):
        path = resumed / "sparsify" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    alone = _config(tiny_pretrained, **block, **sharding, grad_accum_steps=2)
    capsys.readouterr()
    (result,) = run_pipeline(alone, resumed, resume=True)
    assert "[sparsify] resuming from step-00000002" in capsys.readouterr().out
    assert result.metrics["block_sparse_layers"] == 2 * 5
    again = _weights(resumed)
    assert again.keys() == got.keys()
    for key in got:
        torch.testing.assert_close(again[key], got[key], **tolerance, msg=key)
