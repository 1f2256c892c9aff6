"""What each process of a launch is doing, for the reports when one dies or stops answering.

Under `leanlm`'s launcher (`STATUS_ENV` names a folder it made) every worker runs a
`Heartbeat`: a thread that rewrites `rank-<N>.json` every `INTERVAL_S` seconds (and within
`_LOOK_S` of a new step) with its PID, stage, step (from `leanlm.run.interrupt.progress`), peak
resident memory and the time, and a last time with the exit code when the worker ends through
`leanlm.cli`. A process that is killed
writes no exit code; one that is frozen (SIGSTOP, a wedged machine) stops rewriting its file.

- A worker whose collective timed out names the processes whose files went stale
  (`Heartbeat.stalled`).
- The launcher names the process that died and where it was (`describe_death`), and ends the
  processes that stopped answering after another one failed (`WorkerWatch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from leanlm.run import interrupt

STATUS_ENV = "LEANLM_STATUS_DIR"
"""Set by `leanlm.run.launch.relaunch`: the folder of the workers' status files."""

INTERVAL_S = 1.0
"""Seconds between two rewrites of a worker's status file (sooner when its step changes)."""

_LOOK_S = 0.1
"""Seconds between two looks at the step."""

STALE_S = 5.0
"""A status file not rewritten for this long belongs to a process that stopped answering."""

FAILURES_FILE = "failures.json"
"""Written by the torchrun process: {rank: [pid, exit code]} of the workers that failed."""


def read_all(folder: Path) -> dict[int, dict[str, Any]]:
    """The status of every worker that wrote one, by rank."""
    found = {}
    for path in folder.glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            status = json.loads(path.read_text())
            found[int(status["rank"])] = status
    return found


def where(status: dict[str, Any]) -> str:
    """'pretrain step 12', 'sparsify' (no step yet), or '' (before the first stage)."""
    stage, step = status.get("stage", ""), status.get("step", 0)
    return f"{stage} step {step}" if stage and step else stage


