"""Fault injection: signals, damaged checkpoints, bad starts, and the rerun after each."""

import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import time
from collections import namedtuple
from importlib.metadata import version

import psutil
import pytest

import leanlm.cli
import leanlm.train.evaluate
from leanlm.cli import main
from leanlm.config import DataConfig, dumps_toml
from leanlm.report.metrics import MetricsLog, read_metrics
from leanlm.run import lock, rundir
from leanlm.train.trainer import causal_lm_loss
from leanlm_testing.cli_runs import (
    ENV,
    assert_same_weights,
    leanlm_command,
    loss_rows,
    messages,
    run_leanlm,
    start_two_process_run,
)


def _snapshot(run_dir):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()}


def _stop(launcher, run_tree, send, sig):
    """`send()` the stop signal; every process of `run_tree` must be gone within 30 s.

    Returns the launcher's stderr.
    """
    send()
    signalled = time.monotonic()
    _, stderr = launcher.communicate(timeout=60)
    _gone, alive = psutil.wait_procs(run_tree, timeout=max(0.0, signalled + 30 - time.monotonic()))
    assert not alive, f"still running 30 s after {sig.name}: {alive}"
    assert len(run_tree) >= 4  # launcher, torchrun, 2 workers
    assert launcher.returncode == 128 + sig
    return stderr


@pytest.mark.distributed
def test_sigterm_stops_every_process_then_resume_equals_uninterrupted(
    tmp_path, tiny_config, capsys
):
    config = tiny_config(pretrain={"steps": 100, "checkpoint_every": 10, "eval_every": 50})
    path = tmp_path / "run.toml"
    full, killed = tmp_path / "full", tmp_path / "killed"
    two = ["--processes", "2"]

    path.write_text(dumps_toml(config))
    subprocess.run(
        leanlm_command("run", path, "--out", full, *two), check=True, env=ENV, timeout=300
    )

    launcher, run_tree = start_two_process_run(path, killed)
    # a second run into the same directory fails at once, naming the running launcher
    assert main(["run", str(path), "--out", str(killed), "--resume"]) == 2
    assert f"in use by a running leanlm (PID {launcher.pid})" in capsys.readouterr().err

    def sigterm():
        launcher.send_signal(signal.SIGTERM)

    stderr = _stop(launcher, run_tree, sigterm, signal.SIGTERM)
    assert not (killed / "pretrain" / "result.json").exists(), "the run finished before the kill"
    stops = [m for m in messages(stderr) if "interrupted" in m]
    assert len(stops) == 1, stderr
    assert stops[0].endswith("; continue with --resume")
    assert "Traceback" not in stderr
    stopped_at = int(stops[0].split("interrupted at step ")[1].split(";")[0])
    assert stopped_at >= 10
    # the stop step was checkpointed (it is not a multiple of checkpoint_every, so only the stop
    # wrote it), and nothing is written once every process has exited
    assert (killed / "pretrain" / "checkpoints" / f"step-{stopped_at:08d}").is_dir()
    before = _snapshot(killed)
    time.sleep(1)
    assert _snapshot(killed) == before
    assert not (killed / lock.LOCK_FILE).exists()

    resumed = run_leanlm("run", path, "--out", killed, "--resume", *two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step-{stopped_at:08d}" in resumed.stdout + resumed.stderr
    assert_same_weights(full, killed)
    assert loss_rows(full) == loss_rows(killed)


@pytest.mark.distributed
def test_ctrl_c_to_the_process_group_stops_every_process_quietly(tmp_path, tiny_config):
    """Ctrl-C in a terminal: SIGINT reaches the launcher, torchrun and every worker at once."""
    config = tiny_config(pretrain={"steps": 100, "checkpoint_every": 10, "eval_every": 50})
    path, run = tmp_path / "run.toml", tmp_path / "run"
    path.write_text(dumps_toml(config))
    # its own process group, as a shell's foreground job: Ctrl-C signals the whole group
    launcher, run_tree = start_two_process_run(path, run, start_new_session=True)
    stderr = _stop(
        launcher, run_tree, lambda: os.killpg(launcher.pid, signal.SIGINT), signal.SIGINT
    )
    assert "Traceback" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr, stderr
    assert len(messages(stderr)) == 1, stderr
    assert "interrupted at step " in messages(stderr)[0]
    stopped_at = int(messages(stderr)[0].split("interrupted at step ")[1].split(";")[0])
    assert (run / "pretrain" / "checkpoints" / f"step-{stopped_at:08d}").is_dir()
    assert not (run / lock.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_worker_error_is_printed_once_then_the_corrected_rerun(tmp_path, tiny_config):
    # Every worker fails alike: one error line (no torchrun report), and nothing is left that
    # blocks the corrected run into the same directory.
    path, out = tmp_path / "run.toml", tmp_path / "run"
    path.write_text(dumps_toml(tiny_config(pretrain={"micro_batch_size": 10**8})))
    bad = run_leanlm("run", path, "--out", out, "--processes", "2", timeout=None)
    assert bad.returncode == 2
    (message,) = messages(bad.stderr)
    assert "`pretrain.micro_batch_size`" in message
    assert "= 200000000 sequences" in message
    assert "Traceback" not in bad.stderr
    assert "ChildFailedError" not in bad.stderr
    path.write_text(dumps_toml(tiny_config(pretrain={"steps": 4, "checkpoint_every": 2})))
    subprocess.run(
        leanlm_command("run", path, "--out", out, "--processes", "2"),
        check=True,
        env=ENV,
        timeout=300,
    )
    assert (out / "pretrain" / "result.json").is_file()


def _signal_on_call(monkeypatch, call, sig=signal.SIGINT):
    """Deliver `sig` to this process during the `call`-th pretrain micro-batch (1-based)."""
    calls = {"n": 0}

    def loss_fn(model, input_ids):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), sig)
        return causal_lm_loss(model, input_ids)

    monkeypatch.setattr(leanlm.train.evaluate, "causal_lm_loss", loss_fn)


