#!/usr/bin/env python
"""Check that a workspace package imports only what it declares.

Usage: python tools/check_imports.py packages/<dist-name> [...]

Every absolute import in `src/` must resolve to the standard library, the package itself, or a
distribution listed in `[project] dependencies` / `optional-dependencies` of its pyproject.toml.
Run by `nox -s tests(<pkg>)` in the package's environment, so the mapping from import names to
distributions comes from the installed metadata (`importlib.metadata.packages_distributions`).
This catches an undeclared dependency even when another package happened to install it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path


def _dist(requirement: str) -> str:
    return re.split(r"[\s\[=<>!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def imported_modules(src: Path) -> dict[str, list[str]]:
    """Top-level module names imported absolutely under `src`, mapped to `file:line` sites."""
    found: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(f"{path}:{node.lineno}")
    return found


def check(package_dir: Path) -> list[str]:
    """Return one message per undeclared import of the package at `package_dir`."""
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    declared = {_dist(r) for r in project.get("dependencies", [])}
    for reqs in project.get("optional-dependencies", {}).values():
        declared |= {_dist(r) for r in reqs}
    src = package_dir / "src"
    own = {p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    providers = importlib.metadata.packages_distributions()
    errors = []
    for module, sites in sorted(imported_modules(src).items()):
        if module in sys.stdlib_module_names or module in own:
            continue
        dists = {_dist(d) for d in providers.get(module, [module])}
        if not dists & declared:
            errors.append(
                f"{project['name']}: `import {module}` (provided by {sorted(dists)}) is not a "
                f"declared dependency; declared: {sorted(declared)}; at {', '.join(sites[:3])}"
            )
    return errors


def main(argv: list[str]) -> int:
    """Check each package directory given on the command line."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    errors = [e for arg in argv for e in check(Path(arg))]
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