class Heartbeat:
    """This worker's status file, rewritten by a daemon thread until `stop`."""

    current: ClassVar[Heartbeat | None] = None
    """This process's heartbeat (`from_env`)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self.path = folder / f"rank-{rank}.json"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="leanlm-heartbeat", daemon=True)

    @classmethod
    def from_env(cls) -> Heartbeat | None:
        """A started heartbeat when the launcher asked for one, else None."""
        folder = os.environ.get(STATUS_ENV)
        if not folder:
            return None
        beat = Heartbeat.current = cls(Path(folder), int(os.environ.get("RANK", "0")))
        beat._write()
        beat._thread.start()
        return beat

    def _write(self, **extra: Any) -> None:
        stage, step = interrupt.where()
        status = {
            "rank": self.rank,
            "pid": os.getpid(),
            "stage": stage,
            "step": step,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "time": time.time(),
            **extra,
        }
        tmp = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # a report aid: never a reason to fail the run
            tmp.write_text(json.dumps(status))
            os.replace(tmp, self.path)

    def _beat(self) -> None:
        last, written = interrupt.where(), time.monotonic()
        while not self._done.wait(_LOOK_S):
            now = interrupt.where()
            if now != last or time.monotonic() - written >= INTERVAL_S:
                self._write()
                last, written = now, time.monotonic()

    def stop(self, exit_code: int) -> None:
        """Write the last status, with `exit_code` (the worker reported its own end)."""
        self._done.set()
        self._thread.join()
        self._write(exit=exit_code)

    def stalled(self) -> list[dict[str, Any]]:
        """The other workers that stopped answering (no exit, a stale file), by rank."""
        now = time.time()
        return [
            status
            for rank, status in sorted(read_all(self.folder).items())
            if rank != self.rank and "exit" not in status and now - status["time"] > STALE_S
        ]


def timeout_message(timeout_s: float) -> tuple[str, bool]:
    """The line a worker prints when its collective timed out, and whether this rank prints it.

    Of the ranks still answering, the lowest prints (every rank prints when there are no
    status files: each then only knows that it waited).
    """
    stage, step = interrupt.where()
    at = where({"stage": stage, "step": step})
    waited = f"waited {timeout_s:g} s (`collective_timeout_s`)"
    collective = "in a collective" + (f" at {at}" if at else "")
    heartbeat = Heartbeat.current
    stalled = heartbeat.stalled() if heartbeat else []
    if heartbeat is None or not stalled:
        line = f"a collective timed out: {waited} for another process {collective}"
        return line, True
    names = ", ".join(
        f"process {s['rank']} (PID {s['pid']}"
        + (f", last seen at {where(s)})" if where(s) else ")")
        for s in stalled
    )
    stuck = {s["rank"] for s in stalled}
    first_alive = min(r for r in [*read_all(heartbeat.folder), heartbeat.rank] if r not in stuck)
    them = "it" if len(stalled) == 1 else "them"
    line = f"{names} stopped answering: {waited} for {them} {collective}"
    return line, heartbeat.rank == first_alive


@dataclass
class _Seen:
    rank: int
    pid: int
    peak_rss_mib: float = 0.0
    gone_at: float = 0.0


_HINTS = {signal.SIGKILL: "often the out-of-memory killer: see `dmesg`"}


def describe_death(rank: int, pid: int, exitcode: int, status: dict[str, Any], peak: float) -> str:
    """'process 1 (PID 42) was killed by SIGKILL (hint) at pretrain step 12, ...'."""
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
        except ValueError:  # a real-time signal has no name
            how = f"was killed by signal {-exitcode}"
        else:
            hint = _HINTS.get(sig)
            how = f"was killed by {sig.name}" + (f" ({hint})" if hint else "")
    else:
        how = f"exited with code {exitcode} without reporting an error"
    at = where(status)
    peak = max(peak, status.get("peak_rss_mib", 0.0))
    memory = f", peak memory {peak:,.0f} MiB" if peak else ""
    return f"process {rank} (PID {pid}) {how}" + (f" at {at}" if at else "") + memory


class WorkerWatch:
    """The launcher's view of the workers: who is alive, their peak memory, who died first."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: dict[int, _Seen] = {}  # by pid
        self.ended: set[int] = set()  # PIDs the launcher ended because they stopped answering

    def poll(self, workers: list[Any]) -> None:
        """Record `workers` (psutil processes); end the frozen ones once any worker failed."""
        now = time.time()
        statuses = read_all(self.folder)
        ranks = {s["pid"]: r for r, s in statuses.items()}
        alive = set()
        for proc in workers:
            with contextlib.suppress(Exception):  # it may end while we look
                rss = proc.memory_info().rss / 2**20
                seen = self.seen.setdefault(proc.pid, _Seen(ranks.get(proc.pid, -1), proc.pid))
                seen.rank = ranks.get(proc.pid, seen.rank)
                seen.peak_rss_mib = max(seen.peak_rss_mib, rss)
                alive.add(proc.pid)
        for seen in self.seen.values():
            if seen.pid not in alive and not seen.gone_at:
                seen.gone_at = now
        failed = any(  # a worker (a process with a status file) ended without exit code 0
            s.gone_at and s.rank >= 0 and statuses.get(s.rank, {}).get("exit", 1) != 0
            for s in self.seen.values()
        )
        if not failed:
            return
        for proc in workers:
            status = statuses.get(ranks.get(proc.pid, -1), {})
            frozen = "exit" not in status and now - status.get("time", now) > STALE_S
            with contextlib.suppress(Exception):
                if frozen or proc.status() == "stopped":
                    proc.kill()
                    self.ended.add(proc.pid)

    def report(self, failures: dict[int, tuple[int, int]]) -> list[str]:
        """Lines on the workers that died without reporting it, and those the launcher ended.

        `failures`: torchrun's {rank: (pid, exit code)}. A worker that wrote its exit code
        reported its own error; one torchrun killed after the others had ended is not a cause,
        nor one its agent's SIGTERM ended after another failed (a worker past its own signal
        handling, e.g. tearing down after a lost peer, dies of it without writing its exit code).
        """
        statuses = read_all(self.folder)
        reported = [
            s.gone_at
            for s in self.seen.values()
            if s.gone_at and statuses.get(s.rank, {}).get("exit", 0) != 0
        ]
        first_report = min(reported, default=float("inf"))
        # the order workers went in; of those gone in the same poll, a SIGTERM death went last
        order = {
            rank: (
                self.seen.get(pid, _Seen(rank, pid)).gone_at,
                code == -signal.SIGTERM and "exit" not in statuses.get(rank, {}),
            )
            for rank, (pid, code) in failures.items()
        }
        lines = []
        for rank, (pid, code) in sorted(failures.items()):
            status = statuses.get(rank, {})
            seen = self.seen.get(pid, _Seen(rank, pid))
            stopped = order[rank][1] and any(order[r] < order[rank] for r in order if r != rank)
            if pid in self.ended:
                lines.append(f"ended process {rank} (PID {pid}), which had stopped answering")
            elif "exit" not in status and seen.gone_at <= first_report + 1.0 and not stopped:
                lines.append(describe_death(rank, pid, code, status, seen.peak_rss_mib))
        return lines
