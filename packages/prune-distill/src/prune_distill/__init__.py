"""Minitron-style structured pruning of Hugging Face causal LMs, and distillation.

```python
from prune_distill import collect_importance, prune, PruneTarget, DistillConfig, distill

scores = collect_importance(model, batches)  # forward-only hooks, no grads
student = prune(model, scores, PruneTarget(hidden_size=..., intermediate_size=...))
distill(student, model, batches, DistillConfig())  # forward KL at T = 1, AdamW
```
"""

from prune_distill.cache import TeacherCache, cache_teacher_topk
from prune_distill.distill import DistillConfig, DistillResult, distill, evaluate_kl
from prune_distill.importance import ImportanceScores, collect_importance
from prune_distill.losses import forward_kl
from prune_distill.prune import PruneTarget, prune

__all__ = [
    "DistillConfig",
    "DistillResult",
    "ImportanceScores",
    "PruneTarget",
    "TeacherCache",
    "cache_teacher_topk",
    "collect_importance",
    "distill",
    "evaluate_kl",
    "forward_kl",
    "prune",
]
