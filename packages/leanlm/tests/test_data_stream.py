"""`[data] source = "hub"` over local data files, `streaming` and `packing` (no download)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leanlm.config import (
    ConfigError,
    DataConfig,
    PruneConfig,
    TokenizerConfig,
    dumps_toml,
    from_dict,
    load_toml,
    with_overrides,
)
from leanlm.data import blocks, load_corpus, tokenize_corpus
from leanlm.data.stream import StreamBatches, WindowStream
from leanlm.data.tokenizer import train_tokenizer
from leanlm.run.pipeline import run_pipeline


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """Train / validation jsonl files, text under `content` (not the default column): 400
    documents of many lengths, the top-level blocks of standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size < 20_000]
    split = [b for p in files for b in p.read_text(encoding="utf-8").split("\n\n")]
    texts = [b for b in split if 0 < len(b) < 600][:400]
    assert len(texts) == 400
    folder = tmp_path_factory.mktemp("jsonl")
    for name, rows in (("train.jsonl", texts[:320]), ("val.jsonl", texts[320:])):
        with open(folder / name, "w") as f:
            f.writelines(json.dumps({"content": t, "id": i}) + "\n" for i, t in enumerate(rows))
    return folder, texts


def _data(folder, **changes):
    files = {"train": (str(folder / "train.jsonl"),), "validation": (str(folder / "val.jsonl"),)}
    base = {"source": "hub", "hub_name": "json", "data_files": files, "text_column": "content"}
    return DataConfig(**{**base, "seq_len": 32, **changes})


@pytest.fixture(scope="module")
def tokenizer(jsonl):
    _, texts = jsonl
    return train_tokenizer(iter([texts]), TokenizerConfig(vocab_size=300))


def test_data_files_is_a_toml_table_of_lists():
    data = {"source": "hub", "hub_name": "json", "data_files": {"train": ["a.jsonl"]}}
    assert from_dict(DataConfig, data).data_files == {"train": ("a.jsonl",)}
    with pytest.raises(ConfigError, match=r"`data.data_files.train`: must be a list"):
        from_dict(DataConfig, {**data, "data_files": {"train": "a.jsonl"}}, prefix="data")
    with pytest.raises(ConfigError, match=r"`data.data_files`: must be a table"):
        from_dict(DataConfig, {**data, "data_files": ["a.jsonl"]}, prefix="data")
    with pytest.raises(ConfigError, match=r"`streaming`: is for `source = \"hub\"`"):
        DataConfig(streaming=True)
    # on the command line too, merged key by key into the file's table like any table
    merged = with_overrides({"data": data}, ['data.data_files={validation = ["b.jsonl"]}'])
    both = {"train": ("a.jsonl",), "validation": ("b.jsonl",)}
    assert from_dict(DataConfig, merged["data"]).data_files == both


def test_a_missing_data_file_is_one_line_naming_the_key_and_path(jsonl, tmp_path):
    folder, _ = jsonl
    files = {"train": (str(folder / "train.jsonl"),), "validation": (str(tmp_path / "no.jsonl"),)}
    for streaming in (False, True):
        config = _data(folder, data_files=files, streaming=streaming)
        with pytest.raises(ConfigError) as err:
            load_corpus(config, cache_dir=tmp_path / "cache")
        assert str(err.value) == (
            f"config key `data.data_files`: validation: file not found: {tmp_path / 'no.jsonl'} "
            "(check the path)"
        )
    with pytest.raises(ConfigError, match=r"`data.data_files`: train: file not found: .*\*\.x"):
        load_corpus(
            _data(folder, data_files={"train": (str(tmp_path / "*.x"),)}), cache_dir=tmp_path
        )


def test_json_files_load_with_their_text_column(jsonl, tmp_path):
    folder, texts = jsonl
    corpus = load_corpus(_data(folder), cache_dir=tmp_path / "cache")
    assert corpus.dataset["train"]["text"] == texts[:320]
    assert corpus.dataset["validation"]["text"] == texts[320:]
    stream = load_corpus(_data(folder, streaming=True), cache_dir=tmp_path / "cache")
    assert [row["text"] for row in stream.dataset["validation"]] == texts[320:]


