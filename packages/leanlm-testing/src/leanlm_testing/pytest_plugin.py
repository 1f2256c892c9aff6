"""pytest plugin loaded by every package that installs leanlm-testing.

On a machine without an NVIDIA GPU it selects the Triton interpreter (`TRITON_INTERPRET=1`,
unless the variable is already set): pytest loads this plugin before it imports any test module
or conftest, so before any kernel module reads the variable. It also skips `@pytest.mark.gpu`
tests when CUDA is missing, so CPU runs select them away cleanly.
"""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip gpu-marked tests on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
