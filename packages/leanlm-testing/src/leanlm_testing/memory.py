"""Live and peak bytes of the tensors that ops create: memory checks that need no allocator.

`LiveBytes` is a dispatch mode: every tensor storage an op returns is counted once (views
share it) until Python frees it. It works on CPU tensors and on fake tensors (`FakeTensorMode`,
shapes and dtypes without data), so a test can bound what a function keeps alive, and a
benchmark can measure a full-size model's passes on a laptop.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live and peak bytes of the tensor storages that ops create (plus those `add`ed).

    `ignore` the tensors that exist before (weights, inputs) to count only what runs create;
    `add` them instead to count them too.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as live until it is freed (once per storage)."""
        storage = tensor.untyped_storage()
        if storage in self.seen:
            return
        nbytes = storage.nbytes()
        self.seen[storage] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)

    def ignore(self, tensor: torch.Tensor) -> None:
        """Never count `tensor`'s storage (nor views of it that ops return)."""
        storage = tensor.untyped_storage()
        if storage not in self.seen:
            self.seen[storage] = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out
