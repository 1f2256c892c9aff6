"""One run per directory: an exclusive lock held while the run lives.

`fcntl.flock` is released by the kernel when the process dies, so a lock left by a killed run is
simply taken over.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "leanlm.lock"


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive lock on `out_dir / LOCK_FILE` holding the owner's PID."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock.

        Raises:
            RunLockedError: another live process holds it (its PID is named).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunLockedError(
                f"{self.path.parent} is in use by a running leanlm (PID {owner}); wait for it to "
                f"finish, stop it (`kill {owner}`), or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
