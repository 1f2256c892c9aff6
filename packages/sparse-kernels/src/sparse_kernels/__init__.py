"""sparse_kernels: sparse LLM training and compression for PyTorch."""

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
