"""Checks of a package that loads its exports on first use (a module `__getattr__`).

Such a package lists its exports in `__init__.pyi` (``from .submodule import name``, as
`lazy_loader.attach_stub` reads them, and the same names in the stub's `__all__`).
`check_lazy_exports` checks that every export is the object of the submodule the stub names, and
that the exported functions named like a submodule stay the functions once the submodule is
imported (as eager imports gave), in this process and in a fresh one.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest


def run_python(code: str) -> list[str]:
    """Run `code` in a fresh interpreter (this one's executable); its stdout, split on spaces."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def check_lazy_exports(
    package: ModuleType, functions: Mapping[str, str], from_submodule: tuple[str, str]
) -> None:
    """Every name in `package.__all__` is the object of the submodule its `__init__.pyi` names.

    `functions`: each exported function named like a submodule, with the module that defines
    it; after the submodules are imported, the package's attribute is still that function, here
    and in a fresh interpreter. `from_submodule` = (submodule, name): a name that stays
    importable by the submodule's full name (`from package.submodule import name`).
    """
    pkg = package.__name__
    assert package.__file__ is not None
    stub = ast.parse(Path(package.__file__).with_suffix(".pyi").read_text())
    source_of = {
        alias.name: node.module
        for node in stub.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }
    stub_all = next(
        ast.literal_eval(node.value)
        for node in stub.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
    )
    assert sorted(source_of) == package.__all__ == stub_all, "`__all__` is not the stub's names"
    for name in functions:
        importlib.import_module(f"{pkg}.{name}")
    for name in package.__all__:
        value = getattr(package, name)
        source = sys.modules[f"{pkg}.{source_of[name]}"]
        assert value is getattr(source, name), name
    assert set(package.__all__) <= set(dir(package))
    for name, module in functions.items():
        value = getattr(package, name)
        assert not isinstance(value, ModuleType), f"{pkg}.{name} is the submodule"
        assert callable(value), name
        assert value is getattr(sys.modules[module], name), name
    names = ", ".join(functions)
    submodule, member = from_submodule
    out = run_python(
        f"import {', '.join(f'{pkg}.{name}' for name in functions)}, {pkg}\n"
        f"from {pkg} import {names}\n"
        f"from {pkg}.{submodule} import {member}\n"
        f"print(*(f.__module__ for f in ({names},)), *(callable(f) for f in ({names},)))\n"
        f"print({member}.__name__)\n"
    )
    assert out == [*functions.values(), *["True"] * len(functions), member]
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(package, "no_such_name")  # noqa: B009
