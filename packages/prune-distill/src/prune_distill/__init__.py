"""Minitron-style structured pruning of Hugging Face causal LMs, and distillation.

```python
from prune_distill import collect_importance, prune, PruneTarget, DistillConfig, distill

scores = collect_importance(model, batches)  # forward-only hooks, no grads
student = prune(model, scores, PruneTarget(hidden_size=..., intermediate_size=...))
distill(student, model, batches, DistillConfig())  # forward KL at T = 1, AdamW
```

Optional: `DistillConfig(hidden_loss_weight=...)` adds an intermediate hidden-state loss
(`HiddenStateLoss`), and `correct_teacher(model, batches, steps=...)` fine-tunes a copy of the
teacher on the distillation data first.
"""

from prune_distill.cache import TeacherCache, cache_teacher_topk
from prune_distill.distill import (
    DistillConfig,
    DistillResult,
    correct_teacher,
    distill,
    evaluate_kl,
)
from prune_distill.hidden import HiddenStateLoss, even_layer_map, pruned_layer_map
from prune_distill.importance import ImportanceScores, collect_importance
from prune_distill.losses import forward_kl
from prune_distill.prune import PruneTarget, prune

__all__ = [
    "DistillConfig",
    "DistillResult",
    "HiddenStateLoss",
    "ImportanceScores",
    "PruneTarget",
    "TeacherCache",
    "cache_teacher_topk",
    "collect_importance",
    "correct_teacher",
    "distill",
    "evaluate_kl",
    "even_layer_map",
    "forward_kl",
    "prune",
    "pruned_layer_map",
]
