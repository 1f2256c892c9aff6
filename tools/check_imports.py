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
- The modules in `src/` import each other without a cycle. Every import counts: deferred
  (function-local) ones and those under `if TYPE_CHECKING:` too, since either still ties the two
  modules together. A package in `CYCLES_REPORT_ONLY` gets a warning instead of an error.
"""

from __future__ import annotations

import ast
import collections
import importlib.metadata
import itertools
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


CYCLES_REPORT_ONLY: frozenset[str] = frozenset()
"""Packages whose import cycles are reported as warnings until their restructuring (issue 27)."""


def _module_names(src: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the import packages under `src`."""
    modules = {}
    for init in sorted(src.glob("*/__init__.py")):
        for path in sorted(init.parent.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_graph(src: Path) -> dict[tuple[str, str], list[str]]:
    """Every import between the package's own modules: (importer, imported) -> `file:line` sites.

    `from a import b` points at the module `a.b` when there is one, else at `a`; an import of
    `a.b.c` points at the longest prefix that is a module of the package.
    """
    modules = _module_names(src)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [resolve(f"{base}.{alias.name}") or resolve(base) for alias in node.names]
            else:
                continue
            for target in targets:
                if target is not None and target != module:
                    edges.setdefault((module, target), []).append(f"{path}:{node.lineno}")
    return edges


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports directly or through others."""
    found: set[str] = set()
    stack = [start]
    while stack:
        for nxt in graph.get(stack.pop(), set()) - found:
            found.add(nxt)
            stack.append(nxt)
    return found


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest import path from `start` back to `start` (breadth first; one must exist)."""
    came_from = {start: start}
    queue = collections.deque([start])
    while True:
        node = queue.popleft()
        if start in graph.get(node, ()):
            path = [start, node]
            while path[-1] != start:
                path.append(came_from[path[-1]])
            return path[::-1]
        for nxt in sorted(graph.get(node, set()) - came_from.keys()):
            came_from[nxt] = node
            queue.append(nxt)


def check_cycles(package_dir: Path) -> list[str]:
    """One message per group of the package's modules that import each other in a circle."""
    name = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]["name"]
    edges = module_graph(package_dir / "src")
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    reach = {m: _reach(graph, m) for m in sorted(graph)}
    messages, seen = [], set()
    for module in (m for m in reach if m in reach[m]):
        if module in seen:
            continue
        group = {m for m in reach[module] if module in reach.get(m, set())}
        seen |= group
        cycle = _shortest_cycle(graph, module)
        sites = "; ".join(f"{a} -> {b} at {edges[a, b][0]}" for a, b in itertools.pairwise(cycle))
        messages.append(
            f"{name}: import cycle {' -> '.join(cycle)} ({len(group)} modules in the circle: "
            f"{', '.join(sorted(group))}; deferred and TYPE_CHECKING imports count); {sites}. "
            "Move what both sides need into a module below them, so that imports point one way"
        )
    return messages


def main(argv: list[str]) -> int:
    """Check each package directory given on the command line."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    errors = [e for arg in argv for e in check(Path(arg)) + check_workspace_imports(Path(arg))]
    for arg in argv:
        name = tomllib.loads((Path(arg) / "pyproject.toml").read_text())["project"]["name"]
        for message in check_cycles(Path(arg)):
            if name in CYCLES_REPORT_ONLY:
                print(f"warning (report-only for {name}): {message}", file=sys.stderr)
            else:
                errors.append(message)
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
