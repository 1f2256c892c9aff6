"""MkDocs hooks (listed under `hooks:` in mkdocs.yml), run by every `mkdocs build` and `serve`.

`on_pre_build` fails the build when `docs/results.md` is out of date with the packages'
`benchmarks/RESULTS.md` files, with the message of `python tools/gen_results.py --check`.
`on_page_markdown` inlines the package READMEs an overview page includes, with their relative
links (e.g. a plot under `benchmarks/`) rewritten to the copies `gen_results.py` keeps in the docs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


def _gen_results() -> ModuleType:
    """`tools/gen_results.py`, loaded by path (tools/ is not a package)."""
    path = Path(__file__).with_name("gen_results.py")
    spec = importlib.util.spec_from_file_location("leanlm_tools_gen_results", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


def on_pre_build(config: MkDocsConfig) -> None:
    """Stop the build if `docs/results.md` (or a file it links to) is stale."""
    gen = _gen_results()
    try:
        message = gen.check(Path(config.config_file_path).resolve().parent)
    except gen.ResultsError as err:
        raise PluginError(f"docs/results.md cannot be generated: {err}") from err
    if message:
        raise PluginError(message)


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """`markdown` with `--8<-- "packages/<dist>/README.md"` lines replaced by the README."""
    gen = _gen_results()
    try:
        return gen.readme_markdown(markdown, Path(config.config_file_path).resolve().parent)
    except gen.ResultsError as err:
        raise PluginError(f"{page.file.src_uri}: {err}") from err
