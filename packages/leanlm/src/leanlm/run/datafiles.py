"""The content of a run's data: the SHA-256 of every local file its `[data]` section reads.

The stage hashes (`leanlm.run.rundir.stage_hash`) take `data_fingerprint` of these digests, so
a data file edited between a run and its `--resume` changes every stage's hash, like a changed
config key: the tokenizer is trained on that text, and the stages on its token ids. A hub
dataset given by name (`[data] source = "hub"`, `hub_name` neither a local path nor a builder
for local files) counts by its revision instead (`data_digests`): a newer copy downloaded into
the datasets cache changes the hashes the same way. The run keeps the digests in `DATA_RECORD`
so that `--resume` can name the files, or the dataset, that changed.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from leanlm.config import ConfigError, DataConfig, RunConfig

DATA_RECORD = "data-files.json"
"""In the run folder: the SHA-256 of each data file the run read, by config key and path (and
the revision of a hub dataset given by name, under `data.hub_name`)."""

Digests = dict[str, dict[str, str]]
"""`{config key: {path: SHA-256 hex}}` of the files named by (or found through) that key;
`{"data.hub_name": {name: revision}}` for a hub dataset given by name."""


def data_files(config: DataConfig) -> dict[str, list[Path]]:
    """The local files the corpus of `config` reads, by the config key that names them.

    `stdlib`: the standard library files `max_bytes` selects (key `data.source`); `files`: the
    files of `data.files` that `max_bytes` selects and `data.validation_files`; `hub`: the files
    of `data.data_files` (patterns expanded) and, when `data.hub_name` is a local file or
    folder, the files in it. A dataset given by name counts by its revision instead
    (`data_digests`).

    Raises:
        ConfigError: a listed file is missing (naming its key).
    """
    from leanlm.data import check_data_files, stdlib_files, take_bytes

    if config.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        found = stdlib_files(include_tests=config.include_tests, root=root)
        return {"data.source": take_bytes(found, config.max_bytes)}
    if config.source == "files":
        groups = {"data.files": config.files, "data.validation_files": config.validation_files}
        out: dict[str, list[Path]] = {}
        for key, names in groups.items():
            missing = [name for name in names if not Path(name).is_file()]
            if missing:
                raise ConfigError(key, f"files not found: {missing}")
            out[key] = [Path(name) for name in names]
        out["data.files"] = take_bytes(out["data.files"], config.max_bytes)
        return out
    out = {"data.data_files": check_data_files(config.data_files)}
    local = Path(config.hub_name)
    if local.is_file():
        out["data.hub_name"] = [local]
    elif local.is_dir():
        out["data.hub_name"] = sorted(p for p in local.rglob("*") if p.is_file())
    return out


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(config: DataConfig) -> Digests:
    """The SHA-256 of every file `data_files(config)` lists (each read once, streamed).

    Standard library files are keyed by their path inside the standard library (the digests do
    not change when the same Python is installed elsewhere); other files by their path as the
    config gives it.

    Raises:
        ConfigError: a listed file is missing (naming its key).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out: Digests = {}
    for key, paths in data_files(config).items():
        if paths:
            name = (lambda p: p.relative_to(root).as_posix()) if key == "data.source" else str
            out[key] = {name(p): _sha256(p) for p in paths}
    return out


def data_digests(config: RunConfig) -> Digests:
    """`file_digests(config.data)`, plus the revision of a hub dataset given by name.

    The revision is `leanlm.data.hub.hub_revision` in the datasets cache the run loads from
    (`cache_dir`'s `datasets` folder), keyed `data.hub_name` and the name: the commit the cached
    copy was made from (or, with network, the hub's), found without reading the data.

    Raises:
        ConfigError: a listed file is missing, or a dataset name cannot be resolved (offline and
            not cached), naming its key.
    """
    from leanlm.data.hub import hub_revision
    from leanlm.data.resources import default_cache_dir

    out = file_digests(config.data)
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    revision = hub_revision(config.data, cache / "datasets")  # where `RunResources` loads it
    if revision is not None:
        out["data.hub_name"] = {config.data.hub_name: revision}
    return out


def data_fingerprint(digests: Digests) -> str:
    """A short hash of `data_digests`' (or `file_digests`') result (part of every stage hash)."""
    payload = json.dumps(digests, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def write_record(out_dir: Path, digests: Digests) -> None:
    """Store `digests` as the run's `DATA_RECORD`."""
    (out_dir / DATA_RECORD).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


def changed_files(out_dir: Path, digests: Digests) -> list[str]:
    """What differs between the run's `DATA_RECORD` and `digests`, one entry per config key.

    Each entry names the key and up to 3 of its files whose content changed, that were added or
    that are gone, e.g. ``the content of `data.files` (changed: a.txt)``; a hub dataset given
    by name whose revision changed is named the same way (``the content of `data.hub_name`
    (changed: user/dataset)``). Empty when the record is missing or unreadable (a run of an
    earlier leanlm) or equal.
    """
    try:
        stored = json.loads((out_dir / DATA_RECORD).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(stored, dict):
        return []
    entries = []
    for key in sorted(stored.keys() | digests.keys()):
        old, new = stored.get(key) or {}, digests.get(key) or {}
        kinds = {
            "changed": [p for p in new if p in old and old[p] != new[p]],
            "added": [p for p in new if p not in old],
            "gone": [p for p in old if p not in new],
        }
        parts = [
            f"{kind}: {', '.join(paths[:3])}{f' and {len(paths) - 3} more' if paths[3:] else ''}"
            for kind, paths in kinds.items()
            if paths
        ]
        if parts:
            entries.append(f"the content of `{key}` ({'; '.join(parts)})")
    return entries
