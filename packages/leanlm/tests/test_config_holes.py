"""Config values that loaded and were then ignored, or failed only after work: refused at load.

Each case was accepted before: a prune width its heads do not divide (failed after pretrain,
naming no key), `[data]` keys of another `source`, a config whose `stages` is unset with other
stages' sections, a `teacher_stage` naming no stage, a sparsity an N:M pattern contradicts,
`zero_stage = true` / `2.0`, and seeds outside [0, 2**32).
"""

import dataclasses
import itertools

import pytest
import torch
from transformers import LlamaForCausalLM

from leanlm import PRESETS, ConfigError, RunConfig, load_toml
from leanlm.cli import main
from leanlm.config import ModelConfig, dumps_toml, from_dict, override
from leanlm.config.sections import SOURCE_KEYS, DataConfig
from leanlm.train.model import llama_config
from prune_distill import ImportanceScores, PruneTarget, prune


def _refused(data, key, message):
    """`from_dict(RunConfig, data)` raises naming `key` with exactly `message`."""
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert (info.value.key, info.value.message) == (key, message)
    assert str(info.value) == f"config key `{key}`: {message}"


def _write(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- 1. prune sizes the pruned Llama cannot take ------------------------------------------------

GQA = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2}  # 3 per group
MHA = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 6}


@pytest.mark.parametrize(
    ("model", "prune", "key", "message"),
    [
        (
            {},  # the default model: 256 wide, 4 heads
            {"hidden_size": 15},
            "prune.hidden_size",
            "(15) must be a multiple of the attention heads kept (4), as the pruned Llama's "
            "config requires: e.g. 12",
        ),
        (  # the heads kept are the prune target's, not the model's (150 = 25 x 6)
            GQA,
            {"hidden_size": 150, "num_attention_heads": 4},
            "prune.hidden_size",
            "(150) must be a multiple of the attention heads kept (4), as the pruned Llama's "
            "config requires: e.g. 148",
        ),
        (  # the model's width kept, fewer heads; MHA: the KV heads follow the query heads
            MHA,
            {"num_attention_heads": 5},
            "prune.num_attention_heads",
            "(5) must divide the hidden size kept (`model.hidden_size` = 192), as the pruned "
            "Llama's config requires",
        ),
        (
            GQA,
            {"num_key_value_heads": 1},
            "prune.num_key_value_heads",
            "(1) leaves 6 query heads per KV group (6 / 1), more than the model's 3: query "
            "heads are kept within their group; keep at least 2 KV groups or fewer query heads",
        ),
    ],
)
def test_prune_shapes_the_pruned_llama_refuses_name_the_key(model, prune, key, message):
    _refused({"model": model, "prune": prune}, key, message)


def test_prune_heads_of_a_model_without_gqa_are_accepted():
    """The KV heads of an MHA model follow its query heads, as prune-distill prunes them."""
    config = from_dict(RunConfig, {"model": MHA, "prune": {"num_attention_heads": 4}})
    assert config.prune.target.num_attention_heads == 4


