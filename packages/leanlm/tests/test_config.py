import dataclasses
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leanlm import PRESETS, ConfigError, RunConfig, load_toml
from leanlm.cli import main
from leanlm.config import ModelConfig, PretrainConfig, dumps_toml, from_dict, override
from prune_distill import SearchSpace


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_toml(name, tmp_path):
    config = PRESETS[name]()
    path = tmp_path / "c.toml"
    path.write_text(dumps_toml(config))
    assert load_toml(path) == config


def test_default_preset_is_about_5m_params_with_gqa():
    model = PRESETS["default"]().model
    assert model.num_key_value_heads < model.num_attention_heads


def test_fingerprint_changes_only_with_the_named_sections():
    a = RunConfig()
    b = dataclasses.replace(a, seed=1)
    assert a.fingerprint("model") == b.fingerprint("model")
    assert a.fingerprint("seed") != b.fingerprint("seed")


SEARCH = {"search": True, "search_params": 100_000, "search_hidden_size": [128]}


@pytest.mark.parametrize(
    ("data", "key", "text"),
    [
        ({"sed": 1}, "sed", "did you mean `seed`"),
        ({"model": {"hiden_size": 8}}, "model.hiden_size", "did you mean `hidden_size`"),
        ({"pretrain": {"zzz": 1}}, "pretrain.zzz", "valid keys"),
        ({"seed": "1"}, "seed", "must be int, got str '1'"),
        ({"seed": True}, "seed", "must be int, got bool"),
        ({"pretrain": {"lr": "fast"}}, "pretrain.lr", "must be float"),
        ({"pretrain": {"betas": [0.9]}}, "pretrain.betas", "must have 2 items"),
        ({"pretrain": {"betas": 0.9}}, "pretrain.betas", "must be a list"),
        ({"mixed_precision": "fp8"}, "mixed_precision", "must be one of ['no', 'bf16', 'fp16']"),
        (
            {"mixed_precision": "fp16", "pretrain": {"zero_stage": 2}},
            "pretrain.engine",
            "('zero') cannot train with `mixed_precision = 'fp16'`",
        ),
        (
            {"mixed_precision": "fp16", "pretrain": {"engine": "fsdp2"}},
            "pretrain.engine",
            "('fsdp2') cannot train with `mixed_precision = 'fp16'`",
        ),
        ({"data": {"source": "web"}}, "data.source", "must be one of"),
        ({"data": 3}, "data", "must be a table"),
        ({"stages": ["pretrain", "quantize"]}, "stages", "unknown stage 'quantize'"),
        ({"stages": []}, "stages", "at least one stage"),
        ({"collective_timeout_s": 0}, "collective_timeout_s", "(0.0) must be a positive number"),
        ({"collective_timeout_s": float("nan")}, "collective_timeout_s", "finite number, got nan"),
        ({"collective_timeout_s": "10m"}, "collective_timeout_s", "must be float, got str"),
        (
            {"model": {"hidden_size": 30, "num_attention_heads": 4}},
            "model.num_attention_heads",
            "(4) must divide `hidden_size` (30)",
        ),
        (
            {"model": {"num_attention_heads": 4, "num_key_value_heads": 3}},
            "model.num_key_value_heads",
            "(3) must divide `num_attention_heads` (4)",
        ),
        ({"model": {"num_hidden_layers": 0}}, "model.num_hidden_layers", "must be > 0, got 0"),
        (
            {"model": {"hidden_size": 12, "num_attention_heads": 4}},
            "model.hidden_size",
            "(12) / `num_attention_heads` (4) = 3 dimensions per head, which rotary embeddings "
            "need even: use a `hidden_size` that is a multiple of 8 (e.g. 16)",
        ),
        (
            {"pretrain": {"steps": 10, "warmup_steps": 10}},
            "pretrain.warmup_steps",
            "(10) must be < `steps` (10)",
        ),
        ({"pretrain": {"betas": [0.9, 1.0]}}, "pretrain.betas", "must both be in [0, 1)"),
        ({"tokenizer": {"vocab_size": 100}}, "tokenizer.vocab_size", "must be >= 260"),
        ({"data": {"source": "files"}}, "data.files", "at least one file"),
        ({"data": {"source": "hub"}}, "data.hub_name", "must name a dataset"),
        ({"data": {"validation_fraction": 1.5}}, "data.validation_fraction", "must be in (0, 1)"),
        (
            {"data": {"seq_len": 2048}},
            "model.max_position_embeddings",
            "(1024) must be >= `data.seq_len` (2048)",
        ),
        # stages after pretrain
        ({"stages": ["prune", "distill"]}, "stages", "start with 'pretrain' or set `init_model`"),
        ({"stages": ["prune", "pretrain"], "init_model": "m"}, "stages", "can only come first"),
        (
            {"init_model": "m", "stages": ["distill"], "distill": {"teacher_stage": "x"}},
            "distill.teacher_stage",
            "(or 'init' for `init_model`)",
        ),
        ({"stages": ["pretrain", "pretrain"]}, "stages", "lists a stage twice"),
        (
            {"stages": ["pretrain", "distill"], "distill": {"teacher_stage": "prune"}},
            "distill.teacher_stage",
            "'prune' must be a stage that runs before 'distill'",
        ),
        ({"pretrain": {"optimizer": "lion"}}, "pretrain.optimizer", "must be one of ['came'"),
        (
            {"pretrain": {"optimizer": "adamw", "state_dtype": "int8"}},
            "pretrain.state_dtype",
            "('int8') is for `optimizer = \"came\"`, got optimizer 'adamw'",
        ),
        (
            {"pretrain": {"optimizer": "adafactor", "state_dtype": "bf16"}},
            "pretrain.state_dtype",
            '(`optimizer = "adafactor"` takes "int8" only',
        ),
        ({"pretrain": {"state_dtype": "fp8"}}, "pretrain.state_dtype", "must be one of ['fp32'"),
        ({"pretrain": {"zero_stage": 4}}, "pretrain.zero_stage", "must be one of [0, 1, 2, 3]"),
        ({"pretrain": {"max_bad_steps": -1}}, "pretrain.max_bad_steps", "must be >= 0"),
        (
            {"prune": {"hidden_size": 512}},
            "prune.hidden_size",
            "(512) must be <= `model.hidden_size` (256): pruning only shrinks",
        ),
        (
            {"prune": {"num_attention_heads": 3}},
            "prune.num_attention_heads",
            "(3) must be a multiple of the KV heads kept (2)",
        ),
        ({"prune": {"layer_metric": "random"}}, "prune.layer_metric", "must be one of"),
        # sizes and head grouping are prune-distill's `PruneTarget` checks, named by our key
        ({"prune": {"intermediate_size": -8}}, "prune.intermediate_size", "must be a size >= 1"),
        (
            {"prune": {"num_attention_heads": 6, "num_key_value_heads": 4}},
            "prune.num_key_value_heads",
            "(4) must divide `num_attention_heads` (6)",
        ),
        # [prune] search = true (Minitron's architecture search)
        ({"prune": {"search": True}}, "prune.search_params", "must be > 0 with `search = true`"),
        (
            {"prune": {"search_hidden_size": [128]}},
            "prune.search_hidden_size",
            "is set but `search` is false",
        ),
        (
            {"prune": {"search": True, "search_params": 1000}},
            "prune.search",
            "none of `search_num_hidden_layers`",
        ),
        (
            {"prune": {**SEARCH, "search_intermediate_size": [256, 256]}},
            "prune.search_intermediate_size",
            "([256, 256]) must be distinct sizes >= 1",
        ),
        (
            {"prune": {**SEARCH, "hidden_size": 192}},
            "prune.hidden_size",
            "(192) and `search_hidden_size` ([128]) are both set",
        ),
        (
            {"prune": {**SEARCH, "num_key_value_heads": 1}},
            "prune.num_key_value_heads",
            "cannot be set with `search = true`",
        ),
        (
            {"prune": {**SEARCH, "search_num_hidden_layers": [2, 9]}},
            "prune.search_num_hidden_layers",
            "([2, 9]) must be <= `model.num_hidden_layers` (4): pruning only shrinks",
        ),
        ({"prune": {**SEARCH, "search_tolerance": 1.0}}, "prune.search_tolerance", "in [0, 1)"),
        ({"prune": {**SEARCH, "search_steps": 0}}, "prune.search_steps", "must be > 0"),
        ({"prune": {"search_hidden_size": 128}}, "prune.search_hidden_size", "must be a list"),
        ({"distill": {"lm_loss_weight": 2.0}}, "distill.lm_loss_weight", "must be in [0, 1]"),
        ({"distill": {"temperature": 0}}, "distill.temperature", "(0.0) must be > 0"),
        ({"distill": {"hidden_loss_weight": -1.0}}, "distill.hidden_loss_weight", ">= 0"),
        (
            {"distill": {"teacher_correction_steps": -2}},
            "distill.teacher_correction_steps",
            "must be >= 0 (0 = no correction)",
        ),
        ({"distill": {"teacher_correction_lr": -1e-4}}, "distill.teacher_correction_lr", ">= 0"),
        # sparse-kernels' SparsityConfig checks these; its errors name the [sparsify] key
        ({"sparsify": {"pattern": "4:2"}}, "sparsify.pattern", "'4:2': `n` (4) must satisfy"),
        ({"sparsify": {"pattern": "dense"}}, "sparsify.pattern", "('dense') must be"),
        ({"sparsify": {"method": "random"}}, "sparsify.method", "must be one of"),
        (
            {"sparsify": {"pattern": "unstructured", "sparsity": 1.0}},
            "sparsify.sparsity",
            "(1.0) must be in [0, 1)",
        ),
        ({"sparsify": {"block_size": 0}}, "sparsify.block_size", "(0) must be >= 1"),
        # prune-distill's DistillConfig checks the loss settings
        ({"distill": {"top_k": -1}}, "distill.top_k", "(-1) must be >= 1"),
        (
            {"stages": ["pretrain", "distill"], "distill": {"top_k": 8193}},
            "distill.top_k",
            "(8193) must be <= the vocabulary (8192 tokens, `tokenizer.vocab_size`); 0 distills",
        ),
        ({"sparsify": {"steps": -1}}, "sparsify.steps", "must be >= 0"),
    ],
)
def test_bad_values_name_the_key(data, key, text):
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert info.value.key == key
    assert text in str(info.value)
    assert str(info.value).startswith(f"config key `{key}`")


