"""`[data] source = "hub"`: a `datasets.load_dataset` name, local folder or local data files.

With `data_files` the builder named by `hub_name` (`json`, `parquet`, `text`, `csv`) reads local
files, e.g. `hub_name = "json"` with `data_files = {train = ["a.jsonl"], validation = ["b.jsonl"]}`.
With `streaming` the splits are `datasets.IterableDataset`s read on demand (`leanlm.data.stream`
tokenizes them on the fly); otherwise they are loaded, cached and tokenized whole. A dataset
given by name is identified by its revision (`hub_revision`), part of the stage hashes
(`leanlm.run.datafiles`).
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path
from typing import Any

import datasets

from leanlm.config import ConfigError, DataConfig
from leanlm.data.corpus import Corpus, quiet_datasets


def check_data_files(data_files: dict[str, tuple[str, ...]]) -> list[Path]:
    """Every file `data_files` names (glob patterns expanded), in order.

    Raises:
        ConfigError: naming `data.data_files` and the first path (or pattern) that is missing.
    """
    found: list[Path] = []
    for split, patterns in data_files.items():
        for pattern in patterns:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
            missing = [m for m in matches if not Path(m).is_file()] if matches else [pattern]
            if missing:
                raise ConfigError(
                    "data.data_files", f"{split}: file not found: {missing[0]} (check the path)"
                )
            found.extend(Path(m) for m in matches)
    return found


def _files_fingerprint(files: list[Path]) -> str:
    """Names, sizes and modification times: identifies local files without reading them."""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def _load_kwargs(config: DataConfig, cache_dir: Path) -> dict[str, Any]:
    """`datasets.load_dataset`'s keyword arguments besides `streaming` (the builder's too)."""
    kwargs: dict[str, Any] = {"cache_dir": str(cache_dir)}
    if config.data_files:
        kwargs["data_files"] = {k: list(v) for k, v in config.data_files.items()}
    return kwargs


def _not_loaded(config: DataConfig, err: Exception) -> ConfigError:
    """The error for a dataset `datasets` cannot resolve (not found, offline and not cached)."""
    offline = " (offline: HF_HUB_OFFLINE or no network, and not in the cache)"
    why = (str(err).splitlines() or [type(err).__name__])[0]
    return ConfigError(
        "data.hub_name",
        f"{config.hub_name!r} could not be loaded"
        f"{offline if datasets.config.HF_HUB_OFFLINE else ''}: {why}",
    )


def hub_revision(config: DataConfig, cache_dir: Path) -> str | None:
    """The revision of the dataset `load_hub` reads when `hub_name` names one, not its files.

    That is the `hash` of the `datasets` builder that `load_dataset` resolves the name to, found
    without reading any data: the commit of the dataset's hub repository when the hub answers,
    else (offline) the commit the newest copy prepared in `cache_dir` was made from (`datasets`
    names its cache folders by it, and the loaded splits' `_fingerprint` is a hash of that
    folder's path). A new revision downloaded into the cache changes it; loading the same cached
    copy again does not.

    Returns:
        None when `hub_name` is a local file or folder, or a `datasets` builder for local files
        (`json`, `parquet`, `text`, `csv`, ...): `leanlm.run.datafiles` digests their files.

    Raises:
        ConfigError: naming `data.hub_name`, as `load_hub`, when the name cannot be resolved.
    """
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    name = config.hub_name
    if config.source != "hub" or Path(name).exists() or name in _PACKAGED_DATASETS_MODULES:
        return None
    try:
        with quiet_datasets():
            builder = datasets.load_dataset_builder(
                name, config.hub_config, **_load_kwargs(config, cache_dir)
            )
    except (ConnectionError, OSError, ValueError) as err:
        raise _not_loaded(config, err) from err
    return builder.hash if isinstance(builder.hash, str) else None


def load_hub(config: DataConfig, cache_dir: Path) -> Corpus:
    """The `train` / `validation` splits of a `datasets` dataset, one `text` column each.

    Raises:
        ConfigError: a data file is missing, or the dataset cannot be loaded or lacks a split or
            the text column.
    """
    files = check_data_files(config.data_files)
    kwargs = {**_load_kwargs(config, cache_dir), "streaming": config.streaming}
    try:
        with quiet_datasets():
            loaded = datasets.load_dataset(config.hub_name, config.hub_config, **kwargs)
    except (ConnectionError, OSError, ValueError) as err:  # not found, offline and not cached
        raise _not_loaded(config, err) from err
    splits = {"train": config.hub_train_split, "validation": config.hub_validation_split}
    out = {}
    for ours, theirs in splits.items():
        if theirs not in loaded:
            raise ConfigError(
                f"data.hub_{ours}_split",
                f"{config.hub_name!r} has no split {theirs!r}; it has {sorted(loaded)}",
            )
        split = loaded[theirs]
        # a stream of files without a schema (`text`) knows its columns after one row
        columns = split.column_names
        if columns is None:
            columns = list(next(iter(split), {}))
        if config.text_column not in columns:
            raise ConfigError(
                "data.text_column",
                f"{config.hub_name!r} split {theirs!r} has no column {config.text_column!r}; "
                f"columns: {columns}",
            )
        split = split.select_columns([config.text_column])
        if config.text_column != "text":
            split = split.rename_column(config.text_column, "text")
        out[ours] = split
    name = config.hub_name + (f"/{config.hub_config}" if config.hub_config else "")
    if config.streaming:
        key = f"{name}:{_files_fingerprint(files) if files else ''}"
        return Corpus(
            datasets.IterableDatasetDict(out),
            fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
            description=f"{name} (streaming)",
        )
    dataset = datasets.DatasetDict(out)
    return Corpus(
        dataset,
        fingerprint=hashlib.sha256(
            "".join(dataset[s]._fingerprint for s in ("train", "validation")).encode()
        ).hexdigest()[:16],
        description=f"{name}: {len(dataset['train'])} train / {len(dataset['validation'])} "
        "validation rows",
    )
