"""Stage `prune`: Minitron-style structured pruning of the previous stage's model.

Importance comes from forward passes over calibration sequences drawn (seeded) from the training
split; `prune_distill.prune` then returns a smaller model of the same transformers class, which
this stage scores on the validation windows and saves. Next to the model it writes the lineage
record of `leanlm.lineage` (the source model folder and the source layer each kept layer was cut
from), which `distill` uses to match layers in its hidden-state loss.

With `search = true` the target shape is not given but searched (Minitron's architecture search,
`prune_distill.search`): every shape of the `search_*` choices within the parameter budget is
pruned, distilled briefly from the input model and ranked by validation loss; the best shape is
then pruned from the same scores and saved (undistilled: the `distill` stage trains it).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from leanlm.configio import ConfigError, library_errors, non_negative, positive
from leanlm.lineage import write_lineage
from leanlm.stages import Stage, StageContext, StageResult, register_stage
from prune_distill.config import PRUNE_SIZES  # plain Python: loading a config loads no torch

if TYPE_CHECKING:
    from leanlm.config import RunConfig
    from prune_distill import ImportanceScores, PruneTarget, SearchResult, SearchSpace


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


@register_stage
class Prune(Stage):
    """Shrink the previous stage's model to the sizes in `config.prune`."""

    name: ClassVar[str] = "prune"
    config: ClassVar[type] = PruneConfig
    summary: ClassVar[str] = "structured pruning"

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """The target sizes do not exceed `[model]`'s and keep whole KV groups.

        Checked before any work whether or not the stage is listed; skipped with `init_model`,
        whose sizes are known only once it is loaded (`prune_distill.prune` checks them then).
        """
        if run.init_model:
            return
        target, model = run.prune, run.model
        kv = target.num_key_value_heads or model.num_key_value_heads
        heads = target.num_attention_heads or model.num_attention_heads
        for name in PRUNE_SIZES:
            value, current = getattr(target, name), getattr(model, name)
            if value > current:
                raise ConfigError(
                    f"prune.{name}",
                    f"({value}) must be <= `model.{name}` ({current}): pruning only shrinks",
                )
        if heads % kv:
            raise ConfigError(
                "prune.num_attention_heads",
                f"({heads}) must be a multiple of the KV heads kept ({kv})",
            )
        for name in SEARCHED:
            values, current = getattr(target, f"search_{name}"), getattr(model, name)
            if any(v > current for v in values):
                raise ConfigError(
                    f"prune.search_{name}",
                    f"({list(values)}) must be <= `model.{name}` ({current}): pruning only shrinks",
                )

    def run(self, ctx: StageContext) -> StageResult:
        """Score importance, prune, evaluate and save (every process computes the same model)."""
        from leanlm.calibration import load_input_with_calibration
        from leanlm.checkpoint import save_atomically
        from leanlm.evaluate import evaluate_perplexity
        from leanlm.model import TRAIN_DTYPE, count_parameters
        from prune_distill import collect_importance, prune, pruned_layer_map

        cfg: PruneConfig = ctx.section
        acc = ctx.accelerator
        start = time.perf_counter()
        # scoring runs forward passes only: the checkpoint's dtype (bf16 halves an 8B model),
        # and the pruned model is saved in it; a search trains its candidates, so fp32 then
        model, batches = load_input_with_calibration(
            ctx,
            samples=cfg.calibration_samples,
            batch_size=cfg.calibration_batch_size,
            dtype=TRAIN_DTYPE if cfg.search else None,
        )
        scores = collect_importance(
            model, batches, num_samples=None, layer_loss=cfg.layer_metric == "lm_loss"
        )
        target, notes, extra = cfg.target, [], {}
        tokens = sum(b["input_ids"].numel() for b in batches)
        if cfg.search:
            result, search_tokens = _search(ctx, cfg, model, scores)
            target = result.ranking[0].target
            notes = _search_notes(cfg, result)
            extra = {"search": _search_rows(result), "search_tokens": search_tokens}
            tokens += search_tokens
        student = prune(model, scores, target)
        layer_map = pruned_layer_map(model, scores, target)
        scoring_time = time.perf_counter() - start
        evaluation = evaluate_perplexity(
            student, ctx.resources.validation_windows, autocast=acc.autocast
        )
        acc.print(
            f"[prune] {count_parameters(model):,} -> {count_parameters(student):,} params, "
            f"validation perplexity {evaluation.perplexity:.2f}"
        )
        if acc.is_main_process:
            tokenizer = ctx.resources.tokenizer
            source = ctx.input_dir
            assert source is not None  # load_input_with_calibration checked it

            def write(folder: Path) -> None:
                student.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                write_lineage(folder, ctx.run_dir, source, layer_map)

            save_atomically(ctx.model_dir, write)
        acc.wait_for_everyone()
        return ctx.result(
            {
                "params": count_parameters(student),
                "tokens": tokens,
                "wall_time_s": time.perf_counter() - start,
                "tokens_per_s": tokens / scoring_time,
                "val_loss": evaluation.loss,
                "val_perplexity": evaluation.perplexity,
                "processes": acc.num_processes,
                **extra,
            },
            notes=notes,
        )