def _float_keys(cls, prefix=""):
    """(`--set` key, the key an error names) for every float of a config class and its sections:
    each float field, and the last item of a list of floats (set as `[0.5, X]`)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind, key = hints[field.name], f"{prefix}{field.name}"
        if dataclasses.is_dataclass(kind):
            yield from _float_keys(kind, f"{key}.")
        elif kind is float:
            yield key, key
        elif typing.get_origin(kind) is tuple and float in typing.get_args(kind):
            yield f"{key}=[0.5, ", f"{key}[1]"


FLOAT_KEYS = sorted(_float_keys(RunConfig))


def test_every_float_key_is_in_the_non_finite_table():
    named = {named for _, named in FLOAT_KEYS}
    audited = {"pretrain.lr", "pretrain.grad_clip", "pretrain.weight_decay", "distill.beta"}
    audited |= {"model.initializer_range", "model.rope_theta", "distill.teacher_correction_lr"}
    assert audited | {"pretrain.betas[1]", "collective_timeout_s", "sparsify.sparsity"} <= named
    assert len(named) >= 30


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("setting", "key"), FLOAT_KEYS)
def test_non_finite_values_are_refused_naming_the_key(setting, key, value):
    """NaN passed every range check (`value <= 0` is False) and inf most of them."""
    item = f"{setting}{value}]" if setting.endswith(", ") else f"{setting}={value}"
    with pytest.raises(ConfigError) as info:
        override(RunConfig(), [item])
    assert (info.value.key, info.value.message) == (key, f"must be a finite number, got {value}")


def test_non_finite_values_built_in_python_are_refused_naming_the_key():
    sparsify = dataclasses.replace(RunConfig().sparsify, sparsity=float("nan"))  # no own check
    with pytest.raises(ConfigError, match=r"^config key `sparsify.sparsity`: .* got nan$"):
        RunConfig(sparsify=sparsify)
    with pytest.raises(ConfigError, match=r"^config key `lr`: must be a finite number, got nan$"):
        PretrainConfig(lr=float("nan"))


def test_prune_search_round_trips_and_fixed_sizes_are_single_choices(tmp_path):
    prune = {**SEARCH, "search_num_hidden_layers": [2, 3], "intermediate_size": 512}
    config = from_dict(RunConfig, {"prune": prune})
    path = tmp_path / "c.toml"
    path.write_text(dumps_toml(config))
    assert load_toml(path) == config
    assert config.prune.search_space == SearchSpace(
        num_hidden_layers=(2, 3), hidden_size=(128,), intermediate_size=(512,)
    )


def test_int_is_accepted_where_float_is_expected():
    assert from_dict(RunConfig, {"pretrain": {"lr": 1}}).pretrain.lr == 1.0
    assert from_dict(RunConfig, {"collective_timeout_s": 20}).collective_timeout_s == 20.0
    assert RunConfig().collective_timeout_s == 600.0


@given(
    heads=st.integers(1, 8),
    kv_divisor=st.integers(1, 8),
    head_dim=st.integers(1, 16),
)
def test_model_shapes_validate_consistently(heads, kv_divisor, head_dim):
    kwargs = {
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_divisor,
    }
    if heads % kv_divisor:
        with pytest.raises(ConfigError, match="num_key_value_heads"):
            ModelConfig(**kwargs)
    elif head_dim % 2:  # rotary embeddings rotate pairs of dimensions
        with pytest.raises(ConfigError, match=rf"^config key `hidden_size`: .* = {head_dim} dim"):
            ModelConfig(**kwargs)
    else:
        assert ModelConfig(**kwargs).num_key_value_heads == kv_divisor


def test_invalid_toml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seed = = 1")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_toml(path)


def test_cli_reports_bad_config_before_any_work(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\nnum_attention_heads = 3\n")
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config key `model.num_attention_heads`" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["run", "plan"])
def test_cli_reports_a_config_that_is_a_folder_or_not_text_in_one_line(tmp_path, command, capsys):
    """A folder as the config raised IsADirectoryError with a traceback, exit 1."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"seed = 1\n\xff\n")
    for path, says in (
        (tmp_path, "is a directory, not a TOML config file"),
        (binary, "is not UTF-8 text, so not a TOML config: 'utf-8' codec can't decode byte 0xff"),
    ):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"leanlm: error: {path} {says}")
        assert len(err.splitlines()) == 1, err


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out
    assert "run" in out


