"""Corpora: discovery, a fixed train/validation split, loading through `datasets`, token streams.

The default corpus needs no network: the source of the running interpreter's standard library
(found with `sysconfig`) plus `pydoc_data/topics.py`, whose ~0.7 MB of English prose keeps the
model from seeing only code. Local text files and hub datasets go through the same path: a
`datasets.DatasetDict` with `train` and `validation` splits and one `text` column (hub datasets
and local data files: `leanlm.data_hub`; with `[data] streaming` the splits are read and
tokenized on demand instead: `leanlm.data_stream`).
"""

from __future__ import annotations

import contextlib
import hashlib
import sysconfig
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from leanlm.configio import ConfigError
from leanlm.sections import DataConfig

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


@dataclass(frozen=True)
class Corpus:
    """The text of a run: `dataset` has `train` and `validation` splits with a `text` column.

    With `[data] streaming` the splits are `datasets.IterableDataset`s, read on demand.
    """

    dataset: datasets.DatasetDict | datasets.IterableDatasetDict
    fingerprint: str
    """Identifies the text (content hashes or the `datasets` fingerprints), for caches."""
    description: str
    """One line for logs and reports."""


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No "Downloading data" / "Generating split" bars: local files are not downloaded."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.utils.enable_progress_bars()


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
            (`leanlm.data_hub.load_hub`).
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
    from leanlm.data_hub import load_hub  # it imports this module

    return load_hub(config, cache_dir)


@dataclass(frozen=True)
class TokenStreams:
    """Each split tokenized and concatenated (EOS after every row) into one 1-D int64 tensor."""

    train: torch.Tensor
    validation: torch.Tensor


def tokenize_corpus(corpus: Corpus, tokenizer: Any, *, tokenizer_key: str) -> TokenStreams:
    """Tokenize both splits with `tokenizer` (a fast HF tokenizer), cached by `datasets`.

    The cache entry is named by the corpus and tokenizer fingerprints, so a second run (or a
    second process, after the first) reads the token ids instead of tokenizing again.
    """
    dataset = corpus.dataset
    assert isinstance(dataset, datasets.DatasetDict), "a stream is tokenized by data_stream"
    eos = tokenizer.eos_token_id

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[*row, eos] for row in ids]}

    streams = {}
    for split in ("train", "validation"):
        tokenized = dataset[split].map(
            encode,
            batched=True,
            remove_columns=dataset[split].column_names,
            new_fingerprint=hashlib.sha256(
                f"leanlm:{corpus.fingerprint}:{tokenizer_key}:{split}".encode()
            ).hexdigest()[:32],
            desc=f"tokenizing {split}",
        )
        rows = tokenized.with_format("numpy")["input_ids"]
        flat = np.concatenate(list(rows)) if len(rows) else np.zeros(0, dtype=np.int64)
        streams[split] = torch.from_numpy(flat.astype(np.int64))
    return TokenStreams(train=streams["train"], validation=streams["validation"])


def blocks(stream: torch.Tensor, seq_len: int, *, limit: int = 0) -> torch.Tensor:
    """Cut a token stream into non-overlapping windows `(N, seq_len)`; drops the ragged tail.

    Args:
        stream: 1-D token ids.
        seq_len: window length.
        limit: keep at most this many windows (0 = all).

    Raises:
        ValueError: if the stream is shorter than one window.
    """
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(
            f"a token stream of {stream.numel()} tokens is shorter than one window of "
            f"`data.seq_len` ({seq_len}) tokens; use more data or a shorter seq_len"
        )
    if limit:
        n = min(n, limit)
    return stream[: n * seq_len].view(n, seq_len)


def spread_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` non-overlapping windows `(count, seq_len)` spread evenly over `stream`.

    Evenly spaced (first and last window included) rather than the first `count`, so a
    validation set of many files is scored on all of them, not on whichever comes first.
    `count` = 0 or more windows than the stream holds gives all of them.
    """
    every = blocks(stream, seq_len)
    if not count or count >= every.shape[0]:
        return every
    index = torch.linspace(0, every.shape[0] - 1, count).round().long()
    return every[index]


def selection_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The `count - 1` windows halfway between consecutive `spread_windows(...)` windows.

    Disjoint from every window `spread_windows(stream, seq_len, count)` returns, so a choice
    made on them (a learning rate, a candidate shape) is not made on the windows it is
    reported on.

    Raises:
        ValueError: if `count` < 2 or `stream` holds fewer than `2 * count` windows.
    """
    every = blocks(stream, seq_len)
    if count < 2 or every.shape[0] < 2 * count:
        raise ValueError(
            f"`count` ({count}) must be >= 2 and the stream ({every.shape[0]} windows of "
            f"{seq_len}) must hold at least 2 x count windows for disjoint selection windows"
        )
    test = torch.linspace(0, every.shape[0] - 1, count).round().long()
    return every[(test[:-1] + test[1:]) // 2]


def global_batch_indices(
    step: int, *, global_batch: int, num_blocks: int, seed: int
) -> torch.Tensor:
    """Indices of the training blocks of optimizer step `step` (0-based), shape `(global_batch,)`.

    The order is a fresh permutation of all blocks each epoch, seeded by `(seed, epoch)`, so the
    batch of any step is a pure function of the step: resuming needs only the step number, and
    any number of processes sees the same global batch.
    """
    start = step * global_batch
    out = torch.empty(global_batch, dtype=torch.int64)
    filled = 0
    while filled < global_batch:
        epoch, offset = divmod(start + filled, num_blocks)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_blocks, generator=gen)
        take = min(global_batch - filled, num_blocks - offset)
        out[filled : filled + take] = perm[offset : offset + take]
        filled += take
    return out
