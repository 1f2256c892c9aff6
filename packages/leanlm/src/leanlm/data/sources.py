"""Corpora: discovery, a fixed train/validation split, loading through `datasets`.

The default corpus needs no network: the source of the running interpreter's standard library
(found with `sysconfig`) plus `pydoc_data/topics.py`, whose ~0.7 MB of English prose keeps the
model from seeing only code. Local text files and hub datasets go through the same path: a
`datasets.DatasetDict` with `train` and `validation` splits and one `text` column (hub datasets
and local data files: `leanlm.data.hub`; with `[data] streaming` the splits are read and
tokenized on demand instead: `leanlm.data.stream`).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Collection
from pathlib import Path

import datasets

from leanlm.config import ConfigError, DataConfig
from leanlm.data.corpus import Corpus, quiet_datasets
from leanlm.data.hub import load_hub

PROSE_FILE = Path("pydoc_data") / "topics.py"
"""The standard library's largest block of English prose (the `help()` topics)."""

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"})


def stdlib_files(*, include_tests: bool = False, root: Path | None = None) -> list[Path]:
    """Python source files of the standard library, `pydoc_data/topics.py` first, then sorted.

    Args:
        include_tests: also take the `test/` package (17 MB of mostly test code).
        root: the standard library directory; default `sysconfig.get_paths()["stdlib"]`.

    Returns:
        Absolute paths in a deterministic order (sorted by path relative to `root`). Installed
        third-party packages (`site-packages`), `idlelib` and `lib2to3` are never included.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = _EXCLUDED_DIRS if include_tests else _EXCLUDED_DIRS | {"test"}
    files = [
        path
        for path in root.rglob("*.py")
        if not excluded.intersection(path.relative_to(root).parts[:-1])
    ]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    prose = root / PROSE_FILE
    if prose in files:
        files.remove(prose)
        files.insert(0, prose)
    return files


def take_bytes(files: list[Path], max_bytes: int) -> list[Path]:
    """Files of `files`, in order, that fit in `max_bytes` together (0 = all).

    A file that would overflow the budget is skipped and later (smaller) ones are still tried,
    so a small budget skips the 0.7 MB prose file instead of ending there. Never empty: if no file
    fits, the smallest one is returned.
    """
    if max_bytes <= 0:
        return list(files)
    taken, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size <= max_bytes:
            taken.append(path)
            total += size
    return taken or [min(files, key=lambda p: p.stat().st_size)]


def split_by_file(
    files: list[Path],
    validation_fraction: float,
    *,
    root: Path | None = None,
    keep_in_train: Collection[Path] = (),
) -> tuple[list[Path], list[Path]]:
    """Split files into (train, validation), whole files on each side.

    Files are ranked by the SHA-256 of their path relative to `root` (their name if no root),
    which depends on neither the machine nor the input order, and taken into validation in that
    rank until they hold `validation_fraction` of the bytes. At least one file lands on each side;
    empty files and `keep_in_train` never go to validation.

    Raises:
        ValueError: if fewer than two files are given.
    """
    if len(files) < 2:
        raise ValueError(f"need at least 2 files to split into train/validation, got {len(files)}")

    def rank(path: Path) -> str:
        name = path.relative_to(root).as_posix() if root else path.name
        return hashlib.sha256(name.encode()).hexdigest()

    sizes = {p: p.stat().st_size for p in files}
    budget = validation_fraction * sum(sizes.values())
    val: list[Path] = []
    held = 0
    kept = set(keep_in_train)
    for path in sorted((p for p in files if sizes[p] > 0 and p not in kept), key=rank):
        if (val and held >= budget) or len(val) == len(files) - 1:
            break
        val.append(path)
        held += sizes[path]
    if not val:
        val = [sorted(files, key=rank)[0]]
    chosen = set(val)
    return [p for p in files if p not in chosen], sorted(val, key=files.index)


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _load_files(train: list[Path], val: list[Path], cache_dir: Path) -> datasets.DatasetDict:
    # One row per file ("document"): keeps line breaks, and EOS then separates files.
    with quiet_datasets():
        return datasets.load_dataset(
            "text",
            data_files={"train": [str(p) for p in train], "validation": [str(p) for p in val]},
            sample_by="document",
            cache_dir=str(cache_dir),
        )


def load_corpus(config: DataConfig, *, cache_dir: Path) -> Corpus:
    """Load the corpus `config` describes as a `datasets.DatasetDict` (train / validation).

    Raises:
        ConfigError: if listed files are missing or the hub dataset lacks a split or column
            (`leanlm.data.hub.load_hub`).
    """
    if config.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = take_bytes(
            stdlib_files(include_tests=config.include_tests, root=root), config.max_bytes
        )
        # The prose file is one 0.7 MB document (most of a 5% validation share on its own):
        # held out, validation would be mostly English while training saw almost none.
        train, val = split_by_file(
            files, config.validation_fraction, root=root, keep_in_train=[root / PROSE_FILE]
        )
        size = sum(p.stat().st_size for p in files)
        return Corpus(
            _load_files(train, val, cache_dir),
            fingerprint=_hash_files(train) + _hash_files(val),
            description=f"CPython {sysconfig.get_python_version()} standard library: "
            f"{len(train)} train / {len(val)} validation files, {size / 1e6:.1f} MB",
        )
    if config.source == "files":
        paths = [Path(f) for f in config.files]
        explicit_val = [Path(f) for f in config.validation_files]
        for key, group in (("data.files", paths), ("data.validation_files", explicit_val)):
            missing = [str(p) for p in group if not p.is_file()]
            if missing:
                raise ConfigError(key, f"files not found: {missing}")
        paths = take_bytes(paths, config.max_bytes)
        if explicit_val:
            train, val = paths, explicit_val
        else:
            train, val = split_by_file(paths, config.validation_fraction)
        return Corpus(
            _load_files(train, val, cache_dir),
            fingerprint=_hash_files(train) + _hash_files(val),
            description=f"{len(train)} train / {len(val)} validation local files",
        )
    return load_hub(config, cache_dir)
