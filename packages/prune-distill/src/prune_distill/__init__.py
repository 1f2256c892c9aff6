"""Minitron-style structured pruning of Hugging Face causal LMs, and distillation.

```python
from prune_distill import collect_importance, prune, PruneTarget

scores = collect_importance(model, batches)  # forward-only hooks, no grads
student = prune(model, scores, PruneTarget(hidden_size=..., intermediate_size=...))
```
"""

from prune_distill.importance import ImportanceScores, collect_importance
from prune_distill.prune import PruneTarget, prune

__all__ = ["ImportanceScores", "PruneTarget", "collect_importance", "prune"]
