"""A hub dataset given by name counts in the stage hashes by the revision `datasets` reads.

`[data] source = "hub"` with `hub_name` a dataset name loads offline from the datasets cache:
the newest copy prepared there (`datasets` names its folder by the commit it was made from). A
newer revision downloaded into the cache changed the data under a `--resume` without a word;
now its revision is part of the run's data digests (`data-files.json`), so the resume stops
naming the dataset, and an unchanged cache resumes as before.
"""

import dataclasses
import json
import os
import shutil
import sysconfig
from pathlib import Path

import datasets
import pytest

from leanlm.config import ConfigError, DataConfig
from leanlm.run.datafiles import DATA_RECORD
from leanlm.run.pipeline import run_pipeline
from leanlm.run.rundir import ConfigChangedError, check_reuse

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NAME = "leanlm-test/tiny"
OLD, NEW = "a" * 40, "b" * 40  # the commits two revisions of NAME were prepared from


def _documents(name: str) -> list[str]:
    """A standard library file's paragraphs, one document each."""
    text = (STDLIB / name).read_text()
    return [part for part in text.split("\n\n") if part.strip()]


TRAIN, VALIDATION = _documents("argparse.py"), _documents("json/decoder.py")


def _cache_revision(cache: Path, commit: str, train: list[str]) -> None:
    """Put a revision of NAME into the datasets folder `cache` as a download would leave it.

    `datasets` prepares a hub dataset under `<namespace>___<name>/<config>/<version>/<commit>/`;
    offline, `load_dataset(NAME)` reads the most recently modified of those folders (a load
    writes its cache files there too): the new one is made a second newer than the others.
    """
    source = cache.parent / "sources" / commit / "tiny"
    source.mkdir(parents=True)
    for split, rows in (("train", train), ("validation", VALIDATION)):
        lines = "".join(json.dumps({"text": row}) + "\n" for row in rows)
        (source / f"{split}.jsonl").write_text(lines)
    builder = datasets.load_dataset_builder(str(source), cache_dir=str(cache.parent / "staging"))
    builder.download_and_prepare()
    target = cache / "leanlm-test___tiny" / "default" / "0.0.0" / commit
    target.parent.mkdir(parents=True, exist_ok=True)
    newest = max((p.stat().st_mtime for p in target.parent.iterdir()), default=0.0)
    shutil.move(builder.cache_dir, target)
    os.utime(target, (newest + 1, newest + 1))


@pytest.fixture
def offline(monkeypatch):
    """No hub: a dataset name resolves from the datasets cache only."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _hub_config(tiny_config, cache: Path):
    data = DataConfig(source="hub", hub_name=NAME, seq_len=32, eval_windows=8)
    settings = {"steps": 4, "warmup_steps": 1, "eval_every": 4, "checkpoint_every": 2}
    return dataclasses.replace(tiny_config(data=data, pretrain=settings), cache_dir=str(cache))


def test_a_new_revision_of_a_hub_dataset_stops_a_resume_naming_it(
    tiny_config, tmp_path, offline, capsys
):
    config = _hub_config(tiny_config, tmp_path / "cache")
    cache = tmp_path / "cache" / "datasets"  # where the run loads its datasets
    _cache_revision(cache, OLD, TRAIN)
    out = tmp_path / "run"
    first = run_pipeline(config, out)[0]

    # the same cached copy, loaded again: the finished stage is skipped
    capsys.readouterr()
    assert run_pipeline(config, out, resume=True)[0] == first
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out

    # a run killed after its step-2 checkpoint; then a newer revision lands in the cache
    (out / "pretrain" / "result.json").unlink()
    _cache_revision(cache, NEW, [*TRAIN[1:], "one more document"])
    with pytest.raises(ConfigChangedError) as in_run:
        run_pipeline(config, out, resume=True)
    with pytest.raises(ConfigChangedError) as before_run:  # `leanlm run --resume`'s preflight
        check_reuse(out, config, resume=True)
    for err in (in_run, before_run):
        message = str(err.value)
        assert f"in the content of `data.hub_name` (changed: {NAME}); " in message
        assert "resuming would restart pretrain and discard" in message
        assert "Pass --restart-changed" in message
    assert json.loads((out / DATA_RECORD).read_text()) == {"data.hub_name": {NAME: OLD}}

    # --restart-changed trains on the new revision from step 1
    capsys.readouterr()
    again = run_pipeline(config, out, resume=True, restart_changed=True)[0]
    assert "resuming from" not in capsys.readouterr().out
    assert again.config_hash != first.config_hash
    assert json.loads((out / DATA_RECORD).read_text()) == {"data.hub_name": {NAME: NEW}}
    capsys.readouterr()
    assert run_pipeline(config, out, resume=True)[0] == again
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out


def test_hub_revision_is_the_commit_the_loaded_copy_was_made_from(tmp_path, offline):
    from leanlm.data.hub import hub_revision

    cache = tmp_path / "datasets"
    config = DataConfig(source="hub", hub_name=NAME)
    _cache_revision(cache, OLD, TRAIN[:40])
    load = lambda: datasets.load_dataset(NAME, cache_dir=str(cache))["train"]  # noqa: E731
    first = load()
    # read from the cache folder's name, twice the same; the loaded split is that folder's
    assert hub_revision(config, cache) == hub_revision(config, cache) == OLD
    assert first.cache_files[0]["filename"].startswith(str(cache / "leanlm-test___tiny"))
    assert OLD in first.cache_files[0]["filename"]
    assert load()._fingerprint == first._fingerprint

    _cache_revision(cache, NEW, TRAIN[:39])
    assert hub_revision(config, cache) == NEW
    assert load()["text"] == TRAIN[:39]
    assert load()._fingerprint != first._fingerprint

    # local files count by their SHA-256 (`leanlm.run.datafiles.file_digests`), not here
    jsonl = tmp_path / "sources" / OLD / "tiny" / "train.jsonl"
    for local in (
        DataConfig(source="hub", hub_name=str(jsonl.parent)),
        DataConfig(source="hub", hub_name="json", data_files={"train": (str(jsonl),)}),
    ):
        assert hub_revision(local, cache) is None

    with pytest.raises(ConfigError) as err:
        hub_revision(DataConfig(source="hub", hub_name="leanlm-test/not-cached"), cache)
    assert str(err.value).startswith(
        "config key `data.hub_name`: 'leanlm-test/not-cached' could not be loaded (offline: "
        "HF_HUB_OFFLINE or no network, and not in the cache): "
    )