def test_interrupt_then_truncated_checkpoint_then_resume(
    tmp_path, tiny_config, capsys, monkeypatch
):
    config = tiny_config(pretrain={"steps": 18, "checkpoint_every": 6, "eval_every": 6})
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(config))
    full, run = tmp_path / "full", tmp_path / "run"
    assert main(["run", str(path), "--out", str(full)]) == 0

    _signal_on_call(monkeypatch, 9)  # Ctrl-C during step 9: it finishes, is saved, the run ends
    assert main(["run", str(path), "--out", str(run)]) == 130
    err = capsys.readouterr().err
    assert messages(err) == ["leanlm: [pretrain] interrupted at step 9; continue with --resume"]
    assert "Traceback" not in err
    checkpoints = run / "pretrain" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000006", "step-00000009"]
    monkeypatch.undo()

    newest = checkpoints / "step-00000009" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with open(run / "pretrain" / "metrics.jsonl", "a") as f:  # an append a kill cut short
        f.write('{"step": 10, "loss": 5.2')
    assert main(["run", str(path), "--out", str(run), "--resume"]) == 0
    log = capsys.readouterr()
    assert (
        f"checkpoint {checkpoints / 'step-00000009'} is damaged (model.safetensors does not "
        "match its checksum); moved it to .damaged-step-00000009" in log.out
    )
    assert "resuming from step-00000006" in log.out
    assert (checkpoints / ".damaged-step-00000009").is_dir()
    assert_same_weights(full, run)
    assert loss_rows(full) == loss_rows(run)


def test_metrics_rows_torn_damaged_or_unwritable(tmp_path):
    # before: a torn last row (a kill or a full disk mid-append) made every `--resume` fail
    # with a bare JSON error naming no file, and a full disk's error named no file either
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{path} line 2 is not a JSON row"):
        read_metrics(path)
    disk_full = tmp_path / "full" / "metrics.jsonl"
    disk_full.parent.mkdir()
    disk_full.symlink_to("/dev/full")  # every write: No space left on device
    log = MetricsLog(disk_full, enabled=True)
    with pytest.raises(OSError, match="No space left on device") as err:
        log.log({"step": 1, "loss": 2.0})
    assert err.value.filename == str(disk_full)
    log.close()


