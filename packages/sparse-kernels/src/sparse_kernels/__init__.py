"""sparse_kernels: sparse LLM training and compression for PyTorch.

The names below are loaded on first use (PEP 562), so `import sparse_kernels` and the plain
`sparse_kernels.SparsityConfig` (`sparse_kernels.config`) do not import torch or Triton: a program
that only checks a sparsity config (e.g. leanlm validating a config file) stays fast.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparse_kernels.block_sparse import BlockSparseLinear, block_sparse_linear
    from sparse_kernels.config import SparsityConfig
    from sparse_kernels.convert import to_block_sparse_
    from sparse_kernels.export import (
        load_compressed_,
        load_masks_,
        save_compressed,
        save_pretrained_sparse,
    )
    from sparse_kernels.layout import BlockLayout
    from sparse_kernels.masks import block_mask, nm_mask, unstructured_mask
    from sparse_kernels.schedules import GradualPruning, SparseFromStart, SparseThenDense
    from sparse_kernels.semi24 import compress_24, decompress_24, to_semi_structured_
    from sparse_kernels.sparsify import (
        apply_mask_,
        get_mask,
        masks,
        remove_masks_,
        select_targets,
        sparsify_,
        sparsity_report,
    )

_MODULES = {
    "block_sparse": ("BlockSparseLinear", "block_sparse_linear"),
    "config": ("SparsityConfig",),
    "convert": ("to_block_sparse_",),
    "export": ("load_compressed_", "load_masks_", "save_compressed", "save_pretrained_sparse"),
    "layout": ("BlockLayout",),
    "masks": ("block_mask", "nm_mask", "unstructured_mask"),
    "schedules": ("GradualPruning", "SparseFromStart", "SparseThenDense"),
    "semi24": ("compress_24", "decompress_24", "to_semi_structured_"),
    "sparsify": (
        "apply_mask_",
        "get_mask",
        "masks",
        "remove_masks_",
        "select_targets",
        "sparsify_",
        "sparsity_report",
    ),
}
_SOURCE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "BlockLayout",
    "BlockSparseLinear",
    "GradualPruning",
    "SparseFromStart",
    "SparseThenDense",
    "SparsityConfig",
    "apply_mask_",
    "block_mask",
    "block_sparse_linear",
    "compress_24",
    "decompress_24",
    "get_mask",
    "load_compressed_",
    "load_masks_",
    "masks",
    "nm_mask",
    "remove_masks_",
    "save_compressed",
    "save_pretrained_sparse",
    "select_targets",
    "sparsify_",
    "sparsity_report",
    "to_block_sparse_",
    "to_semi_structured_",
    "unstructured_mask",
]


class _Package(types.ModuleType):
    """This package's module type: `masks` stays the function `sparsify.masks`.

    `masks` names both a submodule and an exported function; importing the submodule would bind
    it on the package, so that binding is ignored (`from sparse_kernels.masks import nm_mask`
    still works).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SOURCE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    """Import the submodule that defines `name` on first access (then it is a plain global)."""
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