def _search(
    ctx: StageContext, cfg: PruneConfig, model: Any, scores: ImportanceScores
) -> tuple[SearchResult, int]:
    """Run `prune_distill.search` on `model`; the ranking (main process's) and tokens trained.

    The candidates distill on `search_steps` seeded batches of training sequences and are
    ranked by the loss on the run's validation windows.

    Raises:
        ConfigError: `prune.search_params` when no shape of the space is within the budget.
    """
    import torch
    from accelerate.utils import broadcast_object_list

    import prune_distill
    from prune_distill.search import candidates, count_params

    space, budget, tol = cfg.search_space, cfg.search_params, cfg.search_tolerance
    # Every shape of the space (a pruned shape has at most the model's parameters).
    shapes = candidates(model, space, params=count_params(model), tolerance=1 - 1e-9)
    if not any(abs(n - budget) <= tol * budget for _, n in shapes):
        counts = sorted(n for _, n in shapes)
        found = f"from {counts[0]:,} to {counts[-1]:,}" if counts else "none valid"
        raise ConfigError(
            "prune.search_params",
            f"({budget:,}): no shape of the search space has a parameter count within "
            f"±{tol:.0%} of it (its {len(counts)} valid shapes have {found}); change the "
            "budget, the `search_*` choices or `search_tolerance`",
        )
    device = next(model.parameters()).device
    train = ctx.resources.train_blocks
    gen = torch.Generator().manual_seed(ctx.config.seed + 1)  # not the calibration draw
    picks = torch.randint(
        0, train.shape[0], (cfg.search_steps, cfg.search_batch_size), generator=gen
    )
    train_batches = [{"input_ids": train[p].to(device)} for p in picks]
    windows = ctx.resources.validation_windows
    val_batches = [
        {"input_ids": windows[i : i + cfg.search_batch_size].to(device)}
        for i in range(0, windows.shape[0], cfg.search_batch_size)
    ]
    result = prune_distill.search(
        model,
        scores,
        space,
        params=budget,
        tolerance=tol,
        train_batches=train_batches,
        val_batches=val_batches,
        distill_config=prune_distill.DistillConfig(lr=cfg.search_lr, max_steps=cfg.search_steps),
        layer_metric=cfg.layer_metric,
        max_candidates=cfg.search_max_candidates or None,
    )
    result.best = None  # the stage saves the undistilled pruned model of the best shape
    # Every process ran the same search; the main process's ranking decides for all of them.
    result.ranking = broadcast_object_list([result.ranking])[0]
    tokens = len(result.ranking) * sum(b["input_ids"].numel() for b in train_batches)
    return result, tokens


def _shape(target: PruneTarget) -> str:
    return (
        f"{target.num_hidden_layers} layers, hidden {target.hidden_size}, MLP "
        f"{target.intermediate_size}, {target.num_attention_heads} heads"
    )


def _search_notes(cfg: PruneConfig, result: SearchResult) -> list[str]:
    """One sentence for the search, then one per candidate (best first)."""
    best = result.ranking[0]
    notes = [
        f"architecture search: {len(result.ranking)} shape(s) within ±{cfg.search_tolerance:.0%} "
        f"of {cfg.search_params:,} parameters, each distilled {cfg.search_steps} steps "
        f"(batch {cfg.search_batch_size}, lr {cfg.search_lr:g}) and ranked by validation loss; "
        f"chosen: {_shape(best.target)} ({best.params:,} params), saved undistilled."
    ]
    for i, c in enumerate(result.ranking, 1):
        notes.append(
            f"search rank {i}: {_shape(c.target)}, {c.params:,} params, validation loss "
            f"{c.loss_pruned:.4f} pruned, {c.loss_distilled:.4f} distilled."
        )
    return notes


def _search_rows(result: SearchResult) -> list[dict[str, Any]]:
    """The ranking as plain data for `result.json` (best first)."""
    return [
        {
            **{name: getattr(c.target, name) for name in SEARCHED},
            "params": c.params,
            "val_loss_pruned": c.loss_pruned,
            "val_loss_distilled": c.loss_distilled,
        }
        for c in result.ranking
    ]
