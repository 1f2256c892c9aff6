# The Triton interpreter on CPU-only machines is chosen by leanlm-testing's pytest plugin.

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def gpu_case():
    """Factory: (layout, values, x, dy) of a seeded 4096 x 4096 block-sparse layer on CUDA.

    `density` is the chance that a tile is kept; values are scaled by 1/64.
    """
    from sparse_kernels.layout import BlockLayout

    def make(tokens: int, block: int, dtype: torch.dtype, density: float = 0.25):
        gen = torch.Generator().manual_seed(0)
        n = k = 4096
        mask = torch.rand(n // block, k // block, generator=gen) < density
        layout = BlockLayout.from_block_mask(mask, out_features=n, in_features=k, block_size=block)
        layout = layout.to(torch.device("cuda"))
        values = (torch.randn(layout.nnzb, block, block, generator=gen) / 64).to("cuda", dtype)
        x = torch.randn(tokens, k, generator=gen).to("cuda", dtype)
        dy = torch.randn(tokens, n, generator=gen).to("cuda", dtype)
        return layout, values, x, dy

    return make
