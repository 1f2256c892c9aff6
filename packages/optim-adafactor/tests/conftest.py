# The Triton interpreter on CPU-only machines is chosen by leanlm-testing's pytest plugin.

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
