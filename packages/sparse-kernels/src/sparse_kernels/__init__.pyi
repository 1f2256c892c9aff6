# The exports: read by type checkers, by griffe (the API docs) and by `lazy_loader.attach_stub` in
# __init__.py, which loads each name from its submodule on first use. `__all__` names exactly the
# imported names (leanlm_testing.exports.check_lazy_exports checks it).
from .block_sparse import BlockSparseLinear, block_sparse_linear
from .config import SparsityConfig
from .convert import to_block_sparse_, to_masked_linear_
from .export import load_compressed_, load_masks_, save_compressed, save_pretrained_sparse
from .layout import BlockLayout
from .masks import block_mask, nm_mask, unstructured_mask
from .schedules import GradualPruning, SparseFromStart, SparseThenDense
from .semi24 import compress_24, decompress_24, to_semi_structured_
from .sparsify import (
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
    "to_masked_linear_",
    "to_semi_structured_",
    "unstructured_mask",
]
