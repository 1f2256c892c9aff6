import sysconfig
from pathlib import Path

import datasets
import pytest
import torch

from leanlm.config import ConfigError, DataConfig
from leanlm.data import (
    PROSE_FILE,
    blocks,
    global_batch_indices,
    load_corpus,
    split_by_file,
    stdlib_files,
    take_bytes,
)


def _touch(root: Path, rel: str, text: str = "x = 1\n") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_stdlib_discovery_order_and_exclusions(tmp_path):
    for rel in [
        "b.py",
        "a.py",
        "pkg/z.py",
        "test/test_a.py",
        "site-packages/third.py",
        "idlelib/x.py",
        "pydoc_data/topics.py",
        "pkg/__pycache__/c.py",
        "notes.txt",
    ]:
        _touch(tmp_path, rel)
    rel = [p.relative_to(tmp_path).as_posix() for p in stdlib_files(root=tmp_path)]
    assert rel == ["pydoc_data/topics.py", "a.py", "b.py", "pkg/z.py"]
    with_tests = [
        p.relative_to(tmp_path).as_posix() for p in stdlib_files(root=tmp_path, include_tests=True)
    ]
    assert "test/test_a.py" in with_tests
    assert "site-packages/third.py" not in with_tests


def test_real_stdlib_is_found_without_tests_or_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert files[0] == root / PROSE_FILE
    assert len(files) > 300
    rel = [f.relative_to(root).parts for f in files]
    assert not any("test" in parts[:-1] or "site-packages" in parts for parts in rel)
    assert files == stdlib_files()  # deterministic


def test_split_by_file_holds_out_a_byte_fraction_deterministically(tmp_path):
    files = [_touch(tmp_path, f"m{i}.py", "x" * (10 + i)) for i in range(200)]
    train, val = split_by_file(files, 0.1, root=tmp_path)
    assert set(train) | set(val) == set(files)
    assert not set(train) & set(val)
    val_bytes = sum(p.stat().st_size for p in val)
    total = sum(p.stat().st_size for p in files)
    assert 0.1 * total <= val_bytes < 0.1 * total + 210  # overshoots by less than one file
    # Neither the input order nor the machine (absolute path) changes the split.
    _, val2 = split_by_file(files[::-1], 0.1, root=tmp_path)
    assert set(val2) == set(val)
    moved = tmp_path / "elsewhere"
    copies = [_touch(moved, p.name, p.read_text()) for p in files]
    assert {p.name for p in split_by_file(copies, 0.1, root=moved)[1]} == {p.name for p in val}


def test_empty_files_are_not_held_out(tmp_path):
    files = [_touch(tmp_path, f"e{i}.py", "") for i in range(20)] + [
        _touch(tmp_path, "a.py"),
        _touch(tmp_path, "b.py"),
    ]
    _, val = split_by_file(files, 0.3, root=tmp_path)
    assert len(val) == 1
    assert val[0].stat().st_size > 0


def test_split_always_holds_out_one_file_and_keeps_one(tmp_path):
    files = [_touch(tmp_path, f"m{i}.py") for i in range(2)]
    train, val = split_by_file(files, 0.01, root=tmp_path)
    assert len(train) == 1
    assert len(val) == 1
    with pytest.raises(ValueError, match="at least 2 files"):
        split_by_file(files[:1], 0.5)


def test_take_bytes(tmp_path):
    files = [_touch(tmp_path, f"f{i}.py", "x" * size) for i, size in enumerate([100, 300, 100, 50])]
    assert take_bytes(files, 0) == files
    assert take_bytes(files, 250) == [files[0], files[2], files[3]]  # the 300-byte file is skipped
    assert take_bytes(files, 10) == [files[3]]  # never empty: the smallest file


def test_local_files_corpus(tmp_path):
    train = [_touch(tmp_path, f"t{i}.txt", f"document {i}\nsecond line\n") for i in range(3)]
    val = [_touch(tmp_path, "v.txt", "held out\n")]
    config = DataConfig(
        source="files", files=tuple(map(str, train)), validation_files=(str(val[0]),)
    )
    corpus = load_corpus(config, cache_dir=tmp_path / "cache")
    assert corpus.dataset["train"]["text"] == [f"document {i}\nsecond line\n" for i in range(3)]
    assert corpus.dataset["validation"]["text"] == ["held out\n"]


def test_missing_local_file_names_the_key(tmp_path):
    config = DataConfig(source="files", files=(str(tmp_path / "nope.txt"),))
    with pytest.raises(ConfigError, match=r"data.files.*nope.txt"):
        load_corpus(config, cache_dir=tmp_path)


def _local_hub_dataset(root: Path) -> Path:
    """A dataset folder as the hub serves it (data/<split>-*.parquet), loaded offline."""
    (root / "data").mkdir(parents=True)
    for split, rows in {
        "train": ["alpha beta", "gamma"],
        "validation": ["delta"],
        "test": ["eps"],
    }.items():
        table = datasets.Dataset.from_dict({"content": rows, "id": list(range(len(rows)))})
        table.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def test_hub_path_with_a_local_dataset_folder(tmp_path):
    folder = _local_hub_dataset(tmp_path / "ds")
    config = DataConfig(source="hub", hub_name=str(folder), text_column="content")
    corpus = load_corpus(config, cache_dir=tmp_path / "cache")
    assert corpus.dataset["train"]["text"] == ["alpha beta", "gamma"]
    assert corpus.dataset["validation"].column_names == ["text"]
    config_test = DataConfig(
        source="hub", hub_name=str(folder), text_column="content", hub_validation_split="test"
    )
    assert load_corpus(config_test, cache_dir=tmp_path / "cache").dataset["validation"]["text"] == [
        "eps"
    ]


def test_hub_errors_name_the_key(tmp_path):
    folder = _local_hub_dataset(tmp_path / "ds")
    with pytest.raises(ConfigError, match=r"data.text_column.*columns: \['content', 'id'\]"):
        load_corpus(DataConfig(source="hub", hub_name=str(folder)), cache_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match=r"data.hub_validation_split.*no split 'dev'"):
        load_corpus(
            DataConfig(
                source="hub",
                hub_name=str(folder),
                text_column="content",
                hub_validation_split="dev",
            ),
            cache_dir=tmp_path / "c",
        )


def test_blocks():
    stream = torch.arange(10)
    assert blocks(stream, 3).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert blocks(stream, 3, limit=2).shape == (2, 3)
    with pytest.raises(ValueError, match="shorter than one window"):
        blocks(stream, 11)


def test_global_batches_cover_each_epoch_once_and_are_deterministic():
    n, g = 10, 4
    seen = torch.cat(
        [global_batch_indices(s, global_batch=g, num_blocks=n, seed=3) for s in range(5)]
    )
    assert sorted(seen[:10].tolist()) == list(range(10))  # epoch 0 is a permutation
    assert sorted(seen[10:20].tolist()) == list(range(10))  # so is epoch 1 (crossing step 2)
    assert not torch.equal(seen[:10], seen[10:20])
    again = global_batch_indices(3, global_batch=g, num_blocks=n, seed=3)
    assert torch.equal(again, seen[12:16])
    other_seed = global_batch_indices(0, global_batch=g, num_blocks=n, seed=4)
    assert not torch.equal(other_seed, seen[:4])