def _library_prunes(model_sizes, prune_sizes):
    """Whether prune-distill prunes a Llama of `model_sizes` to `prune_sizes` (its own checks,
    then transformers' `LlamaConfig` of the pruned shape)."""
    model_config = ModelConfig(intermediate_size=32, num_hidden_layers=2, **model_sizes)
    cfg = llama_config(model_config, vocab_size=16, bos_id=0, eos_id=1, pad_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    layers, heads = 2, model_sizes["num_attention_heads"]
    scores = ImportanceScores(
        hidden=torch.rand(model_sizes["hidden_size"]),
        heads=torch.rand(layers, heads),
        neurons=torch.rand(layers, 32),
        block_importance=torch.rand(layers),
        lm_loss_increase=None,
        num_samples=1,
        num_tokens=1,
    )
    try:
        target = PruneTarget(**{k: v or None for k, v in prune_sizes.items()})
        pruned = prune(model, scores, target)
    except ValueError:
        return False
    assert pruned.config.hidden_size == (prune_sizes["hidden_size"] or model_sizes["hidden_size"])
    return True


@pytest.mark.parametrize(
    "model",
    [
        {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2},
        {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4},
        {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 1},
    ],
    ids=["gqa", "mha", "mqa"],
)
def test_prune_rules_accept_exactly_the_shapes_prune_distill_prunes(model):
    """Every shape the config accepts prunes; every one it refuses, prune-distill refuses too
    (before, 15 wide with 4 heads loaded and failed after the whole pretrain stage)."""
    grid = itertools.product((0, 15, 24, 30), (0, 2, 3), (0, 1, 2))
    for hidden, heads, kv in grid:
        sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv}
        refused = ""
        try:
            from_dict(RunConfig, {"model": {**model, "intermediate_size": 32}, "prune": sizes})
        except ConfigError as err:
            refused = err.key
        assert refused in ("", *(f"prune.{k}" for k in sizes))
        accepted = not refused
        sizes["intermediate_size"] = 0
        assert accepted == _library_prunes(model, sizes), (model, sizes)


# --- 2. [data] keys the source does not read ----------------------------------------------------

SAMPLE = {
    "files": ["a.txt"],
    "validation_files": ["b.txt"],
    "include_tests": True,
    "max_bytes": 10,
    "validation_fraction": 0.2,
    "hub_name": "wikitext",
    "data_files": {"train": ["a.jsonl"]},
    "hub_config": "wikitext-103-raw-v1",
    "hub_train_split": "train[:10%]",
    "hub_validation_split": "test",
    "text_column": "body",
    "streaming": True,
}
NEEDS = {"stdlib": {}, "files": {"files": ["a.txt"]}, "hub": {"hub_name": "json"}}
"""What each source needs to load at all."""


def _other_source_cases():
    for key, sources in SOURCE_KEYS.items():
        for source in ("stdlib", "files", "hub"):
            if source not in sources:
                yield key, source


def test_every_source_specific_key_has_a_sample():
    assert set(SAMPLE) == set(SOURCE_KEYS)
    # the keys every source reads are not in the table
    shared = {f.name for f in dataclasses.fields(DataConfig)} - set(SOURCE_KEYS)
    assert shared == {"source", "seq_len", "eval_windows", "packing"}


@pytest.mark.parametrize(("key", "source"), list(_other_source_cases()))
def test_a_data_key_of_another_source_is_refused(key, source):
    data = {**NEEDS[source], "source": source, key: SAMPLE[key]}
    readers = " or ".join(f'`source = "{s}"`' for s in SOURCE_KEYS[key])
    _refused(
        {"data": data},
        f"data.{key}",
        f"is for {readers}, got {SAMPLE[key]!r} with source {source!r}, which ignores it: "
        "remove it",
    )


def test_data_keys_of_the_source_and_defaults_written_out_are_accepted(tmp_path):
    files = {"source": "files", "files": ["a.txt"], "max_bytes": 10, "validation_fraction": 0.2}
    assert from_dict(DataConfig, files).max_bytes == 10
    hub = {"source": "hub", "hub_name": "json", "text_column": "body", "hub_config": "x"}
    assert from_dict(DataConfig, hub).text_column == "body"
    # every key at its default, as `configs/stdlib-full.toml` and a written-out config list them
    written = {"source": "hub", "hub_name": "json", "max_bytes": 0, "validation_fraction": 0.05}
    assert from_dict(DataConfig, {**written, "files": [], "include_tests": False}).hub_name
    config = RunConfig(data=DataConfig(source="hub", hub_name="j"))
    assert load_toml(_write(tmp_path, dumps_toml(config))) == config


def test_validation_fraction_with_explicit_validation_files_is_refused():
    data = {"source": "files", "files": ["a.txt"], "validation_files": ["b.txt"]}
    assert from_dict(DataConfig, data).validation_fraction == 0.05
    _refused(
        {"data": {**data, "validation_fraction": 0.1}},
        "data.validation_fraction",
        "(0.1) splits `files` when `validation_files` is empty; with `validation_files` set it "
        "is not used: remove it",
    )


