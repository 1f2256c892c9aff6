"""Test helpers shared by the leanlm packages (never published)."""

from leanlm_testing.asserts import assert_verbose_allclose
from leanlm_testing.distributed import spawn

__all__ = ["assert_verbose_allclose", "spawn"]