def test_bad_starts_then_the_corrected_rerun(tmp_path, tiny_config, capsys, monkeypatch):
    good = tiny_config(pretrain={"steps": 4, "checkpoint_every": 2, "eval_every": 4})
    path, out = tmp_path / "run.toml", tmp_path / "run"
    empty, no_tokenizer, encoder = (tmp_path / n for n in ("empty", "no-tokenizer", "encoder"))
    for folder in (empty, no_tokenizer, encoder):
        folder.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (encoder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (encoder / "tokenizer.json").write_text("{}")
    hub = DataConfig(source="hub", hub_name="leanlm-test/no-such-dataset", seq_len=32)
    bad_starts = [
        ("init_model", {"init_model": str(tmp_path / "missing")}, "does not exist"),
        ("init_model", {"init_model": str(empty)}, "not a model folder"),
        ("init_model", {"init_model": str(encoder)}, "is not a causal LM"),
        ("init_model", {"init_model": str(no_tokenizer)}, "has no tokenizer"),
        ("init_model", {"init_model": "leanlm-test/no-such-model"}, "not in the hub cache"),
        ("data.hub_name", {"data": hub}, "could not be loaded"),
        ("pretrain.micro_batch_size", {"pretrain": {"micro_batch_size": 10**8}}, "training set"),
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for key, changes, says in bad_starts:
        pretrain = changes.pop("pretrain", None)
        path.write_text(dumps_toml(tiny_config(pretrain=pretrain, **changes)))
        assert main(["run", str(path), "--out", str(out)]) == 2, key
        err = capsys.readouterr().err
        assert len(messages(err)) == 1, err
        assert f"`{key}`" in err
        assert says in err
        assert "Traceback" not in err

    path.write_text(dumps_toml(good))
    cores = os.cpu_count() or 1
    assert main(["run", str(path), "--out", str(path), "--processes", str(cores + 1)]) == 2
    err = capsys.readouterr().err
    assert f"--processes {cores + 1} is more than the {cores} CPU cores" in err
    assert messages(err)[-1] == f"leanlm: error: --out {path} is a file, not a directory; " + (
        "choose another --out"
    )
    assert main(["run", str(path), "--out", str(path / "sub")]) == 2
    assert "is not writable: Not a directory" in capsys.readouterr().err
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda _: usage(2**30, 2**30, 2**20))
    assert main(["run", str(path), "--out", str(out)]) == 2
    assert "only 1 MiB free on its disk" in capsys.readouterr().err
    monkeypatch.undo()

    # an unexpected error: one line; the same while the disk is full: the full disk
    def fail(model, input_ids):
        raise RuntimeError("[enforce fail at inline_container.cc] file write failed")

    monkeypatch.setattr(leanlm.train.evaluate, "causal_lm_loss", fail)
    for full, says in ((False, "RuntimeError: [enforce fail"), (True, "no space left on")):
        monkeypatch.setattr(leanlm.cli, "disk_full", lambda _, full=full: full)
        assert main(["run", str(path), "--out", str(out)]) == (2 if full else 1)
        err = capsys.readouterr().err
        assert len(messages(err)) == 1, err
        assert says in messages(err)[0]
        assert "Traceback" not in err
        assert full or messages(err)[0].endswith("(--debug shows the traceback)")
    # --debug: the same one line, plus the traceback that led to it
    monkeypatch.setattr(leanlm.cli, "disk_full", lambda _: False)
    assert main(["run", str(path), "--out", str(out), "--debug"]) == 1
    err = capsys.readouterr().err
    assert len(messages(err)) == 1, err
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("[enforce fail' in err  # the frame that raised
    assert "--debug shows the traceback" not in err
    monkeypatch.undo()

    # the corrected run, into the same directory, over a lock left by a killed run
    (out / lock.LOCK_FILE).write_text("4194303\n")
    assert main(["run", str(path), "--out", str(out)]) == 0
    log = capsys.readouterr()
    assert "on 1 process(es), 4 steps" in log.out
    assert "Removed shared tensor" not in log.out + log.err
    assert "Downloading data" not in log.err
    assert "Generating train split" not in log.err

    assert main(["run", str(path), "--out", str(out)]) == 2
    assert messages(capsys.readouterr().err) == [
        f"leanlm: error: {out} already holds a run: pass --resume to continue it, or start "
        f"over with `rm -r {out}` (or another --out)"
    ]
    changed = dataclasses.replace(
        good, seed=1, pretrain=dataclasses.replace(good.pretrain, lr=1e-3)
    )
    path.write_text(dumps_toml(changed))
    assert main(["run", str(path), "--out", str(out), "--resume"]) == 2
    assert "differs from the one" in (err := capsys.readouterr().err)
    assert "in `pretrain.lr`, `seed`; resuming would restart pretrain and discard" in err
    assert "Pass --restart-changed" in err


def test_a_worker_listing_while_the_main_process_marks_the_folder_sees_a_run(tmp_path, monkeypatch):
    """The main process writes the marker, then config.toml, while another rank lists `--out`
    (each rank checks it): whatever the listing saw, the folder counts as a run folder."""
    listing = type(tmp_path).iterdir

    def racing(path):
        names = list(listing(path))  # the listing ran before the main process wrote anything
        if path == tmp_path:
            rundir.mark_run_dir(tmp_path)
            (tmp_path / rundir.CONFIG_FILE).write_text("")
            names.append(tmp_path / rundir.CONFIG_FILE)  # ... and saw config.toml only
        return iter(names)

    monkeypatch.setattr(type(tmp_path), "iterdir", racing)
    assert rundir.foreign_entries(tmp_path) == []


def test_a_folder_that_is_not_a_leanlm_run_is_refused_and_left_alone(tmp_path, tiny_config, capsys):
    """A fresh run (or --resume) into a non-empty folder without a run deleted the user's
    folders named like stages and overwrote their config.toml; now nothing is touched."""
    out, path = tmp_path / "project", tmp_path / "run.toml"
    path.write_text(dumps_toml(tiny_config()))
    (out / "pretrain").mkdir(parents=True)
    (out / "pretrain" / "notes.txt").write_text("my notes\n")
    (out / "config.toml").write_text("# my own config\n[optim]\nlr = 1e-3\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for resume in ([], ["--resume"]):
        assert main(["run", str(path), "--out", str(out), *resume]) == 2
        assert messages(capsys.readouterr().err) == [
            f"leanlm: error: --out {out} is not empty and is not a leanlm run folder (it holds "
            "config.toml, pretrain/); leanlm deletes or overwrites nothing it did not create: "
            "choose a new or empty --out (--resume continues only a leanlm run folder)"
        ]
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (out / rundir.RUN_MARKER).exists()
    # a folder holding only what a starting run makes itself is empty for this check
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / lock.LOCK_FILE).write_text("4194303\n")
    rundir.check_reuse(tmp_path / "new", tiny_config(), resume=False)


def _probe_out_dir(out, rounds, failures):
    for _ in range(rounds):
        try:
            rundir.check_out_dir(out)
        except ValueError as err:
            failures.put(str(err))
            return


def test_workers_checking_the_same_out_dir_at_once_do_not_fail(tmp_path):
    """Every worker of a launch checks `--out` at the same moment: the probes must not collide.

    With one shared probe file, two processes doing this 3000 times each failed 163 and 98 times
    ("is not writable: No such file or directory"), which made torchrun kill the other worker.
    """
    ctx = multiprocessing.get_context("fork")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_probe_out_dir, args=(tmp_path, 1500, failures)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert failures.empty(), failures.get()
    assert list(tmp_path.iterdir()) == []  # every probe removed


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"leanlm {version('leanlm')}"
