#!/usr/bin/env python
"""Check that a workspace package imports only what it declares.

Usage: python tools/check_imports.py packages/<dist-name> [...]

- Every absolute import in `src/` must resolve to the standard library, the package itself, or a
  distribution listed in `[project] dependencies` / `optional-dependencies` of its pyproject.toml.
  The mapping from import names to distributions comes from the installed metadata
  (`importlib.metadata.packages_distributions`), so run it in the package's environment (as
  `nox -s tests(<pkg>)` does). This catches an undeclared dependency even when another package
  happened to install it.
- In `tests/`, `benchmarks/` and `experiments/`, every import of a *workspace* package must be the
  package itself or a sibling it declares (dependencies, optional dependencies or a dependency
  group), and the workspace graph with those edges must have no cycle: `leanlm` depends on the
  technique packages, so a technique package's benchmark that imports `leanlm` is an error.
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


WORKSPACE_FOLDERS = ("tests", "benchmarks", "experiments")
"""Folders besides `src/` whose imports of workspace packages are checked."""


def _workspace(package_dir: Path) -> dict[str, str]:
    """Import name -> distribution name of every workspace member next to `package_dir`."""
    members = {}
    for pyproject in sorted(package_dir.resolve().parent.glob("*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        for module in (pyproject.parent / "src").glob("*/__init__.py"):
            members[module.parent.name] = name
    return members


def _declared_everywhere(pyproject: Path) -> set[str]:
    toml = tomllib.loads(pyproject.read_text())
    project = toml["project"]
    reqs = list(project.get("dependencies", []))
    reqs += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    reqs += [
        r
        for group in toml.get("dependency-groups", {}).values()
        for r in group
        if isinstance(r, str)
    ]
    return {_dist(r) for r in reqs}


def _path_to(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    stack = [[start]]
    while stack:
        path = stack.pop()
        if path[-1] == goal and len(path) > 1:
            return path
        stack.extend([*path, n] for n in sorted(graph.get(path[-1], ())) if n not in path[1:])
    return None


def check_workspace_imports(package_dir: Path) -> list[str]:
    """Messages for workspace imports in tests/, benchmarks/ and experiments/ that are wrong.

    Wrong means: a sibling the package does not declare, or a declared one that closes a cycle
    in the workspace dependency graph (an arrow pointing back up).
    """
    members = _workspace(package_dir)
    dists = set(members.values())
    graph = {
        d: _declared_everywhere(p) & dists
        for p in package_dir.resolve().parent.glob("*/pyproject.toml")
        for d in [tomllib.loads(p.read_text())["project"]["name"]]
    }
    name = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]["name"]
    errors = []
    for folder in WORKSPACE_FOLDERS:
        if not (package_dir / folder).is_dir():
            continue
        for module, sites in sorted(imported_modules(package_dir / folder).items()):
            dist = members.get(module)
            if dist is None or dist == name:
                continue
            where = ", ".join(sites[:3])
            if dist not in graph[name]:
                errors.append(
                    f"{name}: `import {module}` in {folder}/ is a workspace package ({dist}) that "
                    f"{name} does not declare (dependencies or a dependency group); at {where}"
                )
            elif cycle := _path_to(graph, dist, name):
                errors.append(
                    f"{name}: `import {module}` in {folder}/ points back up the package graph "
                    f"({name} -> {' -> '.join(cycle)}); move the file to {cycle[0]}; at {where}"
                )
    return errors


def main(argv: list[str]) -> int:
    """Check each package directory given on the command line."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    errors = [e for arg in argv for e in check(Path(arg)) + check_workspace_imports(Path(arg))]
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
