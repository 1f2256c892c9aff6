"""Minitron-style structured pruning of Hugging Face causal LMs, and distillation.

```python
scores = collect_importance(model, batches)  # forward-only hooks, no grads
student = prune(model, scores, PruneTarget(hidden_size=..., intermediate_size=...))
distill(student, model, batches, DistillConfig())  # forward KL at T = 1, AdamW
```

Depth pruning (`contiguous_block_search`), architecture search (`search`), a hidden-state loss
and teacher correction (`correct_teacher`) build on these. Names load on first use (PEP 562), so
`import prune_distill` and `DistillConfig` do not import torch (fast config checks, e.g. leanlm's).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prune_distill.cache import TeacherCache, cache_teacher_topk
    from prune_distill.config import DistillConfig, PruneTarget
    from prune_distill.depth import BlockSearch, contiguous_block_search
    from prune_distill.distill import DistillResult, correct_teacher, distill, evaluate_kl
    from prune_distill.divergences import divergence, jsd, reverse_kl
    from prune_distill.hidden import HiddenStateLoss, even_layer_map, pruned_layer_map
    from prune_distill.importance import ImportanceScores, collect_importance
    from prune_distill.losses import forward_kl
    from prune_distill.prune import prune
    from prune_distill.search import (
        Candidate,
        SearchResult,
        SearchSpace,
        search,
        validation_loss,
    )

_MODULES = {
    "cache": ("TeacherCache", "cache_teacher_topk"),
    "config": ("DistillConfig", "PruneTarget"),
    "depth": ("BlockSearch", "contiguous_block_search"),
    "distill": ("DistillResult", "correct_teacher", "distill", "evaluate_kl"),
    "divergences": ("divergence", "jsd", "reverse_kl"),
    "hidden": ("HiddenStateLoss", "even_layer_map", "pruned_layer_map"),
    "importance": ("ImportanceScores", "collect_importance"),
    "losses": ("forward_kl",),
    "prune": ("prune",),
    "search": ("Candidate", "SearchResult", "SearchSpace", "search", "validation_loss"),
}
_SOURCE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "BlockSearch",
    "Candidate",
    "DistillConfig",
    "DistillResult",
    "HiddenStateLoss",
    "ImportanceScores",
    "PruneTarget",
    "SearchResult",
    "SearchSpace",
    "TeacherCache",
    "cache_teacher_topk",
    "collect_importance",
    "contiguous_block_search",
    "correct_teacher",
    "distill",
    "divergence",
    "evaluate_kl",
    "even_layer_map",
    "forward_kl",
    "jsd",
    "prune",
    "pruned_layer_map",
    "reverse_kl",
    "search",
    "validation_loss",
]


class _Package(types.ModuleType):
    """This package's module type: `distill`, `prune` and `search` stay the functions.

    They name both a submodule and an exported function. Importing a submodule binds its name on
    the package, which would shadow the function, so the binding of such a submodule is ignored
    (the submodules stay importable by their full names: `from prune_distill.search import
    candidates`).
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
