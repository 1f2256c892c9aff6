"""Run a README's Python examples, so that what a user copies keeps working.

`python_blocks` reads the fenced ```python blocks of a Markdown file; a test executes them in
order in one namespace whose free names (`model`, `loader`, ...) it defines first, then checks
what the example claims (its comments) on the results.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(markdown: str | Path) -> list[str]:
    """The source of every fenced ```python block of the Markdown file, in order."""
    return _BLOCK.findall(Path(markdown).read_text(encoding="utf-8"))


def run_blocks(
    markdown: str | Path,
    which: list[int],
    namespace: dict[str, Any],
    *,
    name: str = "README",
    scale: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Execute blocks `which` of `markdown` in `namespace` (updated in place and returned).

    Each block is compiled under a file name that says which block it is, so a traceback
    points at the README's example. `scale`: text replaced before running (a full-size
    model's sizes by a tiny model's, a hub id by a local folder); each must occur in a run
    block, so an edited README fails the test instead of running unscaled.
    """
    blocks = python_blocks(markdown)
    codes = []
    for i in which:
        if i >= len(blocks):
            raise IndexError(f"{markdown} has {len(blocks)} python blocks, no block {i}")
        codes.append((i, blocks[i]))
    for old, new in (scale or {}).items():
        if not any(old in code for _, code in codes):
            raise ValueError(f"`scale` text {old!r} is in no block {which} of {markdown}")
        codes = [(i, code.replace(old, new)) for i, code in codes]
    for i, code in codes:
        exec(compile(code, f"<{name} python block {i}>", "exec"), namespace)
    return namespace
