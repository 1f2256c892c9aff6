# The exports: read by type checkers, by griffe (the API docs) and by `lazy_loader.attach_stub` in
# __init__.py, which loads each name from its submodule on first use. `__all__` names exactly the
# imported names (leanlm_testing.exports.check_lazy_exports checks it).
from .cache import TeacherCache, cache_teacher_topk
from .config import DistillConfig, PruneTarget
from .depth import BlockSearch, contiguous_block_search
from .distill import DistillResult, correct_teacher, distill, evaluate_kl
from .divergences import divergence, jsd, reverse_kl
from .hidden import HiddenStateLoss, even_layer_map, pruned_layer_map
from .importance import ImportanceScores, collect_importance
from .losses import forward_kl
from .prune import prune
from .search import Candidate, SearchResult, SearchSpace, search, validation_loss

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
