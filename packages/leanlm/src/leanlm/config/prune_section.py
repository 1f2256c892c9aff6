"""The `[prune]` section: Minitron structured pruning's target sizes or its shape search."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from leanlm.config.configio import ConfigError, library_errors, non_negative, positive
from prune_distill.config import PRUNE_SIZES  # plain Python: loading a config loads no torch

if TYPE_CHECKING:
    from prune_distill import PruneTarget, SearchSpace


SEARCHED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
"""The sizes `search = true` can search (`search_<size>` lists; `prune_distill.SearchSpace`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruneConfig:
    """Stage `prune`: Minitron structured pruning of the previous stage's model (prune-distill).

    Each size left at 0 keeps the model's current value. Importance comes from forward passes
    over calibration sequences of the training split (no gradients).
    """

    hidden_size: int = 0
    """Residual width after pruning (0 = keep)."""
    intermediate_size: int = 0
    """MLP width after pruning (0 = keep)."""
    num_attention_heads: int = 0
    """Query heads per layer after pruning (0 = keep); trimmed within each KV group."""
    num_key_value_heads: int = 0
    """KV groups after pruning (0 = keep); dropping a group drops its query heads."""
    num_hidden_layers: int = 0
    """Layers after pruning (0 = keep)."""
    layer_metric: Literal["block_importance", "lm_loss"] = "block_importance"
    """How layers are ranked for depth pruning."""
    calibration_samples: int = 64
    """Training sequences used to score importance."""
    calibration_batch_size: int = 16
    """Sequences per calibration forward pass."""
    search: bool = False
    """Search the target shape (Minitron's architecture search, `prune_distill.search`) instead
    of pruning to fixed sizes: every combination of the `search_*` choices (a size set above
    fixes its axis; one set nowhere keeps the model's value) whose parameter count is within
    `search_params` ± `search_tolerance` is pruned, distilled for `search_steps` and ranked by
    the loss on the run's validation windows; the best shape is pruned and saved."""
    search_params: int = 0
    """The parameter budget of the search (required with `search = true`)."""
    search_tolerance: float = 0.05
    """Relative tolerance of the budget (Minitron: ±5%)."""
    search_num_hidden_layers: tuple[int, ...] = ()
    """Layer counts to search (empty: not searched)."""
    search_hidden_size: tuple[int, ...] = ()
    """Residual widths to search (empty: not searched)."""
    search_intermediate_size: tuple[int, ...] = ()
    """MLP widths to search (empty: not searched)."""
    search_num_attention_heads: tuple[int, ...] = ()
    """Query-head counts to search (empty: not searched); KV groups are kept."""
    search_steps: int = 50
    """Distillation steps per candidate (forward KL to the input model, AdamW, constant LR;
    Minitron: rankings settle after a few hundred)."""
    search_batch_size: int = 8
    """Training sequences per distillation step (the same seeded batches for every candidate)."""
    search_lr: float = 1e-3
    """Learning rate of each candidate's distillation."""
    search_max_candidates: int = 0
    """Try at most this many candidates, in enumeration order (0 = all within the budget)."""

    def __post_init__(self) -> None:
        positive(self, "calibration_samples", "calibration_batch_size")
        with library_errors(self):
            self.target  # noqa: B018  (prune-distill checks the sizes and the head grouping)
        self._check_search()

    def _check_search(self) -> None:
        """The `search*` keys: lists of distinct positive sizes, set only with `search = true`."""
        positive(self, "search_steps", "search_batch_size", "search_lr")
        non_negative(self, "search_max_candidates", zero="all")
        non_negative(self, "search_params")
        lists = {name: getattr(self, f"search_{name}") for name in SEARCHED}
        for name, values in lists.items():
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if bad or len(set(values)) != len(values):
                raise ConfigError(f"search_{name}", f"({list(values)}) must be distinct sizes >= 1")
        if not 0 <= self.search_tolerance < 1:
            raise ConfigError("search_tolerance", f"({self.search_tolerance}) must be in [0, 1)")
        if not self.search:
            given = [f"search_{n}" for n, v in lists.items() if v]
            given += ["search_params"] if self.search_params else []
            if given:
                raise ConfigError(
                    given[0], "is set but `search` is false: set `search = true` or remove it"
                )
            return
        if not self.search_params:
            raise ConfigError("search_params", "must be > 0 with `search = true` (the budget)")
        if not any(lists.values()):
            keys = ", ".join(f"`search_{n}`" for n in SEARCHED)
            raise ConfigError("search", f"is true but none of {keys} lists choices")
        for name, values in lists.items():
            fixed = getattr(self, name)
            if fixed and values:
                raise ConfigError(
                    name,
                    f"({fixed}) and `search_{name}` ({list(values)}) are both set: a fixed size "
                    "is one choice; set one of them",
                )
        if self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"({self.num_key_value_heads}) cannot be set with `search = true`: the search "
                "keeps every KV group; set it to 0",
            )

    @property
    def search_space(self) -> SearchSpace:
        """The `prune_distill.SearchSpace` of `search = true` (a fixed size is its one choice)."""
        from prune_distill import SearchSpace

        axes: dict[str, Any] = {}
        for name in SEARCHED:
            fixed = getattr(self, name)
            axes[name] = getattr(self, f"search_{name}") or ((fixed,) if fixed else ())
        return SearchSpace(**axes)

    @property
    def target(self) -> PruneTarget:
        """The `prune_distill.PruneTarget` this section describes (0 = keep becomes None)."""
        from prune_distill import PruneTarget

        sizes: dict[str, Any] = {name: getattr(self, name) or None for name in PRUNE_SIZES}
        return PruneTarget(**sizes, layer_metric=self.layer_metric)
