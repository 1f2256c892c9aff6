"""A bad `init_model` folder stops `leanlm run` with one line naming the path and what is
missing, before any work."""

import json

import pytest

from leanlm.cli import main
from leanlm.config import dumps_toml

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def _folder(root, name, config, files=()):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    for file, text in files:
        (folder / file).write_text(text)
    return folder


def _cases(tmp_path):
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    shards = _folder(
        tmp_path,
        "half",
        LLAMA,
        [
            ("model.safetensors.index.json", json.dumps(index)),
            ("model-00001-of-00002.safetensors", ""),
        ],
    )
    no_weights = _folder(tmp_path, "no-weights", LLAMA)
    foreign = _folder(
        tmp_path, "foreign", {"architectures": ["FooForCausalLM"], "model_type": "foo"}
    )
    missing = tmp_path / "nowhere" / "model"
    return [
        (missing, f"{str(missing)!r} does not exist"),
        (
            shards,
            f"{shards} lacks 1 of the 2 weight shards its model.safetensors.index.json "
            "lists: model-00002-of-00002.safetensors",
        ),
        (no_weights, f"{no_weights} has no weights (model.safetensors"),
        (
            foreign,
            f"{str(foreign)!r} holds an unsupported architecture (FooForCausalLM, "
            "model_type 'foo')",
        ),
    ]


@pytest.mark.parametrize("case", range(4), ids=["missing", "shard", "no-weights", "architecture"])
def test_a_bad_init_model_stops_the_run_in_one_line(case, tmp_path, tiny_config, capsys):
    folder, says = _cases(tmp_path)[case]
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(tiny_config(stages=("prune",), init_model=str(folder))))
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "`init_model`" in err
    assert says in err
    assert not (tmp_path / "out" / "prune").exists()
