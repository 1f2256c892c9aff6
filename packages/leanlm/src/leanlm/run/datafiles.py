"""The content of a run's data: the SHA-256 of every local file its `[data]` section reads.

The stage hashes (`leanlm.run.rundir.stage_hash`) take `data_fingerprint` of these digests, so
a data file edited between a run and its `--resume` changes every stage's hash, like a changed
config key: the tokenizer is trained on that text, and the stages on its token ids. A hub
dataset given by name (`[data] source = "hub"`, `hub_name` neither a local path nor a builder
for local files) counts by its revision instead (`data_digests`): a newer copy downloaded into
the datasets cache changes the hashes the same way. The run keeps the digests in `DATA_RECORD`
so that `--resume` can name the files, or the dataset, that changed.

A start does not read a large corpus again when its files did not change (like git's index or
rsync): beside `DATA_RECORD`, `DATA_STAT_RECORD` keeps each file's stat identity (size,
`st_mtime_ns`, `st_ctime_ns`, `st_ino`, `st_dev`) taken before it was hashed, and `scan_data`
reuses the recorded SHA-256 of a file whose five values are all unchanged; any difference reads
the file again. A record without the stat data (an earlier leanlm's, or one that is unreadable,
or whose digest differs from `DATA_RECORD`'s) reads every file.

What is trusted: every change of a file's bytes changes one of the five. A write or truncate
sets `st_mtime` and `st_ctime` to the current time; `st_ctime` cannot be set back by a user
(`os.utime`, `touch -r`, `cp -p`, `rsync -t` and tar set `st_mtime` back but move `st_ctime` to
now), so a rewrite of the same size whose mtime is set back is still read again; a file replaced
by another (renamed over, a symlink pointed elsewhere, a relative path read from another working
directory) differs in inode, device or ctime. Not caught, so not trusted blindly: a write in the
same tick of the file system's clock as the stat (a file whose mtime or ctime is less than
`RECENT_NS` before the hashing started is not recorded, and is read again at the next start:
git's "racy" entries); hence also a file system whose clock runs more than `RECENT_NS` behind
this machine's, or that does not keep `st_ctime` (some FUSE or network file systems); a write
through a shared `mmap` whose timestamps the kernel updates late; and root setting the system
clock back or editing an inode.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

from leanlm.config import ConfigError, DataConfig, RunConfig

DATA_RECORD = "data-files.json"
"""In the run folder: the SHA-256 of each data file the run read, by config key and path (and
the revision of a hub dataset given by name, under `data.hub_name`)."""

DATA_STAT_RECORD = "data-files-stat.json"
"""In the run folder, beside `DATA_RECORD`: `{"version": 1, "files": {config key: {path:
{"sha256", "size", "mtime_ns", "ctime_ns", "ino", "dev"}}}}`, the stat identity each file had
when it was hashed (files changed within `RECENT_NS` of that are left out)."""

RECENT_NS = 2 * 10**9
"""A file whose `st_mtime` or `st_ctime` is less than this (ns) before the hashing started is
not recorded in `DATA_STAT_RECORD`: a write in the same clock tick (up to 2 s on FAT) could
leave its stat identity as it was."""

STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")
Identity = tuple[int, int, int, int, int]
"""A file's `STAT_FIELDS`: `(st_size, st_mtime_ns, st_ctime_ns, st_ino, st_dev)`."""

Stats = dict[str, dict[str, Identity]]
"""`{config key: {path: Identity}}`, keyed like `Digests`: the identity each file had before it
was hashed (only files not changed within `RECENT_NS` of that)."""

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


def _identity(path: Path) -> Identity:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def recorded_identities(out_dir: Path) -> dict[tuple[str, str], tuple[Identity, str]]:
    """The digests of `out_dir`'s records a start may reuse: `(key, path)` -> (identity, digest).

    An entry of `DATA_STAT_RECORD` counts only when its SHA-256 is also `DATA_RECORD`'s for that
    key and path. Empty when either file is missing, unreadable or of another version (an
    earlier leanlm's record: every file is read).
    """
    record, stat = _load_json(out_dir / DATA_RECORD), _load_json(out_dir / DATA_STAT_RECORD)
    if not isinstance(record, dict) or not isinstance(stat, dict) or stat.get("version") != 1:
        return {}
    files = stat.get("files")
    out: dict[tuple[str, str], tuple[Identity, str]] = {}
    for key, entries in files.items() if isinstance(files, dict) else ():
        digests = record.get(key)
        if not isinstance(entries, dict) or not isinstance(digests, dict):
            continue
        for name, entry in entries.items():
            sha = entry.get("sha256") if isinstance(entry, dict) else None
            if not isinstance(sha, str) or digests.get(name) != sha:
                continue
            ints = [v for v in (entry.get(field) for field in STAT_FIELDS) if type(v) is int]
            if len(ints) == len(STAT_FIELDS):
                size, mtime, ctime, ino, dev = ints
                out[key, name] = ((size, mtime, ctime, ino, dev), sha)
    return out


