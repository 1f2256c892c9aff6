"""Training progress on the console: a tqdm bar on a terminal, plain lines otherwise.

Both show the step, the latest logged loss and the training throughput (tokens/s). When the
output is not a terminal (a log file, CI), a bar's carriage returns would pile up, so a plain
line is printed at the first logged step, then at a logged step at most every `interval_s`
seconds, and at the last step.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

PLAIN_INTERVAL_S = 30.0
"""Seconds between plain progress lines when the output is not a terminal."""


class Progress:
    """Progress of one training stage (`enabled` is false on all but the local main process)."""

    def __init__(
        self,
        name: str,
        *,
        total: int,
        initial: int,
        enabled: bool,
        stream: TextIO | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
    ) -> None:
        self.name, self.total, self.enabled = name, total, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.plain = enabled and not self.stream.isatty()
        self._last_line = -float("inf")
        self._loss: float | None = None
        self._tokens_per_s: float | None = None
        self._bar: Any = None
        if enabled and not self.plain:
            self._bar = tqdm(
                total=total, initial=initial, desc=name, mininterval=2.0, file=self.stream
            )

    def update(self, step: int, *, loss: float | None, tokens_per_s: float | None) -> None:
        """Step `step` (1-based) is done; `loss` / `tokens_per_s` are given on logged steps."""
        if not self.enabled:
            return
        if loss is not None:
            self._loss = loss
        if tokens_per_s is not None:
            self._tokens_per_s = tokens_per_s
        if self._bar is not None:
            if loss is not None:
                self._bar.set_postfix(self._postfix(), refresh=False)
            self._bar.update(1)
            return
        now = time.monotonic()
        if step == self.total or (loss is not None and now - self._last_line >= self.interval_s):
            self._last_line = now
            fields = ", ".join(f"{k} {v}" for k, v in self._postfix().items())
            print(f"[{self.name}] step {step}/{self.total}, {fields}", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def _postfix(self) -> dict[str, str]:
        out = {}
        if self._loss is not None:
            out["loss"] = f"{self._loss:.3f}"
        if self._tokens_per_s is not None:
            out["tokens/s"] = f"{self._tokens_per_s:,.0f}"
        return out

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
