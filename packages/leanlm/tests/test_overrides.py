"""`--set KEY=VALUE`: read as the TOML line `KEY = VALUE`, checked like the file, recorded."""

import tomllib

import pytest

from leanlm import PRESETS, ConfigError
from leanlm.cli import main
from leanlm.config import dumps_toml, load_toml, override
from leanlm.run.rundir import CONFIG_FILE


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "file"\n[pretrain]\nlr = 1e-3\nsteps = 50\n')
    return path


def test_values_are_typed_as_in_toml(toml_file):
    config = load_toml(
        toml_file,
        overrides=[
            "pretrain.lr=3e-4",  # float
            "data.seq_len=128",  # int
            "pretrain.compile=true",  # bool
            'name="cli"',  # string
            "pretrain.betas=[0.8, 0.9]",  # list
            'stages=["pretrain", "prune"]',
            "pretrain.warmup_steps = 5",  # spaces around `=` as in the file
            "pretrain.steps=20",
            "pretrain.steps=30",  # a later override wins
        ],
    )
    assert config.pretrain.lr == 3e-4
    assert config.data.seq_len == 128
    assert config.pretrain.compile is True
    assert config.name == "cli"
    assert config.pretrain.betas == (0.8, 0.9)
    assert config.stages == ("pretrain", "prune")
    assert (config.pretrain.warmup_steps, config.pretrain.steps) == (5, 30)
    # keys of the file not overridden are kept; int where float is expected, as in the file
    assert load_toml(toml_file, overrides=["pretrain.lr=1"]).pretrain.lr == 1.0
    assert load_toml(toml_file, overrides=["seed=3"]).pretrain.steps == 50


def test_a_nested_table_merges_key_by_key(toml_file):
    config = load_toml(toml_file, overrides=["pretrain={warmup_steps = 3, grad_clip = 0.5}"])
    assert (config.pretrain.lr, config.pretrain.steps) == (1e-3, 50)  # from the file
    assert (config.pretrain.warmup_steps, config.pretrain.grad_clip) == (3, 0.5)


@pytest.mark.parametrize(
    ("item", "key", "text"),
    [
        ("pretrain.stepz=10", "pretrain.stepz", "did you mean `steps`?; valid keys: ["),
        ("pretrian.lr=1e-3", "pretrian", "did you mean `pretrain`?; valid keys: ["),
        ("quantize.bits=4", "quantize", "unknown key; valid keys: ['cache_dir', "),
        ("pretrain.lr=fast", "pretrain.lr", "--set value 'fast' is not one TOML value"),
        ("data.source=files", "data.source", """--set 'data.source="files"'"""),
        ('pretrain.lr="3e-4"', "pretrain.lr", "must be float, got str '3e-4'"),
        ("pretrain.steps=1.5", "pretrain.steps", "must be int, got float 1.5"),
        ("pretrain.compile=1", "pretrain.compile", "must be bool, got int 1"),
        ('mixed_precision="fp8"', "mixed_precision", "must be one of ['no', 'bf16', 'fp16']"),
        ("pretrain.warmup_steps=500", "pretrain.warmup_steps", "(500) must be < `steps` (50)"),
        (
            "pretrain.zero_offload_optimizer=true",
            "pretrain.zero_offload_optimizer",
            """(True) is for `engine = "zero"` (shard-zero's ZeRO-Offload), got engine 'ddp'""",
        ),
        ("pretrain.lr", "pretrain.lr", "must be KEY=VALUE"),
        ("pretrain lr=1", "pretrain lr", "must be KEY=VALUE"),
        ("seed=1\nname=2", "seed", "is not one TOML value"),
    ],
)
def test_bad_overrides_name_the_key(toml_file, item, key, text):
    with pytest.raises(ConfigError) as info:
        load_toml(toml_file, overrides=[item])
    assert info.value.key == key
    assert str(info.value).startswith(f"config key `{key}`")
    assert text in str(info.value)
    assert "\n" not in str(info.value).replace(repr(item), "")


def test_zero_offload_optimizer_is_for_the_zero_engine(toml_file):
    config = load_toml(
        toml_file, overrides=["pretrain.zero_stage=1", "pretrain.zero_offload_optimizer=true"]
    )
    assert config.pretrain.zero_offload_optimizer
    assert config.pretrain.resolved_engine == "zero"
    with pytest.raises(ConfigError, match="got engine 'fsdp2'"):
        load_toml(
            toml_file, overrides=['pretrain.engine="fsdp2"', "pretrain.zero_offload_optimizer=true"]
        )


def test_demo_presets_take_overrides():
    preset = PRESETS["smoke"]()
    assert override(preset, []) is preset
    config = override(preset, ["pretrain.steps=60", "distill.zero_stage=3"])
    assert (config.pretrain.steps, config.distill.zero_stage) == (60, 3)
    assert config.model == preset.model
    assert config.prune == preset.prune
    with pytest.raises(ConfigError, match=r"`distill.zero_stagez`: unknown key"):
        override(preset, ["distill.zero_stagez=3"])


def test_cli_stops_on_a_bad_override_with_one_line(tmp_path, toml_file, capsys):
    for command in (["run", str(toml_file)], ["demo", "--preset", "smoke"]):
        out = tmp_path / command[0]
        code = main([*command, "--out", str(out), "--set", "pretrain.stepz=1"])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("leanlm: error: config key `pretrain.stepz`: unknown key; did you ")
        assert err.count("\n") == 1
        assert "Traceback" not in err
        assert not out.exists()


def test_overrides_are_recorded_and_resumed_like_a_config(tmp_path, tiny_config, capsys):
    path = tmp_path / "tiny.toml"
    path.write_text(dumps_toml(tiny_config(pretrain={"steps": 4, "eval_every": 4})))
    out = tmp_path / "run"
    sets = ["--set", "pretrain.lr=2e-3", "--set", "pretrain.warmup_steps=1"]
    assert main(["run", str(path), "--out", str(out), *sets]) == 0
    stored = tomllib.loads((out / CONFIG_FILE).read_text())
    assert (stored["pretrain"]["lr"], stored["pretrain"]["warmup_steps"]) == (2e-3, 1)
    report = (out / "report.md").read_text()
    assert "--set pretrain.lr=2e-3 --set pretrain.warmup_steps=1`" in report  # the command
    assert "lr = 0.002\n" in report  # the resolved config
    capsys.readouterr()

    # the same overrides: the same config hash, the finished stage is kept
    assert main(["run", str(path), "--out", str(out), "--resume", *sets]) == 0
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out
    # another value is a changed config: refused, naming the key
    changed = ["--set", "pretrain.lr=1e-3", "--set", "pretrain.warmup_steps=1"]
    assert main(["run", str(path), "--out", str(out), "--resume", *changed]) == 2
    err = capsys.readouterr().err
    assert "the config differs" in err
    assert "`pretrain.lr`" in err
    assert "--restart-changed" in err
    # and so is leaving an override out (the file's value differs from the recorded one)
    assert main(["run", str(path), "--out", str(out), "--resume", *sets[:2]]) == 2
    assert "`pretrain.warmup_steps`" in capsys.readouterr().err
