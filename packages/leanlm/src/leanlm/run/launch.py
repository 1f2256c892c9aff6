"""Starting several processes under torchrun, and stopping all of them.

`relaunch` runs torchrun (`python -m leanlm.launch`) in a session of its own, so a terminal's
Ctrl-C reaches only the launcher, which forwards SIGTERM / SIGINT to every worker as SIGINT
(they stop at a step boundary) and SIGKILLs what is left after `GRACE_S` seconds or a second
signal; torchrun gets SIGTERM if the launcher dies. The launcher also watches the workers'
status files (`leanlm.run.status`): after a failure it ends at once a worker that stopped
answering, and reports a worker that died without reporting its own error. If torchrun itself
dies of a signal (SIGKILL: it cannot stop its workers), the launcher stops the processes it saw
under it, and any other that carries its `LAUNCHER_ENV`, as after a signal of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import psutil  # type: ignore[import-untyped]

from leanlm.run.interrupt import LAUNCHER_ENV
from leanlm.run.status import FAILURES_FILE, STATUS_ENV, WorkerWatch

GRACE_S = 25.0
"""Seconds the workers get to stop after a signal before they are killed."""


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when `parent` dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)


def _tree(pid: int) -> list[psutil.Process]:
    """`pid` and its descendants that are alive."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Run `leanlm ARGV` in `nproc` processes under torchrun; returns the exit code.

    The exit code is 128 + the signal number when the launcher was signalled (the workers
    then stopped at a step boundary), else torchrun's. Each process gets `cpu_count // nproc`
    threads (unless OMP_NUM_THREADS is set).
    """
    status_dir = Path(tempfile.mkdtemp(prefix="leanlm-status-"))
    try:
        return _relaunch(nproc, argv, status_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _relaunch(nproc: int, argv: Sequence[str], status_dir: Path) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[LAUNCHER_ENV] = str(os.getpid())
    env[STATUS_ENV] = str(status_dir)
    args = ["--standalone", "--nproc_per_node", str(nproc), "-m", "leanlm", *argv]
    print(f"[leanlm] starting {nproc} processes: torchrun {' '.join(args)}", file=sys.stderr)
    child = subprocess.Popen(
        [sys.executable, "-m", "leanlm.launch", *args], env=env, start_new_session=True
    )
    received: list[int] = []
    seen: dict[int, psutil.Process] = {}  # the workers signalled
    tracked: dict[int, psutil.Process] = {}  # every process seen under torchrun
    watch = WorkerWatch(status_dir)

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        workers = _tree(child.pid)[1:]
        seen.update((p.pid, p) for p in workers)
        _signal_all(workers, signal.SIGINT if len(received) == 1 else signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    deadline = 0.0
    try:
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                with contextlib.suppress(psutil.NoSuchProcess):
                    watch.poll(psutil.Process(child.pid).children())  # torchrun's workers
                # every process under torchrun: none may outlive a torchrun that died (below)
                tracked.update((p.pid, p) for p in _tree(child.pid)[1:] if p.pid not in tracked)
                if received and not deadline:
                    deadline = time.monotonic() + GRACE_S
                if received:  # workers that torchrun started after the signal
                    late = [p for p in _tree(child.pid)[1:] if p.pid not in seen]
                    seen.update((p.pid, p) for p in late)
                    _signal_all(late, signal.SIGINT)
                if deadline and time.monotonic() > deadline:  # the grace period is over
                    _signal_all([*_tree(child.pid), *seen.values()], signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # workers run in sessions of their own: none may outlive torchrun
        # torchrun killed by a signal it could not handle (SIGKILL: its workers would run on)
        died = not received and (child.returncode or 0) < 0
        orphans = _orphans(tracked, child.pid) if died else []
        if died:
            print(
                f"leanlm: error: the torchrun agent (pid {child.pid}) was killed by "
                f"{_signal_name(-child.returncode)}; stopping the {len(orphans)} process(es) of "
                f"the run still alive (at a step boundary, killed after {GRACE_S:g} s)",
                file=sys.stderr,
                flush=True,
            )
            _signal_all(orphans, signal.SIGINT)
            psutil.wait_procs(orphans, timeout=GRACE_S)
        stragglers = [*seen.values(), *orphans]
        _signal_all([p for p in stragglers if p.is_running()], signal.SIGKILL)
        psutil.wait_procs(stragglers, timeout=5)
    if received:
        return 128 + received[0]
    if code < 0:  # killed by a signal: the shell's convention
        return 128 - code
    if code:
        _report(watch, status_dir, argv)
    return code


def _orphans(tracked: dict[int, psutil.Process], agent: int) -> list[psutil.Process]:
    """The run's processes still alive after torchrun (`agent`) ended.

    Those seen under torchrun, and any other process that carries this launcher's
    `LAUNCHER_ENV` (a worker torchrun started after the last look).
    """
    alive = {pid: p for pid, p in tracked.items() if p.is_running()}
    me = str(os.getpid())
    for proc in psutil.process_iter():
        if proc.pid in alive or proc.pid in (os.getpid(), agent):
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(LAUNCHER_ENV) == me:
                alive[proc.pid] = proc
    return list(alive.values())


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


def _report(watch: WorkerWatch, status_dir: Path, argv: Sequence[str]) -> None:
    """Print how the workers that did not report their own end ended, and how to resume."""
    try:
        rows = json.loads((status_dir / FAILURES_FILE).read_text())
    except (OSError, ValueError):
        return
    failures = {int(rank): (int(pid), int(code)) for rank, (pid, code) in rows.items()}
    lines = watch.report(failures)
    if lines:
        resume = [*argv, "--resume"] if "--resume" not in argv else list(argv)
        lines.append(f"continue with: leanlm {shlex.join(resume)}")
    for line in lines:
        print(f"leanlm: {line}", file=sys.stderr, flush=True)


def _torchrun(args: list[str]) -> int:
    """Run torchrun without its error report: the failing worker prints its own error once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "--debug" not in args:  # elastic's loggers set their own levels: quiet each one
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(args))  # type: ignore[no-untyped-call]
    except ChildFailedError as err:
        if STATUS_ENV in os.environ:  # for the launcher's report
            rows = {rank: [f.pid, f.exitcode] for rank, f in err.failures.items()}
            with contextlib.suppress(OSError):
                (Path(os.environ[STATUS_ENV]) / FAILURES_FILE).write_text(json.dumps(rows))
        _, failure = err.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as err:  # the launcher died: the agent has stopped the workers
        return 128 + int(err.sigval)
    return 0


def main() -> int:
    """`python -m leanlm.launch TORCHRUN_ARGS`: torchrun, ended if the launcher dies."""
    _die_with_parent(int(os.environ[LAUNCHER_ENV]))
    return _torchrun(sys.argv[1:])
