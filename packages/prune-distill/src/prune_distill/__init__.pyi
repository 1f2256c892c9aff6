# The exports, for type checkers and for `lazy_loader.attach_stub` in __init__.py (which loads each
# name from its submodule on first use).
from .cache import TeacherCache as TeacherCache
from .cache import cache_teacher_topk as cache_teacher_topk
from .config import DistillConfig as DistillConfig
from .config import PruneTarget as PruneTarget
from .depth import BlockSearch as BlockSearch
from .depth import contiguous_block_search as contiguous_block_search
from .distill import DistillResult as DistillResult
from .distill import correct_teacher as correct_teacher
from .distill import distill as distill
from .distill import evaluate_kl as evaluate_kl
from .divergences import divergence as divergence
from .divergences import jsd as jsd
from .divergences import reverse_kl as reverse_kl
from .hidden import HiddenStateLoss as HiddenStateLoss
from .hidden import even_layer_map as even_layer_map
from .hidden import pruned_layer_map as pruned_layer_map
from .importance import ImportanceScores as ImportanceScores
from .importance import collect_importance as collect_importance
from .losses import forward_kl as forward_kl
from .prune import prune as prune
from .search import Candidate as Candidate
from .search import SearchResult as SearchResult
from .search import SearchSpace as SearchSpace
from .search import search as search
from .search import validation_loss as validation_loss
