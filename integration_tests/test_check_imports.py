"""tools/check_imports.py: workspace imports in tests/, benchmarks/ and experiments/."""

from pathlib import Path

import pytest

from leanlm_testing.scripts import script_fixture

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "check_imports.py"


tool = script_fixture(TOOL, "check_imports_under_test")


def make_package(root: Path, name: str, deps=(), test_group=()) -> Path:
    pkg = root / "packages" / name
    (pkg / "src" / name.replace("-", "_")).mkdir(parents=True)
    (pkg / "src" / name.replace("-", "_") / "__init__.py").write_text("")
    quote = lambda items: ", ".join(f'"{i}"' for i in items)  # noqa: E731
    (pkg / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\ndependencies = [{quote(deps)}]\n\n'
        f"[dependency-groups]\ntest = [{quote(test_group)}]\n"
    )
    return pkg


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def workspace(tmp_path):
    """`top` depends on `low` and `mid`; `mid`'s tests use `low` (declared in its test group)."""
    low = make_package(tmp_path, "low")
    mid = make_package(tmp_path, "mid", test_group=["low"])
    top = make_package(tmp_path, "top", deps=["low>=0.1", "mid"])
    return low, mid, top


def test_declared_imports_pass(tool, workspace):
    _, mid, top = workspace
    write(mid / "tests" / "test_x.py", "import low\nimport mid\nimport torch\n")
    write(top / "experiments" / "exp.py", "from low import a\nfrom mid.sub import b\n")
    assert tool.check_workspace_imports(mid) == []
    assert tool.check_workspace_imports(top) == []


def test_undeclared_sibling_in_benchmarks_is_named(tool, workspace):
    low, _, _ = workspace
    write(low / "benchmarks" / "bench_y.py", "import os\nfrom top.data import load\n")
    (error,) = tool.check_workspace_imports(low)
    assert "`import top` in benchmarks/" in error
    assert "low does not declare" in error
    assert "bench_y.py:2" in error


def test_declared_import_that_points_back_up_is_a_cycle(tool, tmp_path):
    low = make_package(tmp_path, "low", test_group=["top"])  # declared, but top -> low already
    make_package(tmp_path, "top", deps=["low"])
    write(low / "tests" / "test_z.py", "import top\n")
    (error,) = tool.check_workspace_imports(low)
    assert "points back up the package graph (low -> top -> low)" in error
    assert "move the file to top" in error


def test_the_repository_passes(tool):
    for package in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        assert tool.check_workspace_imports(package.parent) == [], package.parent.name


def test_a_deferred_import_cycle_is_named(tool, tmp_path):
    pkg = make_package(tmp_path, "loop")
    src = pkg / "src" / "loop"
    write(src / "a.py", "from loop import b\n")
    write(src / "b.py", "import os\n\n\ndef f():\n    from loop.a import g\n")
    write(src / "c.py", "from . import a\n")  # imports into the cycle, is not in it
    (error,) = tool.check_cycles(pkg)
    assert "import cycle loop.a -> loop.b -> loop.a (2 modules" in error
    assert "b.py:5" in error
    assert tool.main([str(pkg)]) == 1


def test_a_cycle_in_a_report_only_package_is_a_warning(tool, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tool, "CYCLES_REPORT_ONLY", frozenset({"loop"}))
    pkg = make_package(tmp_path, "loop")
    write(pkg / "src" / "loop" / "x.py", "from .y import f\n")
    write(pkg / "src" / "loop" / "y.py", "if False:\n    from loop.x import g\n")
    assert tool.main([str(pkg)]) == 0
    assert "warning (report-only for loop): loop: import cycle" in capsys.readouterr().err


def test_packages_off_the_report_only_list_have_no_cycle(tool):
    for package in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        if package.parent.name not in tool.CYCLES_REPORT_ONLY:
            assert tool.check_cycles(package.parent) == [], package.parent.name