def test_sparsify_without_fine_tune_needs_no_training_settings():
    config = from_dict(RunConfig, {"sparsify": {"steps": 0, "warmup_steps": 0}})
    assert config.sparsify.steps == 0
    assert from_dict(RunConfig, {"sparsify": {"steps": 0}}).sparsify.warmup_steps == 5


def test_adafactor_int8_state_is_an_8_bit_momentum():
    """`optimizer = "adafactor"`, `state_dtype = "int8"`: momentum β1 = betas[0], int8 codes."""
    import torch

    from leanlm.train.optim import optimizer_over

    cfg = from_dict(RunConfig, {"pretrain": {"optimizer": "adafactor", "state_dtype": "int8"}})
    pre = cfg.pretrain
    w = torch.nn.Parameter(torch.randn(8, 256))
    opt = optimizer_over(pre.optimizer, [w], lr=1e-3, betas=pre.betas, state_dtype=pre.state_dtype)
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.param_groups[0]["beta1"] == pre.betas[0]
    assert opt.state[w]["exp_avg"].dtype == torch.int8
    assert opt.state[w]["exp_avg_scale"].shape == (8, 2)
    fp32 = optimizer_over("adafactor", [w], lr=1e-3, betas=pre.betas)
    assert fp32.param_groups[0]["beta1"] is None  # fp32: no momentum, as before
