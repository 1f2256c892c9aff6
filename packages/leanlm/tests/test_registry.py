"""The stage registry: one place per stage, names derived from it, no stage imports another."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import leanlm
from leanlm import presets
from leanlm.cli import _parser
from leanlm.config import STAGE_NAMES, ConfigError, RunConfig, from_dict, library_errors
from leanlm.stages import STAGES, Stage, register_stage

SRC = Path(leanlm.__file__).parent


def test_stage_names_presets_and_help_come_from_the_registry():
    assert set(STAGE_NAMES) == set(STAGES)
    assert STAGE_NAMES == ("pretrain", "prune", "distill", "sparsify", "control")
    assert presets.ALL_STAGES == STAGE_NAMES
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for name, stage in STAGES.items():
        assert isinstance(getattr(RunConfig(), name), stage.config)
        assert fields[name].default_factory is stage.config  # type: ignore[misc]
    help_text = _parser().format_help()
    for name in STAGE_NAMES:
        assert name in help_text


def test_stage_modules_do_not_import_each_other():
    for name, stage in STAGES.items():
        module = stage.__module__
        tree = ast.parse(
            (SRC / f"{module.removeprefix('leanlm.').replace('.', '/')}.py").read_text()
        )
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
            a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
        }
        others = {s.__module__ for s in STAGES.values()} - {module}
        assert not imported & others, (name, imported & others)


def test_register_stage_refuses_a_duplicate_or_a_stage_without_a_section():
    @dataclasses.dataclass(frozen=True)
    class QuantizeConfig:
        bits: int = 8

    class Again(Stage):
        name = "pretrain"
        config = QuantizeConfig

    with pytest.raises(ValueError, match="already registered"):
        register_stage(Again)

    class NoSection(Stage):
        name = "quantize"

    with pytest.raises(TypeError, match="must set `config`"):
        register_stage(NoSection)
    assert "quantize" not in STAGES


def test_each_stage_runs_its_cross_stage_hook():
    # distill's hook: the teacher must run before it
    with pytest.raises(ConfigError) as info:
        from_dict(
            RunConfig,
            {"stages": ["pretrain", "distill"], "distill": {"teacher_stage": "sparsify"}},
        )
    assert info.value.key == "distill.teacher_stage"
    # pretrain's hook
    with pytest.raises(ConfigError, match="'pretrain' can only come first"):
        RunConfig(stages=("prune", "pretrain"), init_model="x")
    # the generic rule names the stages that can start a run
    with pytest.raises(ConfigError, match="start with 'pretrain' or set `init_model`"):
        RunConfig(stages=("prune",))


def test_library_errors_name_our_key_and_keep_the_library_words():
    @dataclasses.dataclass(frozen=True)
    class Section:
        pattern: str = "x"
        width: int = 0

    with pytest.raises(ConfigError) as info, library_errors(Section()):
        raise ValueError("`width` (0) must be >= 1")
    assert (info.value.key, info.value.message) == ("width", "(0) must be >= 1")
    with pytest.raises(ConfigError) as info, library_errors(Section(), keys={"n": "pattern"}):
        raise ValueError("`n` (4) must be < `m` (2)")
    assert (info.value.key, info.value.message) == ("pattern", "'x': `n` (4) must be < `m` (2)")
    # an error naming nothing of ours is a bug, not a bad config: it passes through unchanged
    with pytest.raises(ValueError, match=r"^`other` broke$"), library_errors(Section()):
        raise ValueError("`other` broke")


def test_sections_hand_the_libraries_their_own_configs():
    config = from_dict(
        RunConfig,
        {
            "prune": {"hidden_size": 128, "layer_metric": "lm_loss"},
            "distill": {"lm_loss_weight": 0.25, "top_k": 5, "temperature": 2.0},
            "sparsify": {"pattern": "unstructured", "sparsity": 0.7, "method": "magnitude"},
        },
    )
    target = config.prune.target
    assert (target.hidden_size, target.num_hidden_layers, target.layer_metric) == (
        128,
        None,
        "lm_loss",
    )
    options = config.distill.options
    assert (options.kl_weight, options.lm_loss_weight, options.top_k, options.temperature) == (
        0.75,
        0.25,
        5,
        2.0,
    )
    assert config.sparsify.sparsity_config.target_sparsity == pytest.approx(0.7)
    assert RunConfig().distill.options.top_k is None  # 0 = the full vocabulary


def test_loading_a_config_imports_no_training_stack():
    # `leanlm run bad.toml` reports a config error without loading transformers, accelerate or
    # datasets: stage modules import their heavy parts inside `run`
    code = (
        "import sys; from leanlm.config import load_toml, RunConfig; RunConfig(); "
        "print(sorted(m for m in ('transformers', 'accelerate', 'datasets', 'tokenizers') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
