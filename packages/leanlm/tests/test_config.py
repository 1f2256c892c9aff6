import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leanlm import PRESETS, ConfigError, RunConfig, load_toml
from leanlm.cli import main
from leanlm.config import ModelConfig, dumps_toml, from_dict
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
        ({"data": {"source": "web"}}, "data.source", "must be one of"),
        ({"data": 3}, "data", "must be a table"),
        ({"stages": ["pretrain", "quantize"]}, "stages", "unknown stage 'quantize'"),
        ({"stages": []}, "stages", "at least one stage"),
        ({"collective_timeout_s": 0}, "collective_timeout_s", "(0.0) must be a positive number"),
        ({"collective_timeout_s": float("nan")}, "collective_timeout_s", "(nan) must be"),
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
        ({"sparsify": {"steps": -1}}, "sparsify.steps", "must be >= 0"),
    ],
)
def test_bad_values_name_the_key(data, key, text):
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert info.value.key == key
    assert text in str(info.value)
    assert str(info.value).startswith(f"config key `{key}`")


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
