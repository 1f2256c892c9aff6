"""Minitron-style structured pruning of Hugging Face causal LMs, and distillation.

```python
scores = collect_importance(model, batches)  # forward-only hooks, no grads
student = prune(model, scores, PruneTarget(hidden_size=..., intermediate_size=...))
distill(student, model, batches, DistillConfig())  # forward KL at T = 1, AdamW
```

Depth pruning (`contiguous_block_search`), architecture search (`search`), a hidden-state loss
and teacher correction (`correct_teacher`) build on these. The names, listed in `__init__.pyi`,
load on first use (`lazy_loader`), so `import prune_distill` and `DistillConfig` do not import
torch (fast config checks, e.g. leanlm's).
"""

import lazy_loader

# lazy_loader keeps `distill`, `prune` and `search` the functions when their submodules (same
# names) are imported: `from prune_distill.search import candidates` still works.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