def scan_files(config: DataConfig, out_dir: Path | None = None) -> tuple[Digests, Stats]:
    """`file_digests(config, out_dir)` and the stat identity of each file before it was hashed.

    With `out_dir`, a file whose identity is the one recorded there (`recorded_identities`) is
    not read: its recorded digest is reused. The identities exclude files changed less than
    `RECENT_NS` before the scan started (they are hashed again next time).

    Raises:
        ConfigError: a listed file is missing (naming its key).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    known = recorded_identities(out_dir) if out_dir is not None else {}
    settled = time.time_ns() - RECENT_NS  # before any stat: older timestamps are trusted
    digests: Digests = {}
    stats: Stats = {}
    for key, paths in data_files(config).items():
        if not paths:
            continue
        name = (lambda p: p.relative_to(root).as_posix()) if key == "data.source" else str
        digests[key], stats[key] = {}, {}
        for path in paths:
            identity = _identity(path)
            old = known.get((key, name(path)))  # reused only when all five values are equal
            digests[key][name(path)] = old[1] if old and old[0] == identity else _sha256(path)
            if max(identity[1], identity[2]) < settled:
                stats[key][name(path)] = identity
    return digests, stats


def file_digests(config: DataConfig, out_dir: Path | None = None) -> Digests:
    """The SHA-256 of every file `data_files(config)` lists (each read once, streamed).

    Standard library files are keyed by their path inside the standard library (the digests do
    not change when the same Python is installed elsewhere); other files by their path as the
    config gives it. With `out_dir` (a run folder), a file whose stat identity is the one
    recorded there reuses the recorded digest without being read (see the module docstring).

    Raises:
        ConfigError: a listed file is missing (naming its key).
    """
    return scan_files(config, out_dir)[0]


def scan_data(config: RunConfig, out_dir: Path | None = None) -> tuple[Digests, Stats]:
    """`data_digests(config, out_dir)` and the files' identities (`scan_files`)."""
    from leanlm.data.hub import hub_revision
    from leanlm.data.resources import default_cache_dir

    out, stats = scan_files(config.data, out_dir)
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    revision = hub_revision(config.data, cache / "datasets")  # where `RunResources` loads it
    if revision is not None:
        out["data.hub_name"] = {config.data.hub_name: revision}
    return out, stats


def data_digests(config: RunConfig, out_dir: Path | None = None) -> Digests:
    """`file_digests(config.data, out_dir)`, plus the revision of a hub dataset given by name.

    The revision is `leanlm.data.hub.hub_revision` in the datasets cache the run loads from
    (`cache_dir`'s `datasets` folder), keyed `data.hub_name` and the name: the commit the cached
    copy was made from (or, with network, the hub's), found without reading the data.

    Raises:
        ConfigError: a listed file is missing, or a dataset name cannot be resolved (offline and
            not cached), naming its key.
    """
    return scan_data(config, out_dir)[0]


def data_fingerprint(digests: Digests) -> str:
    """A short hash of `data_digests`' (or `file_digests`') result (part of every stage hash)."""
    payload = json.dumps(digests, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def write_record(out_dir: Path, digests: Digests, stats: Stats | None = None) -> None:
    """Store `digests` as the run's `DATA_RECORD`, and `stats` beside it (`DATA_STAT_RECORD`).

    Without `stats` the stat record is removed: the next start reads every file.
    """
    (out_dir / DATA_RECORD).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    stat_file = out_dir / DATA_STAT_RECORD
    if stats is None:
        stat_file.unlink(missing_ok=True)
        return
    files = {
        key: {
            name: {"sha256": digests[key][name], **dict(zip(STAT_FIELDS, identity, strict=True))}
            for name, identity in entries.items()
            if name in digests.get(key, {})
        }
        for key, entries in stats.items()
    }
    stat_file.write_text(json.dumps({"version": 1, "files": files}, sort_keys=True) + "\n")


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
