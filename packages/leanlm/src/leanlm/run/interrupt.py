"""Stopping a run cleanly on SIGTERM / SIGINT (the worker side).

Inside `handling_signals()` both signals request a stop. In the training loop
(`at_step_boundaries`) the request only sets a flag: the processes agree on it in the step's
all-reduce, checkpoint when one is due and raise `Interrupted`. Elsewhere (loading data,
evaluating) the handler raises at once, as does a second signal. Under leanlm's launcher
(`LAUNCHER_ENV`) a SIGTERM comes from torchrun shutting the others down after one failed, and
ends the process quietly: the failing process reports the error.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType

LAUNCHER_ENV = "LEANLM_LAUNCHER_PID"
"""Set by `leanlm.run.launch.relaunch` in the processes it starts (the launcher's PID)."""


class Interrupted(Exception):  # noqa: N818  (not an error: a requested stop)
    """The run was stopped by a signal; `step` is the last finished step of `stage`."""

    def __init__(self, *, stage: str, step: int, quiet: bool = False) -> None:
        self.stage = stage
        self.step = step
        self.quiet = quiet
        """True when the stop was torchrun's shutdown after another process failed."""
        where = f"[{stage}] " if stage else ""
        super().__init__(f"{where}interrupted at step {step}; continue with --resume")


class _State:
    signum = 0
    armed = False
    stage = ""
    step = 0


_state = _State()


def _handler(signum: int, frame: FrameType | None) -> None:
    first = not _state.signum
    _state.signum = _state.signum or signum
    if _state.armed and first:
        return  # the training loop stops at the end of its step
    if first and _in_finalizer(frame):
        # Python swallows an exception raised in `__del__` (printing "Exception ignored in"
        # and a traceback): leave the request to the training loop's poll
        return
    quiet = _state.signum == signal.SIGTERM and LAUNCHER_ENV in os.environ
    raise Interrupted(stage=_state.stage, step=_state.step, quiet=quiet)


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside a `__del__` (e.g. a `datasets.Dataset` being freed)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT request a stop (enter in the main thread)."""
    _state.signum, _state.stage, _state.step = 0, "", 0
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _state.signum, _state.stage, _state.step = 0, "", 0


def requested() -> bool:
    """Whether a stop was requested."""
    return bool(_state.signum)


def exit_code() -> int:
    """128 + the number of the signal that requested the stop (the shell's convention)."""
    return 128 + (_state.signum or signal.SIGINT)


def progress(stage: str, step: int) -> None:
    """Record where the run is (for the message of an `Interrupted` raised by the handler)."""
    _state.stage, _state.step = stage, step


def where() -> tuple[str, int]:
    """The stage and step `progress` last recorded."""
    return _state.stage, _state.step


def stopped(stage: str | None = None, step: int | None = None) -> Interrupted:
    """The exception that ends a stopped run (default: where `progress` last put it)."""
    quiet = _state.signum == signal.SIGTERM and LAUNCHER_ENV in os.environ
    stage = _state.stage if stage is None else stage
    return Interrupted(stage=stage, step=_state.step if step is None else step, quiet=quiet)


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[None]:
    """Inside: a first signal only sets the flag (the loop polls `requested()` each step)."""
    _state.armed = True
    try:
        yield
    finally:
        _state.armed = False
