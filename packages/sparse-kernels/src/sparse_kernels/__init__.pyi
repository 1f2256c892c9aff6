# The exports, for type checkers and for `lazy_loader.attach_stub` in __init__.py (which loads each
# name from its submodule on first use).
from .block_sparse import BlockSparseLinear as BlockSparseLinear
from .block_sparse import block_sparse_linear as block_sparse_linear
from .config import SparsityConfig as SparsityConfig
from .convert import to_block_sparse_ as to_block_sparse_
from .export import load_compressed_ as load_compressed_
from .export import load_masks_ as load_masks_
from .export import save_compressed as save_compressed
from .export import save_pretrained_sparse as save_pretrained_sparse
from .layout import BlockLayout as BlockLayout
from .masks import block_mask as block_mask
from .masks import nm_mask as nm_mask
from .masks import unstructured_mask as unstructured_mask
from .schedules import GradualPruning as GradualPruning
from .schedules import SparseFromStart as SparseFromStart
from .schedules import SparseThenDense as SparseThenDense
from .semi24 import compress_24 as compress_24
from .semi24 import decompress_24 as decompress_24
from .semi24 import to_semi_structured_ as to_semi_structured_
from .sparsify import apply_mask_ as apply_mask_
from .sparsify import get_mask as get_mask
from .sparsify import masks as masks
from .sparsify import remove_masks_ as remove_masks_
from .sparsify import select_targets as select_targets
from .sparsify import sparsify_ as sparsify_
from .sparsify import sparsity_report as sparsity_report
