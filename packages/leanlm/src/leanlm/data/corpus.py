"""`Corpus`, the text of a run as loaded by `leanlm.data.sources` or `leanlm.data.hub`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import datasets


@dataclass(frozen=True)
class Corpus:
    """The text of a run: `dataset` has `train` and `validation` splits with a `text` column.

    With `[data] streaming` the splits are `datasets.IterableDataset`s, read on demand.
    """

    dataset: datasets.DatasetDict | datasets.IterableDatasetDict
    fingerprint: str
    """Identifies the text (content hashes or the `datasets` fingerprints), for caches."""
    description: str
    """One line for logs and reports."""


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No "Downloading data" / "Generating split" bars: local files are not downloaded."""
    was_disabled = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.utils.enable_progress_bars()