def test_stream_windows_are_the_blocks_of_the_whole_corpus_and_resume_exactly(
    jsonl, tokenizer, tmp_path
):
    folder, _ = jsonl
    config = _data(folder, streaming=True)
    loaded = load_corpus(_data(folder), cache_dir=tmp_path / "cache")
    tokens = tokenize_corpus(loaded, tokenizer, tokenizer_key="t").train
    expected = blocks(tokens, 32)
    n = expected.shape[0]

    def fresh():
        split = load_corpus(config, cache_dir=tmp_path / "cache").dataset["train"]
        return WindowStream(split, tokenizer, 32)

    whole = fresh()
    taken = [whole.take(k) for k in (5, 7, n - 12)]
    assert torch.equal(torch.cat(taken), expected)  # on-the-fly == tokenize all, then cut
    # the stream's ragged tail continues into the next epoch, which starts the text again
    wrapped = whole.take(4)
    assert whole.epoch == 1
    assert 0 < tokens.numel() - n * 32 < 32
    assert torch.equal(wrapped.flatten(), torch.cat([tokens[n * 32 :], tokens])[: 4 * 32])

    # stop after 5, then after 7 more, resuming each time in a new stream: the same windows
    first = fresh()
    assert torch.equal(first.take(5), taken[0])
    second = fresh()
    second.load_state(json.loads(json.dumps(first.state())))  # as a checkpoint stores it
    assert torch.equal(second.take(7), taken[1])
    third = fresh()
    third.load_state(json.loads(json.dumps(second.state())))
    assert torch.equal(third.take(n - 12), taken[2])
    assert torch.equal(third.take(4), wrapped)

    batches = StreamBatches(fresh())
    assert torch.equal(batches.global_batch(0, 5), taken[0])
    with pytest.raises(ValueError, match="no stream position for step 3"):
        StreamBatches(fresh()).load_state({}, 3)


def test_streaming_and_packing_feed_pretrain_only(jsonl, tiny_config):
    folder, _ = jsonl
    for key in ("streaming", "packing"):
        with pytest.raises(ConfigError, match=rf"`data.{key}`: \(true\) is supported for stage"):
            tiny_config(
                data=_data(folder, **{key: True}),
                stages=("pretrain", "prune"),
                prune=PruneConfig(hidden_size=16, intermediate_size=32),
            )


def _losses(run_dir):
    lines = (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, lines)]


def test_streamed_packed_pretrain_resumes_bit_identical(jsonl, tiny_config, tmp_path):
    # the smoke path of issue 28 item 3: local jsonl through `datasets` streaming, packed
    folder, _ = jsonl
    config = tiny_config(
        data=_data(folder, streaming=True, packing=True, eval_windows=4),
        pretrain={"steps": 6, "checkpoint_every": 3, "eval_every": 3},
    )
    toml = tmp_path / "run.toml"
    toml.write_text(dumps_toml(config))
    assert load_toml(toml) == config  # data_files survives the TOML round trip
    full = tmp_path / "full"
    run_pipeline(config, full)
    state = json.loads((full / "pretrain/checkpoints/step-00000003/trainer_state.json").read_text())
    assert state["data"]["step"] == 3
    assert state["data"]["stream"]["offset"] >= 0

    # a run stopped after step 3: its folder as it was then (the checkpoint, no result yet)
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    shutil.rmtree(stopped / "pretrain" / "model")
    (stopped / "pretrain" / "result.json").unlink()
    run_pipeline(config, stopped, resume=True)
    assert _losses(stopped) == _losses(full)
    a = load_file(full / "pretrain/model/model.safetensors")
    b = load_file(stopped / "pretrain/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # packing changes the training itself (positions restart per document, boundary labels)
    unpacked = dataclasses.replace(config, data=dataclasses.replace(config.data, packing=False))
    run_pipeline(unpacked, tmp_path / "unpacked")
    assert _losses(tmp_path / "unpacked")[0][1] != _losses(full)[0][1]


@pytest.mark.distributed
def test_a_stream_resumes_on_two_processes_with_the_same_global_batch(jsonl, tiny_config, tmp_path):
    # one process (2 micro-batches of 2) writes step 3; two processes (1 of 2 each) resume it:
    # each takes its half of the same global batches of the stream, so the losses match
    folder, _ = jsonl
    data = _data(folder, streaming=True, packing=True, eval_windows=4)
    common = {"steps": 6, "checkpoint_every": 3, "eval_every": 3, "micro_batch_size": 2}
    one = tiny_config(data=data, pretrain={**common, "grad_accum_steps": 2})
    two = tiny_config(data=data, pretrain={**common, "grad_accum_steps": 1})
    run_pipeline(one, tmp_path / "one")
    moved = tmp_path / "two"
    shutil.copytree(tmp_path / "one", moved)
    shutil.rmtree(moved / "pretrain" / "model")
    (moved / "pretrain" / "result.json").unlink()
    (tmp_path / "two.toml").write_text(dumps_toml(two))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    command = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "leanlm", "run"]
    command += [str(tmp_path / "two.toml"), "--out", str(moved), "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written on 1 process(es)" in done.stdout + done.stderr
    a, b = _losses(tmp_path / "one"), _losses(moved)
    assert [r[0] for r in a] == [r[0] for r in b]

    def values(rows):
        return torch.tensor([v for r in rows for v in r[1:] if v is not None], dtype=torch.float64)

    torch.testing.assert_close(values(b), values(a), atol=1e-5, rtol=1e-5)
