"""The example configs: they load, and the GPU-scale one dry-runs on CPU at tiny sizes."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from leanlm.config import ConfigError, dumps_toml, load_toml

CONFIGS = Path(__file__).parents[1] / "configs"


def _local_hub_dataset(root: Path) -> Path:
    """A folder laid out like a hub dataset (data/<split>-*.parquet) with wikitext's columns."""
    import sysconfig

    (root / "data").mkdir(parents=True)
    source = Path(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py").read_text()
    lines = [line for line in source.splitlines() if line.strip()]
    for split, rows in {"train": lines[:6000], "validation": lines[6000:6600]}.items():
        table = datasets.Dataset.from_dict({"text": rows})
        table.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def _tiny(config, hub_folder, tiny):
    """The same stages, optimizers, precision and data path, at sizes a CPU runs in seconds."""
    train = {
        "steps": 4,
        "micro_batch_size": 2,
        "warmup_steps": 1,
        "eval_every": 4,
        "checkpoint_every": 2,
        "eval_batch_size": 2,
        "log_every": 1,
    }
    return dataclasses.replace(
        config,
        cache_dir=tiny.cache_dir,
        data=dataclasses.replace(
            config.data, hub_name=str(hub_folder), hub_config=None, seq_len=32, eval_windows=4
        ),
        tokenizer=dataclasses.replace(config.tokenizer, vocab_size=384),
        model=tiny.model,  # the shared tiny Llama of conftest.tiny_config
        pretrain=dataclasses.replace(config.pretrain, **train),
        prune=dataclasses.replace(
            config.prune,
            hidden_size=24,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            calibration_samples=4,
            calibration_batch_size=2,
        ),
        distill=dataclasses.replace(config.distill, **train),
        sparsify=dataclasses.replace(
            config.sparsify, **train, calibration_samples=4, calibration_batch_size=2
        ),
    )


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_example_config_loads(path):
    config = load_toml(path)
    assert config.stages[0] == "pretrain" or config.init_model  # else: starts from a checkpoint
    assert config.name == path.stem


def test_gpu_scale_config_dry_runs_on_cpu(tmp_path, tiny_config):
    config = load_toml(CONFIGS / "llama-350m-wikitext.toml")
    assert config.stages == ("pretrain", "prune", "distill", "sparsify")
    assert config.mixed_precision == "bf16"
    assert config.data.source == "hub"
    assert (config.data.hub_name, config.data.hub_config) == ("wikitext", "wikitext-103-raw-v1")
    assert config.prune.hidden_size < config.model.hidden_size  # it shrinks
    folder = _local_hub_dataset(tmp_path / "wikitext-like")
    tiny = _tiny(config, folder, tiny_config())
    (tmp_path / "tiny.toml").write_text(dumps_toml(tiny))
    # A fresh process: accelerate keeps one mixed-precision setting per process (bf16 here).
    cmd = [sys.executable, "-m", "leanlm", "run", str(tmp_path / "tiny.toml")]
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path / "run")],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [
        json.loads((tmp_path / "run" / stage / "result.json").read_text())["metrics"]
        for stage in config.stages
    ]
    for metrics in results:
        assert metrics["val_perplexity"] > 1
    assert results[1]["params"] < results[0]["params"]
    assert results[3]["nonzero_params"] < results[3]["stored_params"]


def test_wrong_key_in_an_example_config_is_named(tmp_path):
    text = (CONFIGS / "llama-350m-wikitext.toml").read_text()
    (tmp_path / "bad.toml").write_text(text.replace("[sparsify]\n", "[sparsify]\npatern = 1\n"))
    with pytest.raises(
        ConfigError, match=r"`sparsify.patern`: unknown key; did you mean `pattern`"
    ):
        load_toml(tmp_path / "bad.toml")


def test_stdlib_full_is_the_default_demo_written_out():
    from leanlm.presets import default

    config = load_toml(CONFIGS / "stdlib-full.toml")
    assert dataclasses.replace(config, name="default") == default()
