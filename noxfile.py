#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.10.16"]
# ///
"""leanlm tasks. `nox -l` lists them; `nox -t ci` is what CI runs.

Venvs. Torch alone is ~900 MB per venv, so the sessions that need the ML stack share ONE pip venv
(`.nox/stack`) instead of building one each. Isolation between packages is kept where it matters:
before `tests(<pkg>)` runs, every workspace member is uninstalled from that venv and only `<pkg>`,
its declared sibling dependencies and its `test` dependency group are installed (editable), so an
undeclared sibling import fails; `tools/check_imports.py` also checks statically that each package
imports only the standard library, itself and its declared dependencies. Every install goes
through `constraints/cpu.txt` (torch must be exactly 2.13.0: pip finds the local CPU wheel).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nox

nox.needs_version = ">=2025.10.16"
nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"
STACK = ROOT / ".nox" / "stack"
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")


@dataclass(frozen=True)
class Member:
    """One workspace package: its directory, the siblings it depends on, its test requirements."""

    name: str
    path: Path
    sibling_deps: tuple[str, ...]
    test_requirements: tuple[str, ...]
    optional_requirements: tuple[str, ...] = ()
    """Its `[project.optional-dependencies]`, all extras (their tests list them in `test` too)."""


def _req_name(requirement: str) -> str:
    for sep in "[=<>!~; ":
        requirement = requirement.split(sep, 1)[0]
    return requirement.strip().lower().replace("_", "-")


def _load_members() -> dict[str, Member]:
    tomls = {
        p.parent: nox.project.load_toml(p) for p in sorted(ROOT.glob("packages/*/pyproject.toml"))
    }
    names = {toml["project"]["name"] for toml in tomls.values()}
    members = {}
    for path, toml in tomls.items():
        deps = [_req_name(r) for r in toml["project"].get("dependencies", [])]
        tests = toml.get("dependency-groups", {}).get("test", [])
        optional = [
            r for rs in toml["project"].get("optional-dependencies", {}).values() for r in rs
        ]
        name = toml["project"]["name"]
        siblings = tuple(d for d in deps if d in names)
        members[name] = Member(name, path, siblings, tuple(tests), tuple(optional))
    return members


MEMBERS = _load_members()
PACKAGES = sorted(MEMBERS)


def _closure(names: list[str]) -> list[Member]:
    """`names` and the siblings they depend on, dependencies first."""
    seen: list[Member] = []

    def visit(name: str) -> None:
        member = MEMBERS[name]
        for dep in member.sibling_deps:
            visit(dep)
        if member not in seen:
            seen.append(member)

    for name in names:
        visit(name)
    return seen


class Stack:
    """The shared pip venv that holds torch and the rest of the ML stack (or another `venv`)."""

    def __init__(self, session: nox.Session, venv: Path = STACK) -> None:
        self.session = session
        bindir = "Scripts" if sys.platform == "win32" else "bin"
        self.python = str(venv / bindir / ("python.exe" if sys.platform == "win32" else "python"))
        if not Path(self.python).exists():
            session.log(f"creating the venv {venv}")
            session.run_install(sys.executable, "-m", "venv", str(venv))
            # `wheel`: sdists in the closure (rouge-score, from lm-eval) build without isolation
            # in this venv, and without a pip cache that holds their built wheels they need it
            self.pip("install", "--upgrade", "pip", "hatchling", "editables", "wheel")
        session.env["VIRTUAL_ENV"] = str(venv)
        session.env["PATH"] = os.pathsep.join([str(venv / bindir), os.environ.get("PATH", "")])
        session.env.setdefault("HF_HOME", str(ROOT / ".nox" / "hf-home"))

    def pip(self, *args: str) -> None:
        self.session.run_install(self.python, "-m", "pip", *args, "--quiet")

    def install_only(self, names: list[str], *, extra: tuple[str, ...] = ()) -> None:
        """Make `names` (with their sibling dependencies) the only workspace members installed."""
        self.session.run_install(
            self.python, "-m", "pip", "uninstall", "--yes", "--quiet", *PACKAGES, silent=True
        )
        members = _closure(names)
        test_reqs = [r for m in members if m.name in names for r in m.test_requirements]
        local = [r for r in test_reqs if _req_name(r) in MEMBERS]
        members = _closure(names + [_req_name(r) for r in local])
        external = [r for r in test_reqs if _req_name(r) not in MEMBERS] + list(extra)
        editable = [arg for m in members for arg in ("-e", str(m.path))]
        self.pip("install", "-c", str(CONSTRAINTS), "--no-build-isolation", *editable, *external)

    def run(self, *args: str, **kwargs: object) -> object:
        return self.session.run(self.python, *args, **kwargs)  # type: ignore[arg-type]


def _pytest_env() -> dict[str, str]:
    # The Triton interpreter must be chosen before any kernel module is imported.
    return {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


_TWO_WORKERS = ("-n", "2", "--dist", "worksteal")
# optim-adafactor, optim-came and shard-zero: 97 -> 63 s each on 2 cores (2026-11-28); the
# integration tests gained nothing (a few long multi-process tests), prune-distill and
# sparse-kernels take < 30 s
PARALLEL: dict[str, tuple[str, ...]] = dict.fromkeys(
    ("leanlm", "optim-adafactor", "optim-came", "shard-zero"), _TWO_WORKERS
)
"""Suites split over pytest-xdist workers (the package's test group must list pytest-xdist; its
tests must not share ports, the working directory or files outside their tmp folders)."""


@nox.session(venv_backend="none", tags=["ci"])
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """CPU tests of one package, installed alone with its declared dependencies."""
    stack = Stack(session)
    stack.install_only([package])
    stack.run(str(ROOT / "tools" / "check_imports.py"), str(MEMBERS[package].path))
    stack.run(
        "-m",
        "pytest",
        str(MEMBERS[package].path / "tests"),
        "-m",
        "not gpu and not slow",
        "--durations=15",  # the slowest tests in every CI log: where CI time goes
        *PARALLEL.get(package, ()),
        *session.posargs,
        env=_pytest_env(),
        success_codes=[0, 5],  # 5: nothing selected
    )


@nox.session(venv_backend="none", tags=["ci"])
def integration(session: nox.Session) -> None:
    """Cross-package tests in integration_tests/ with every package installed."""
    stack = Stack(session)
    stack.install_only(PACKAGES)
    stack.run(
        "-m",
        "pytest",
        str(ROOT / "integration_tests"),
        "-m",
        "not gpu and not slow",
        "--durations=15",  # the slowest tests in every CI log: where CI time goes
        *session.posargs,
        env=_pytest_env(),
        success_codes=[0, 5],
    )


@nox.session(name="gpu-compile", venv_backend="none", tags=["ci"])
def gpu_compile(session: nox.Session) -> None:
    """Compile every launched Triton kernel for sm_80 and sm_90 (no GPU needed) and gate it.

    `tools/gpu_compile.py`: fails on a compile error, a spill, shared memory over the arch's
    limit, `tl.dot` without tensor cores, or an unpipelined GEMM loop. Records and the markdown
    table go to `.nox/gpu-compile/`.
    """
    stack = Stack(session)
    stack.install_only(PACKAGES)
    out = ROOT / ".nox" / "gpu-compile"
    out.mkdir(parents=True, exist_ok=True)
    stack.run(
        str(ROOT / "tools" / "gpu_compile.py"),
        "--out", str(out / "records.json"), "--markdown", str(out / "table.md"),
        *session.posargs,
        env={"TRITON_INTERPRET": "0"},  # the real compiler, not the interpreter
    )  # fmt: skip


@nox.session(venv_backend="none", default=False)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def gpu(session: nox.Session, package: str) -> None:
    """GPU tests of one package (needs CUDA; compiles kernels for real, no interpreter)."""
    stack = Stack(session)
    stack.install_only([package])
    stack.run("-m", "pytest", str(MEMBERS[package].path / "tests"), "-m", "gpu", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole repository."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none", tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy (strict) over every package's src/, with every package's extras installed."""
    stack = Stack(session)
    optional = [r for m in MEMBERS.values() for r in m.optional_requirements]
    typecheck = nox.project.dependency_groups(PYPROJECT, "typecheck")
    stack.install_only(PACKAGES, extra=(*typecheck, *optional))
    srcs = [str(m.path / "src") for m in MEMBERS.values()]
    stack.run("-m", "mypy", *srcs, *session.posargs)


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """Build the MkDocs site with --strict (warnings are errors)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / ".nox" / "site"))


@nox.session(venv_backend="none", default=False)
def demo(session: nox.Session) -> None:
    """The main job: `leanlm demo` (arguments after `--` go to it, e.g. `-- --preset smoke`)."""
    stack = Stack(session)
    stack.install_only(["leanlm"])
    stack.run("-m", "leanlm", "demo", *session.posargs)


# Requirements only benchmarks need (baselines to compare against). A package listed here gets
# its own venv `.nox/bench-<package>` (same constraints, local torch wheel, the package's closure
# and test group, plus these), so they never enter the shared `.nox/stack` the tests use.
BENCH_EXTRAS: dict[str, tuple[str, ...]] = {"shard-zero": ("deepspeed",)}


@nox.session(venv_backend="none", default=False)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def bench(session: nox.Session, package: str) -> None:
    """Every benchmarks/bench_*.py of one package (not in CI: benchmarks are not tests)."""
    extras = BENCH_EXTRAS.get(package, ())
    stack = Stack(session, ROOT / ".nox" / f"bench-{package}" if extras else STACK)
    stack.install_only([package])
    if extras:  # a separate call: deepspeed is an sdist that builds in its own isolated env
        stack.pip("install", "-c", str(CONSTRAINTS), *extras)
        # DeepSpeed JIT-builds a C++ op on first use (~1 min on CPU): keep the build between runs
        session.env["TORCH_EXTENSIONS_DIR"] = str(ROOT / ".nox" / "torch-extensions")
    scripts = sorted((MEMBERS[package].path / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.skip(f"{package} has no benchmarks/bench_*.py")
    for script in scripts:
        stack.run(str(script), *session.posargs)


@nox.session(venv_backend="none", default=False)
def clean(session: nox.Session) -> None:
    """Delete the shared venv and the benchmark venvs (the next session rebuilds them)."""
    shutil.rmtree(STACK, ignore_errors=True)
    for package in BENCH_EXTRAS:
        shutil.rmtree(ROOT / ".nox" / f"bench-{package}", ignore_errors=True)


if __name__ == "__main__":
    nox.main()
