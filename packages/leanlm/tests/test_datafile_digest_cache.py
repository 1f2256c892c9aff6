"""A start reuses a data file's recorded SHA-256 while the file's stat identity is unchanged.

`leanlm.run.datafiles` hashed every local data file at every start and every `--resume` (a full
read of a large corpus before any training). Now the run folder keeps, beside the digests of
`data-files.json`, each file's size, mtime, ctime, inode and device (`data-files-stat.json`),
and a start reads only the files where one of them differs:

- a second start with unchanged files reads none of them and gives the same digests (new);
- a file whose size or mtime changed is read again and `--resume` names it (as before);
- a same-size rewrite given its old mtime back is read again: ctime catches it (as before);
- a record without stat data (an earlier leanlm's), an unreadable one, or one whose digest is
  not `data-files.json`'s, reads the files (as before);
- a file changed less than `RECENT_NS` before it was hashed is read again next time (new);
- the same relative path read from another working directory is another file (as before).
"""

import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import pytest

from leanlm.config import DataConfig
from leanlm.run import datafiles
from leanlm.run.datafiles import DATA_RECORD, file_digests
from leanlm.run.pipeline import run_pipeline
from leanlm.run.rundir import ConfigChangedError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
STAT_RECORD = "data-files-stat.json"


def _settle() -> None:
    """Wait until the files written so far are older than the window a start does not trust."""
    time.sleep(getattr(datafiles, "RECENT_NS", 2 * 10**9) / 1e9 + 0.2)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The paths `leanlm.run.datafiles` opens (to hash them), in order."""
    opened: list[str] = []

    def counting_open(file, *args, **kwargs):
        opened.append(str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(datafiles, "open", counting_open, raising=False)
    return opened


def _paths(config) -> list[str]:
    return [*config.data.files, *config.data.validation_files]


def test_a_second_start_with_unchanged_files_reuses_their_digests_unread(
    files_config, tmp_path, reads, capsys
):
    config = files_config(tmp_path / "data")
    out = tmp_path / "run"
    _settle()
    first = run_pipeline(config, out)[0]
    assert sorted(reads) == sorted(_paths(config))  # the first start reads each file once
    digests = file_digests(config.data)
    assert json.loads((out / DATA_RECORD).read_text()) == digests

    reads.clear()
    capsys.readouterr()
    assert run_pipeline(config, out, resume=True)[0] == first
    assert reads == []  # before: all 5 files read again
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out
    assert json.loads((out / DATA_RECORD).read_text()) == digests

    # beside the digests (kept where they were): each file's identity when it was hashed
    stored = json.loads((out / STAT_RECORD).read_text())
    assert stored["version"] == 1
    for key, names in digests.items():
        for name, sha in names.items():
            st = os.stat(name)
            assert stored["files"][key][name] == {
                "sha256": sha,
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns,
                "ino": st.st_ino,
                "dev": st.st_dev,
            }

    # one file edited: only it is read, and the digests are those of a full read
    edited = Path(config.data.files[2])
    edited.write_text(edited.read_text() + "\n# one more line\n")
    reads.clear()
    again = datafiles.data_digests(config, out)
    assert reads == [str(edited)]
    assert again == file_digests(config.data) != digests
    assert again["data.files"][str(edited)] != digests["data.files"][str(edited)]


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_a_file_changed_in_size_or_mtime_is_read_again_and_resume_names_it(
    files_config, tmp_path, reads, change
):
    config = files_config(tmp_path / "data")
    out = tmp_path / "run"
    _settle()
    run_pipeline(config, out)
    digests = file_digests(config.data)
    (out / "pretrain" / "result.json").unlink()  # killed after its step-2 checkpoint
    edited = Path(config.data.files[1])
    before = os.stat(edited)
    text = edited.read_text()
    if change == "size":
        edited.write_text(text + "\n# one more line of training text\n")
    else:  # same size, other bytes, a new mtime
        edited.write_text(text.replace("import", "IMPORT", 1))
    after = os.stat(edited)
    assert (after.st_size != before.st_size) == (change == "size")
    assert after.st_mtime_ns != before.st_mtime_ns

    reads.clear()
    with pytest.raises(ConfigChangedError) as err:
        run_pipeline(config, out, resume=True)
    assert f"the content of `data.files` (changed: {edited})" in str(err.value)
    assert str(edited) in reads
    assert json.loads((out / DATA_RECORD).read_text()) == digests  # nothing written

    run_pipeline(config, out, resume=True, restart_changed=True)
    new = file_digests(config.data)
    assert new["data.files"][str(edited)] != digests["data.files"][str(edited)]
    assert json.loads((out / DATA_RECORD).read_text()) == new


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_same_size_rewrite_given_its_old_mtime_is_read_again(files_config, tmp_path, reads, how):
    config = files_config(tmp_path / "data")
    out = tmp_path / "run"
    _settle()
    run_pipeline(config, out)
    digests = file_digests(config.data)
    (out / "pretrain" / "result.json").unlink()
    edited = Path(config.data.files[3])
    before = os.stat(edited)
    data = edited.read_bytes()
    changed = data.replace(b"import", b"IMPORT", 1)
    assert len(changed) == len(data) != 0
    assert changed != data
    if how == "in place":
        with open(edited, "r+b") as f:
            f.write(changed)
    else:
        fresh = edited.with_suffix(".new")
        fresh.write_bytes(changed)
        os.replace(fresh, edited)
    os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(edited)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    if how == "in place":
        assert after.st_ino == before.st_ino  # only the ctime tells the rewrite
    assert after.st_ctime_ns != before.st_ctime_ns  # os.utime cannot set ctime back

    reads.clear()
    with pytest.raises(ConfigChangedError) as err:
        run_pipeline(config, out, resume=True)
    assert f"the content of `data.files` (changed: {edited})" in str(err.value)
    assert str(edited) in reads
    assert json.loads((out / DATA_RECORD).read_text()) == digests


@pytest.mark.parametrize("record", ["missing", "unreadable", "another digest"])
def test_a_record_without_usable_stat_data_reads_the_files(
    files_config, tmp_path, reads, capsys, record
):
    config = files_config(tmp_path / "data")
    out = tmp_path / "run"
    _settle()
    first = run_pipeline(config, out)[0]
    digests = file_digests(config.data)
    stat = out / STAT_RECORD
    expected = _paths(config)
    if record == "missing":  # an earlier leanlm's run folder: `data-files.json` only
        stat.unlink(missing_ok=True)
    elif record == "unreadable":  # cut short by a kill or a full disk
        stat.write_text('{"version": 1, "files": {"data.fi')
    else:  # an earlier leanlm rewrote `data-files.json` with another digest for this file
        stored = json.loads((out / DATA_RECORD).read_text())
        stored["data.files"][expected[0]] = "0" * 64
        (out / DATA_RECORD).write_text(json.dumps(stored))
        expected = expected[:1]

    reads.clear()
    capsys.readouterr()
    assert run_pipeline(config, out, resume=True)[0] == first
    assert "pretrain: finished earlier with the same config, skipped" in capsys.readouterr().out
    assert set(expected) <= set(reads)
    assert json.loads((out / DATA_RECORD).read_text()) == digests


def test_a_file_changed_just_before_it_was_hashed_is_read_again_next_time(tmp_path, reads):
    from leanlm.run.datafiles import scan_files, write_record

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("some training text\n" * 50)
    (folder / "v.txt").write_text("some validation text\n" * 50)
    data = DataConfig(
        source="files", files=(str(folder / "a.txt"),), validation_files=(str(folder / "v.txt"),)
    )
    out = tmp_path / "run"
    out.mkdir()
    digests, stats = scan_files(data)
    assert stats == {"data.files": {}, "data.validation_files": {}}  # too recent to trust
    write_record(out, digests, stats)
    reads.clear()
    assert file_digests(data, out) == digests
    assert sorted(reads) == sorted([*data.files, *data.validation_files])

    _settle()
    digests, stats = scan_files(data, out)
    assert set(stats["data.files"]) == {str(folder / "a.txt")}
    write_record(out, digests, stats)
    reads.clear()
    assert file_digests(data, out) == digests
    assert reads == []


def test_a_relative_path_read_from_another_directory_is_another_file(
    tiny_config, tmp_path, reads, monkeypatch
):
    text = (STDLIB / "argparse.py").read_text()
    other = "".join(reversed(text.splitlines(keepends=True)))  # the same size, other bytes
    for folder, content in (("one", text), ("two", other)):
        (tmp_path / folder / "data").mkdir(parents=True)
        (tmp_path / folder / "data" / "a.txt").write_text(content)
        shutil.copy(STDLIB / "json" / "decoder.py", tmp_path / folder / "data" / "v.txt")
    one, two = (tmp_path / folder / "data" / "a.txt" for folder in ("one", "two"))
    mtime = os.stat(one).st_mtime_ns
    os.utime(two, ns=(mtime, mtime))
    assert os.stat(two).st_size == os.stat(one).st_size
    data = DataConfig(
        source="files", files=("data/a.txt",), validation_files=("data/v.txt",), seq_len=32
    )
    config = tiny_config(data=data, pretrain={"steps": 2, "warmup_steps": 1, "eval_every": 2})
    out = tmp_path / "run"
    _settle()
    monkeypatch.chdir(tmp_path / "one")
    run_pipeline(config, out)

    monkeypatch.chdir(tmp_path / "two")  # `data/a.txt` is now the other file
    reads.clear()
    with pytest.raises(ConfigChangedError) as err:
        run_pipeline(config, out, resume=True)
    assert "the content of `data.files` (changed: data/a.txt)" in str(err.value)
    assert "data/a.txt" in reads
