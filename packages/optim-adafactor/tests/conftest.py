# The Triton interpreter on CPU-only machines is chosen by leanlm-testing's pytest plugin.

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def foreach_batches(monkeypatch) -> list[int]:
    """Torch semantics take the multi-tensor PyTorch path on the CPU too; the batch sizes it ran."""
    from optim_adafactor import _foreach_path

    monkeypatch.setattr(_foreach_path, "ON_CPU", True)
    sizes: list[int] = []
    step = _foreach_path.step

    def recorded(works):
        sizes.append(len(works))
        return step(works)

    monkeypatch.setattr(_foreach_path, "step", recorded)
    return sizes