def test_cli_refuses_data_files_of_another_source_before_any_work(tmp_path, capsys):
    """`--set data.files=[...]` with the default source trained on the stdlib corpus."""
    path = _write(tmp_path, "[pretrain]\nlr = 1e-3\n")
    out = tmp_path / "out"
    code = main(["run", str(path), "--out", str(out), "--set", 'data.files=["corpus.py"]'])
    assert code == 2
    err = capsys.readouterr().err
    assert err == (
        'leanlm: error: config key `data.files`: is for `source = "files"`, got '
        "['corpus.py'] with source 'stdlib', which ignores it: remove it\n"
    )
    assert not out.exists()


# --- 3. sections of stages that would not run ---------------------------------------------------

SECTIONS = "[pretrain]\nlr = 1e-3\n[prune]\nhidden_size = 128\n[distill]\ntemperature = 2.0\n"


def test_stage_sections_without_stages_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_toml(_write(tmp_path, SECTIONS + "[control]\nlr = 1e-3\n"))
    assert info.value.key == "stages"
    assert info.value.message == (
        "is not set, so only ['pretrain'] runs, but the config has [prune], [distill], "
        "[control], which would be ignored: list the stages to run, e.g. "
        '`stages = ["pretrain", "prune", "distill", "control"]`, or remove those sections'
    )
    # a stage's key set on the command line is a section too
    path = _write(tmp_path, "[pretrain]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"has \[sparsify\], .* or remove that section$"):
        load_toml(path, overrides=["sparsify.calibration_samples=8"])


def test_stage_sections_with_stages_set_are_accepted(tmp_path):
    """A written-out config has every section, and `--set stages=...` narrows a pipeline (the
    documented `leanlm demo --set 'stages=["pretrain"]'`)."""
    listed = load_toml(_write(tmp_path, 'stages = ["pretrain", "prune", "distill"]\n' + SECTIONS))
    assert (listed.stages, listed.prune.hidden_size) == (("pretrain", "prune", "distill"), 128)
    narrowed = load_toml(_write(tmp_path, SECTIONS), overrides=['stages=["pretrain"]'])
    assert narrowed.stages == ("pretrain",)
    assert override(PRESETS["smoke"](), ['stages=["pretrain"]']).stages == ("pretrain",)
    assert load_toml(_write(tmp_path, "[pretrain]\nlr = 1e-3\n")).stages == ("pretrain",)
    # [optim] / [parallel] fill every training stage's section: they are not stage sections
    shared = load_toml(_write(tmp_path, "[parallel]\nzero_stage = 2\n[optim]\nlr = 1e-3\n"))
    assert (shared.stages, shared.distill.zero_stage) == (("pretrain",), 2)


def test_cli_refuses_a_full_pipeline_without_stages_before_any_work(tmp_path, capsys):
    """Before: pretrain ran alone and the run exited 0."""
    out = tmp_path / "out"
    assert main(["run", str(_write(tmp_path, SECTIONS)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leanlm: error: config key `stages`: is not set, so only ['pretrain']")
    assert not out.exists()


@pytest.mark.parametrize("stages", [["pretrain"], ["pretrain", "prune"]])
def test_a_teacher_stage_naming_no_stage_is_refused_even_unlisted(stages):
    _refused(
        {"stages": stages, "distill": {"teacher_stage": "bogus"}},
        "distill.teacher_stage",
        "('bogus') names no stage: use one of ['pretrain', 'prune', 'distill', 'sparsify', "
        "'control'] that runs before 'distill' (or 'init' for `init_model`)",
    )
    assert from_dict(RunConfig, {"stages": stages, "distill": {"teacher_stage": "prune"}})


# --- 4. sparsity against an N:M pattern ---------------------------------------------------------


@pytest.mark.parametrize(
    ("sparsify", "message"),
    [
        (
            {"sparsity": 0.9},
            "(0.9) disagrees with `pattern` ('2:4'), which prunes 1 - 2/4 = 0.5 of the weights: "
            "remove `sparsity` (or set it to 0.5)",
        ),
        (
            {"pattern": "1:3", "sparsity": 0.6},
            "(0.6) disagrees with `pattern` ('1:3'), which prunes 1 - 1/3 = 0.666667 of the "
            "weights: remove `sparsity` (or set it to 0.666667)",
        ),
        ({"sparsity": 1.5}, "(1.5) must be in [0, 1)"),
        ({"pattern": "1:4", "sparsity": -0.25}, "(-0.25) must be in [0, 1)"),
    ],
)
def test_a_sparsity_an_nm_pattern_contradicts_is_refused(sparsify, message):
    _refused({"sparsify": sparsify}, "sparsify.sparsity", message)


def test_nm_sparsity_left_at_its_default_or_equal_to_the_pattern_is_accepted():
    for sparsify, zeros in (
        ({"pattern": "1:4"}, 0.75),  # the default 0.5 stands for "not set"
        ({"pattern": "1:4", "sparsity": 0.75}, 0.75),
        ({"pattern": "1:3", "sparsity": 0.666667}, 1 - 1 / 3),  # as the message prints it
        ({"pattern": "unstructured", "sparsity": 0.7}, 0.7),
    ):
        config = from_dict(RunConfig, {"sparsify": sparsify})
        assert config.sparsify.sparsity_config.target_sparsity == pytest.approx(zeros)


# --- 5. ints given as bools or floats -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("[pretrain]\nzero_stage = true\n", "pretrain.zero_stage", "got bool True"),
        ("[pretrain]\nzero_stage = 2.0\n", "pretrain.zero_stage", "got float 2.0"),
        ("[parallel]\nzero_stage = true\n", "parallel.zero_stage", "got bool True"),
    ],
)
def test_a_literal_int_must_be_an_int(tmp_path, text, key, message):
    with pytest.raises(ConfigError) as info:
        load_toml(_write(tmp_path, text))
    assert (info.value.key, info.value.message) == (key, f"must be one of [0, 1, 2, 3], {message}")


def test_literal_values_keep_their_type(tmp_path):
    config = load_toml(_write(tmp_path, "[pretrain]\nzero_stage = 2\n"))
    assert type(config.pretrain.zero_stage) is int
    assert config.pretrain.zero_stage == 2
    # and a bool choice takes a bool, not 1
    data = {"init_model": "m", "stages": ["sparsify"], "sparsify": {"pattern": "block"}}
    data["sparsify"]["block_sparse_layers"] = 1
    with pytest.raises(ConfigError, match=r"must be one of \['auto', True, False\], got int 1$"):
        from_dict(RunConfig, data)
    data["sparsify"]["block_sparse_layers"] = True
    assert from_dict(RunConfig, data).sparsify.block_sparse_layers is True


# --- 6. seeds torch would fold onto smaller ones ------------------------------------------------


@pytest.mark.parametrize(("seed", "same"), [(2**32, 0), (2**32 + 7, 7), (-1, 2**32 - 1)])
def test_a_seed_outside_32_bits_is_refused(seed, same):
    message = (
        f"({seed}) must be in [0, 2**32) (0 to 4294967295): torch's CPU generator keeps only "
        f"the low 32 bits, so it would repeat the run of seed {same}"
    )
    _refused({"seed": seed}, "seed", message)
    with pytest.raises(ConfigError, match=r"^config key `seed`: "):
        RunConfig(seed=seed)  # built in Python too
    # what the message says: torch draws the same numbers for both
    draws = [torch.rand(4, generator=torch.Generator().manual_seed(s)) for s in (seed, same)]
    assert torch.equal(*draws)


def test_seeds_in_32_bits_are_accepted():
    assert from_dict(RunConfig, {"seed": 2**32 - 1}).seed == 2**32 - 1
    assert dataclasses.replace(RunConfig(), seed=0).seed == 0
