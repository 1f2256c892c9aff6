"""sparse_kernels: sparse LLM training and compression for PyTorch.

The names, listed in `__init__.pyi`, load on first use (`lazy_loader`), so `import
sparse_kernels` and the plain `sparse_kernels.SparsityConfig` (`sparse_kernels.config`) do not
import torch or Triton: a program that only checks a sparsity config (e.g. leanlm validating a
config file) stays fast.
"""

import sys
import types

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)


class _Package(types.ModuleType):
    """This package's module type: `masks` stays the function `sparsify.masks`.

    `masks` names both a submodule and an exported function; importing the submodule would bind
    it on the package, so that binding is ignored (`from sparse_kernels.masks import nm_mask`
    still works). lazy_loader guards only a function named like the submodule defining it.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
