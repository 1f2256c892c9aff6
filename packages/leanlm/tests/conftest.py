import dataclasses
import hashlib
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from filelock import FileLock

from leanlm.config import (
    DataConfig,
    DistillConfig,
    ModelConfig,
    PretrainConfig,
    PruneConfig,
    RunConfig,
    TokenizerConfig,
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer / datasets cache for the whole session (tokenizers train once)."""
    return tmp_path_factory.mktemp("leanlm-cache")


@pytest.fixture(scope="session")
def tiny_config(cache_dir):
    """A run that trains a ~40k-parameter Llama for a few seconds; `**changes` per section."""

    def make(*, pretrain=None, **changes):
        # sections other than `pretrain` are passed as whole config objects
        base = RunConfig(
            name="tiny",
            cache_dir=str(cache_dir),
            data=DataConfig(max_bytes=400_000, seq_len=32, eval_windows=8),
            tokenizer=TokenizerConfig(vocab_size=512),
            model=ModelConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            ),
            pretrain=PretrainConfig(
                steps=12,
                micro_batch_size=4,
                warmup_steps=2,
                eval_every=6,
                checkpoint_every=6,
                eval_batch_size=4,
            ),
        )
        if pretrain:
            changes["pretrain"] = dataclasses.replace(base.pretrain, **pretrain)
        return dataclasses.replace(base, **changes)

    return make


#: The Python standard library's folder: its sources are the local text of `files_config`.
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="session")
def files_config(tiny_config):
    """The tiny run on local copies of a few standard library files (`source = "files"`).

    `make(folder, validation_text=None, **pretrain)` copies four modules as training files and
    json's decoder (or writes `validation_text`) as the validation file into `folder`.
    """

    def make(folder: Path, *, validation_text: str | None = None, **pretrain):
        folder.mkdir(parents=True, exist_ok=True)
        names = ["argparse.py", "ast.py", "inspect.py", "typing.py"]
        train = [shutil.copy(STDLIB / name, folder / f"{name}.txt") for name in names]
        val = folder / "val.txt"
        if validation_text is None:
            shutil.copy(STDLIB / "json" / "decoder.py", val)
        else:
            val.write_text(validation_text)
        data = DataConfig(
            source="files",
            files=tuple(map(str, train)),
            validation_files=(str(val),),
            seq_len=32,
            eval_windows=8,
        )
        settings = {"steps": 4, "warmup_steps": 1, "eval_every": 4, "checkpoint_every": 2}
        return tiny_config(data=data, pretrain=settings | pretrain)

    return make


@pytest.fixture(scope="session")
def tiny_search():
    """A `[prune]` architecture search over shapes of the tiny model; `**changes` on top."""

    def make(**changes):
        space = {
            "search_hidden_size": (16, 24, 32),
            "search_intermediate_size": (32, 64),
            "search_num_hidden_layers": (1, 2),
            "search_tolerance": 0.1,
            "search_batch_size": 4,
            "calibration_samples": 16,
        }
        return PruneConfig(search=True, **{**space, **changes})

    return make


class Pretrained(NamedTuple):
    config: RunConfig  # the config it was pretrained with
    model: Path  # its fp32 model folder (with the tokenizer)
    bf16: Path  # the same weights saved in bf16 with the tokenizer, like a hub checkpoint


@pytest.fixture(scope="session")
def shared_folder(tmp_path_factory):
    """`shared_folder(name, build)`: a folder that `build(folder)` fills once per test session,
    once for all pytest-xdist workers too (the first to ask builds it under a file lock, the
    others wait and read it). Shared: tests read it and copy it to change it, never write it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's folder, above the workers' own
    root = root / "shared"
    root.mkdir(exist_ok=True)

    def get(name: str, build: Callable[[Path], object]) -> Path:
        folder, done = root / name, root / f"{name}.done"
        with FileLock(root / f"{name}.lock"):
            if not done.exists():  # not built, or its builder failed: (re)build it here
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                done.touch()
        return folder

    return get


@pytest.fixture(scope="session")
def reference_run(shared_folder):
    """`reference_run(config)`: the folder of `leanlm run` of `config` on 1 process, run once
    per test session for every test that asks for the same config (on any xdist worker): the
    uninterrupted 1-process runs that multi-process runs are compared with. Shared: read it,
    copy it to change it."""
    from leanlm.config import dumps_toml
    from leanlm_testing.cli_runs import run_leanlm

    def get(config: RunConfig) -> Path:
        toml = dumps_toml(config)

        def build(folder):
            (folder / "run.toml").write_text(toml)
            done = run_leanlm("run", folder / "run.toml", "--out", folder / "run")
            assert done.returncode == 0, done.stderr[-3000:]

        name = f"run-{hashlib.sha256(toml.encode()).hexdigest()[:16]}"
        return shared_folder(name, build) / "run"

    return get


@pytest.fixture(scope="session")
def tiny_pretrained(shared_folder, tiny_config):
    """A tiny model pretrained for 6 steps, as an `init_model`. Shared: read it, never write it."""
    import torch
    from transformers import AutoTokenizer

    from leanlm.run.pipeline import run_pipeline
    from leanlm.train.model import load_model

    config = tiny_config(pretrain={"steps": 6, "warmup_steps": 1, "checkpoint_every": 0})

    def build(out):
        run_pipeline(config, out)
        model = out / "pretrain" / "model"
        load_model(model).to(torch.bfloat16).save_pretrained(out / "bf16")
        AutoTokenizer.from_pretrained(model).save_pretrained(out / "bf16")

    out = shared_folder("pretrained", build)
    return Pretrained(config, out / "pretrain" / "model", out / "bf16")


@pytest.fixture(scope="session")
def prune_distill_config(tiny_pretrained):
    """`prune` (to hidden 16, MLP 32) then `distill` from `init_model` (default: the fp32
    `tiny_pretrained`), taught by it; `**distill` on top of a 2-step `[distill]`."""

    def make(init_model=None, **distill):
        settings = {
            "teacher_stage": "init",
            "steps": 2,
            "micro_batch_size": 4,
            "warmup_steps": 1,
            "eval_every": 2,
            "eval_batch_size": 4,
            "checkpoint_every": 0,
        }
        return dataclasses.replace(
            tiny_pretrained.config,
            init_model=str(init_model or tiny_pretrained.model),
            stages=("prune", "distill"),
            prune=PruneConfig(hidden_size=16, intermediate_size=32, calibration_samples=8),
            distill=DistillConfig(**(settings | distill)),
        )

    return make
