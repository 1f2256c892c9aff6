"""Run-level `[optim]` / `[parallel]`: said once, resolved into every training stage at load."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from leanlm import PRESETS, ConfigError
from leanlm.config import RunConfig, dumps_toml, from_dict, load_toml, override
from leanlm.config.shared_sections import TRAINING_STAGES
from leanlm.run.rundir import stage_hash

CONFIGS = Path(__file__).parents[1] / "configs"
FULL = 'stages = ["pretrain", "prune", "distill", "sparsify", "control"]\n'


def _load(tmp_path, text, overrides=()):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_toml(path, overrides=overrides)


def _hashes(config):
    previous, found = "", []
    for stage in config.stages:
        previous = stage_hash(config, stage, previous, processes=2)
        found.append(previous)
    return found


def test_run_level_values_reach_every_training_stage(tmp_path):
    config = _load(
        tmp_path,
        FULL + '[optim]\noptimizer = "adamw"\nbetas = [0.8, 0.9]\n[parallel]\nzero_stage = 3\n',
    )
    for stage in TRAINING_STAGES:
        section = getattr(config, stage)
        assert (section.optimizer, section.betas, section.zero_stage) == ("adamw", (0.8, 0.9), 3)
        assert section.resolved_engine == "zero"


def test_a_stage_value_wins_over_the_run_level_one(tmp_path):
    config = _load(
        tmp_path,
        FULL + "[optim]\nlr = 5e-4\n[parallel]\nzero_stage = 2\n"
        '[distill]\nlr = 1e-2\nengine = "ddp"\nzero_stage = 0\n',
    )
    assert [getattr(config, s).lr for s in TRAINING_STAGES] == [5e-4, 1e-2, 5e-4, 5e-4]
    assert [getattr(config, s).zero_stage for s in TRAINING_STAGES] == [2, 0, 2, 2]
    assert config.distill.resolved_engine == "ddp"


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("[optim]\nlr_max = 1.0\n", "optim.lr_max", "valid keys: ['optimizer', 'lr'"),
        ("[optim]\nzero_stage = 2\n", "optim.zero_stage", "valid keys"),
        ("[parallel]\nzero_stage = 2\n[optim]\noptimzer = 1\n", "optim.optimzer", "`optimizer`"),
        ('[optim]\noptimizer = "sgd"\n', "optim.optimizer", "'came', 'adamw', 'adafactor'"),
        ('[parallel]\nengine = "deepspeed"\n', "parallel.engine", "'ddp', 'zero', 'fsdp2'"),
        ('[optim]\nlr = "fast"\n', "optim.lr", "must be float"),
        ("optim = 3\n", "optim", "must be a table"),
        # a rule between keys, found in the stage, names the run-level key it came from
        ('[parallel]\nengine = "zero"\n', "pretrain.zero_stage", "takes `parallel.engine`"),
        (
            '[parallel]\nzero_stage = 1\nzero_accum_dtype = "bf16"\n',
            "parallel.zero_accum_dtype",
            "2 or 3",
        ),
    ],
)
def test_bad_run_level_keys_are_named(tmp_path, text, key, words):
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, text)
    assert caught.value.key == key
    assert words in str(caught.value)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_resolve_as_read_and_hash_as_before(path):
    data = tomllib.loads(path.read_text())
    config = load_toml(path)
    if "parallel" in data or "optim" in data:  # stdlib-full: the default preset written out
        assert _hashes(config) == _hashes(
            dataclasses.replace(PRESETS["default"](), name=config.name)
        )
    else:  # nothing to resolve: exactly the sections as written, so the same hashes as before
        assert config == from_dict(RunConfig, data)


def test_an_equivalent_new_style_config_has_the_same_hashes(tmp_path):
    old = PRESETS["default"]()  # zero_stage 2 and lr per stage, written in every stage
    new_text = dumps_toml(old).replace("zero_stage = 2\n", "")
    new_text = new_text.replace('optimizer = "came"\n', "")
    new = _load(tmp_path, f'{new_text}\n[optim]\noptimizer = "came"\n[parallel]\nzero_stage = 2\n')
    assert new == old
    assert _hashes(new) == _hashes(old)
    assert dumps_toml(new) == dumps_toml(old)
    # and the resolved config round-trips through TOML with no run-level tables left
    data = tomllib.loads(dumps_toml(new))
    assert "optim" not in data
    assert "parallel" not in data
    assert load_toml_text(tmp_path, dumps_toml(new)) == new


def load_toml_text(tmp_path, text):
    path = tmp_path / "again.toml"
    path.write_text(text)
    return load_toml(path)


def test_set_optim_key_sets_every_training_stage_over_the_file(tmp_path):
    text = FULL + "[optim]\nlr = 5e-4\n[pretrain]\nlr = 1e-2\n"
    config = _load(tmp_path, text, overrides=["optim.lr=2e-3"])
    assert {getattr(config, s).lr for s in TRAINING_STAGES} == {2e-3}
    # a stage's own override among them still wins
    config = _load(tmp_path, text, overrides=["optim.lr=2e-3", "sparsify.lr=1e-4"])
    assert [getattr(config, s).lr for s in TRAINING_STAGES] == [2e-3, 2e-3, 1e-4, 2e-3]
    # on a preset too, and the recorded config holds only per-stage values
    preset = override(PRESETS["smoke"](), ["parallel.zero_stage=1", "optim.weight_decay=0.0"])
    for stage in TRAINING_STAGES:
        assert (getattr(preset, stage).zero_stage, getattr(preset, stage).weight_decay) == (1, 0)
    with pytest.raises(ConfigError, match=r"`optim.betas`"):
        override(PRESETS["smoke"](), ["optim.betas=[0.9]"])
