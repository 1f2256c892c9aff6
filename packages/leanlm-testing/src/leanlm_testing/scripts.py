"""Load a script that is not in a package (tools/, benchmarks/) as a module, for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@contextlib.contextmanager
def loaded_script(path: Path, name: str) -> Iterator[ModuleType]:
    """The script at `path` executed as module `name`, registered in `sys.modules` meanwhile.

    Dataclasses look their module up in `sys.modules`, so the module stays registered until
    the block ends (a module-scoped fixture: ``with loaded_script(...) as m: yield m``).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"`path` ({path}) is not a loadable Python file: pass a script's path")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def script_fixture(path: Path, name: str) -> Any:
    """A module-scoped fixture of the script at `path` (`loaded_script`), named as assigned.

    ``tool = script_fixture(ROOT / "tools" / "x.py", "x_under_test")`` in a test module gives
    its tests a `tool` fixture.
    """

    @pytest.fixture(scope="module")
    def _script() -> Iterator[ModuleType]:
        with loaded_script(path, name) as module:
            yield module

    return _script
