"""Sparsity schedules: objects the training loop calls once per optimizer step.

```python
schedule = GradualPruning(model, final_sparsity=0.9, start_step=0, end_step=1000, frequency=50)
opt = torch.optim.AdamW(model.parameters())  # after the schedule
for batch in loader:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    schedule.step()
```

* `GradualPruning`: Zhu & Gupta, "To prune, or not to prune" (arXiv 1710.01878), cubic
  `s_t = s_f + (s_i - s_f) (1 - (t - t0) / (t1 - t0))³`, magnitude re-masking every
  `frequency` steps between `start_step` and `end_step`. Pruned weights stay zero (the mask
  parametrization zeroes them and their gradient), so the masks only grow.
* `SparseFromStart`: one mask (`sparsify_` with a `SparsityConfig`) before the first step,
  held for the whole run, as in SambaNova's sparse GPT pre-training (arXiv 2304.05511).
* `SparseThenDense`: the same, then at `dense_step` its masks are removed and training
  continues dense on the same Parameter objects (the optimizer keeps working), the
  "sparse then dense finish" of SPDF (arXiv 2303.10464) and torchao's 2:4 training recipe.

Each schedule has `state_dict()` / `load_state_dict()` for its step counter; the masks live in
the model's own state_dict. A schedule attaches its masks when it is built (`GradualPruning`:
all ones until `start_step`), so the model's parameter order is fixed from then on: build the
optimizer after the schedule. To resume, rebuild the model and the schedule with the same
arguments, then load the model's and the schedule's state_dicts (in either order); the
optimizer may be built before or after the model's state_dict is loaded. The
schedule's targeted Linears adapt their structure to the checkpoint being loaded (a mask is
attached, all ones until the checkpoint's mask is copied in, or removed when the checkpoint
is dense), and the schedule's `load_state_dict` brings the model to the structure of the
restored step (`SparseThenDense` past `dense_step`: masks removed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sparse_kernels._remask import check_weight, full_weight, set_mask_
from sparse_kernels.config import SparsityConfig, check_int, parse_pattern
from sparse_kernels.masks import block_mask, unstructured_mask, warn_if_empty
from sparse_kernels.sparsify import (
    apply_mask_,
    get_mask,
    remove_masks_,
    select_targets,
    sparsify_,
    warn_dense_weights,
)


def _match_checkpoint(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    """Load pre-hook: give a targeted Linear the structure of the checkpoint being loaded.

    A masked checkpoint (`parametrizations.weight.original` and a mask) into an unmasked Linear
    attaches an all-ones mask first (the load then copies the checkpoint's mask and weight in);
    a dense checkpoint (`weight`) into a masked Linear removes the mask first.
    """
    masked_keys = f"{prefix}parametrizations.weight."
    has_masked = f"{masked_keys}original" in state_dict and any(
        k.startswith(masked_keys) and k.endswith(".mask") for k in state_dict
    )
    has_dense = f"{prefix}weight" in state_dict
    assert isinstance(module, nn.Linear)
    if has_masked and get_mask(module) is None:
        ones = torch.ones(module.out_features, module.in_features, dtype=torch.bool)
        apply_mask_(module, ones)
    elif has_dense and not has_masked and get_mask(module) is not None:
        remove_masks_(module)


def _follow_checkpoints(modules: Iterable[nn.Module]) -> None:
    """Register `_match_checkpoint` on each module (once)."""
    for module in modules:
        if not getattr(module, "_sparse_kernels_follows_checkpoints", False):
            register: Any = module.register_load_state_dict_pre_hook  # untyped in torch
            register(_match_checkpoint)
            setattr(module, "_sparse_kernels_follows_checkpoints", True)  # noqa: B010


class _Schedule:
    """Step counter shared by the schedules."""

    def __init__(self) -> None:
        self.step_count = 0

    def sparsity_at(self, step: int) -> float:  # pragma: no cover - overridden
        """Target fraction of zeros after `step` optimizer steps."""
        raise TypeError(f"{type(self).__name__} must define sparsity_at")

    def _update(self, step: int) -> None:
        """Act at `step` (masks or none)."""

    def step(self) -> None:
        """Call once after every optimizer step.

        Raises:
            RuntimeError: if a Linear the schedule still has to change is no longer in the model
                (e.g. `to_block_sparse_` replaced it), or if a re-mask finds a weight that is
                not materialised (a ZeRO-3 placeholder: call `step()` inside the engine's
                gather, e.g. `shard_zero.gathered(model, writeback=True)`). Then the model,
                the masks and `step_count` are unchanged.
        """
        step = self.step_count + 1
        if self._pending(step):
            self._check_modules(step)
        self._update(step)
        self.step_count = step

    def _pending(self, step: int) -> bool:
        """Whether the schedule still changes masks at `step` or later."""
        return False

    def _targets(self) -> Mapping[str, nn.Module]:
        """Qualified name -> the Linear the schedule acts on."""
        return {}

    def _check_modules(self, step: int) -> None:
        model: nn.Module = getattr(self, "model")  # noqa: B009 - set by every subclass
        for name, linear in self._targets().items():
            try:
                current: nn.Module | None = model.get_submodule(name)
            except AttributeError:
                current = None
            if current is not linear:
                now = "gone" if current is None else f"now a {type(current).__name__}"
                raise RuntimeError(
                    f"{type(self).__name__}: {name} is no longer the nn.Linear this schedule "
                    f"masks ({now}, e.g. replaced by to_block_sparse_), and the schedule still "
                    f"has to change its mask ({self._work(step)}); replace modules only after "
                    f"that step, or convert back with to_masked_linear_ and rebuild the schedule"
                )

    def _work(self, step: int) -> str:
        """What is left to do at `step`, for the error of `_check_modules`."""
        return ""

    def state_dict(self) -> dict[str, Any]:
        """The step counter (masks are in the model's state_dict)."""
        return {"step_count": self.step_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the step counter (load the model's state_dict, with its masks, too).

        The model is brought to the structure of that step (see the module docstring).
        """
        self.step_count = int(state["step_count"])
        self._restore(self.step_count)

    def _restore(self, step: int) -> None:
        """Bring the model to the structure it has after `step` steps (after a resume)."""


class GradualPruning(_Schedule):
    """Cubic gradual magnitude pruning from `initial_sparsity` to `final_sparsity`.

    Args:
        model: the model; its targeted Linears get masks.
        final_sparsity: s_f, fraction of zeros at and after `end_step`.
        end_step: t1, the step at which s_f is reached.
        initial_sparsity: s_i, applied at `start_step`.
        start_step: t0; before it the masks are all ones (the model trains dense).
        frequency: Δ, re-mask every `frequency` steps (and at `end_step`).
        pattern: `"unstructured"` or `"block"` (N:M has a fixed sparsity: use SparseFromStart).
        block_size: tile edge of the block pattern.
        granularity: unstructured ranking over the `"layer"` or within each `"row"`.
        targets: module regexes as in `SparsityConfig.targets`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        final_sparsity: float,
        end_step: int,
        initial_sparsity: float = 0.0,
        start_step: int = 0,
        frequency: int = 100,
        pattern: str = "unstructured",
        block_size: int = 64,
        granularity: str = "layer",
        targets: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        ints: tuple[tuple[str, object], ...] = (
            ("end_step", end_step),
            ("start_step", start_step),
            ("frequency", frequency),
            ("block_size", block_size),
        )
        for name, value in ints:
            check_int(name, value)
        if parse_pattern(pattern).kind == "nm":
            raise ValueError(
                f"`pattern` ({pattern!r}): N:M has a fixed sparsity; use SparseFromStart"
            )
        for name, value in (
            ("initial_sparsity", initial_sparsity),
            ("final_sparsity", final_sparsity),
        ):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"`{name}` ({value}) must be in [0, 1)")
        if initial_sparsity > final_sparsity:
            raise ValueError(
                f"`initial_sparsity` ({initial_sparsity}) must be <= `final_sparsity` "
                f"({final_sparsity}): the masks only grow"
            )
        if not 0 <= start_step < end_step:
            raise ValueError(f"need 0 <= `start_step` ({start_step}) < `end_step` ({end_step})")
        if frequency < 1:
            raise ValueError(f"`frequency` ({frequency}) must be >= 1")
        if block_size < 1:
            raise ValueError(f"`block_size` ({block_size}) must be >= 1")
        if granularity not in ("layer", "row"):
            raise ValueError(f"`granularity` ({granularity!r}) must be 'layer' or 'row'")
        if granularity == "row" and pattern == "block":
            raise ValueError(
                f"`granularity` ({granularity!r}) applies to the unstructured pattern only: "
                f"`pattern` {pattern!r} ranks whole tiles over the layer"
            )
        self.model = model
        self.initial_sparsity = initial_sparsity
        self.final_sparsity = final_sparsity
        self.start_step = start_step
        self.end_step = end_step
        self.frequency = frequency
        self.pattern = parse_pattern(pattern)
        self.block_size = block_size
        self.per_row = granularity == "row"
        self.modules = select_targets(model, targets)
        if not self.modules:
            raise ValueError(f"no nn.Linear matched `targets` ({targets!r})")
        warn_dense_weights(model, self.modules, "GradualPruning")
        _follow_checkpoints(self.modules.values())
        # every target is masked from now on (all ones until start_step: w * 1 == w exactly), so
        # the model's parameter order is the same at every step, and after a resume whatever
        # the order of building the optimizer and loading the model's checkpoint
        self._attach_ones()
        self._update(0)

    @torch.no_grad()
    def _attach_ones(self) -> None:
        """An all-ones mask on every target that has none."""
        for linear in self.modules.values():
            if get_mask(linear) is None:
                ones = torch.ones(linear.out_features, linear.in_features, dtype=torch.bool)
                apply_mask_(linear, ones)

    def _pending(self, step: int) -> bool:
        return step <= self.end_step

    def _targets(self) -> Mapping[str, nn.Module]:
        return self.modules

    def _work(self, step: int) -> str:
        return f"re-masks up to `end_step` ({self.end_step}), now at step {step}"

    def sparsity_at(self, step: int) -> float:
        """The cubic target at the last re-masking step <= `step` (0 before `start_step`)."""
        if step < self.start_step:
            return 0.0
        if step >= self.end_step:
            return self.final_sparsity
        t = self.start_step + (step - self.start_step) // self.frequency * self.frequency
        frac = (t - self.start_step) / (self.end_step - self.start_step)
        s_i, s_f = self.initial_sparsity, self.final_sparsity
        return s_f + (s_i - s_f) * (1.0 - frac) ** 3

    @torch.no_grad()
    def _update(self, step: int) -> None:
        if step < self.start_step or step > self.end_step:
            return
        if (step - self.start_step) % self.frequency and step != self.end_step:
            return
        sparsity = self.sparsity_at(step)
        # every weight checked first (a placeholder raises here, before any mask changes), then
        # one Linear at a time: a second full set of masks would double their memory
        for name, linear in self.modules.items():
            check_weight("GradualPruning", name, linear, step)
        for name, linear in self.modules.items():
            score = full_weight(linear).abs()
            if self.pattern.kind == "block":
                mask = block_mask(score, self.block_size, sparsity)
            else:
                mask = unstructured_mask(score, sparsity, per_row=self.per_row)
            warn_if_empty(mask, name, sparsity)
            set_mask_(linear, mask)

    def _restore(self, step: int) -> None:
        # every target is masked at every step: attach all-ones masks where none is (a dense
        # checkpoint, saved before the schedule existed); the model's state_dict holds the rest
        self._attach_ones()


class SparseFromStart(_Schedule):
    """A fixed mask from step 0 (`sparsify_(model, config, calibration=...)` at construction).

    Args:
        model: the model (pruned in place now).
        config: the sparsity config (any pattern and method).
        calibration: batches for Wanda / SparseGPT.
        dense_step: if set, the masks are removed after this many steps (training continues
            dense). `SparseThenDense` requires it.
    """

    def __init__(
        self,
        model: nn.Module,
        config: SparsityConfig,
        *,
        calibration: Iterable[Mapping[str, Any]] | None = None,
        dense_step: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, SparsityConfig):
            raise TypeError(
                f"`config` must be a SparsityConfig, got {type(config).__name__} {config!r}: "
                f"pass SparsityConfig(**config) for a dict"
            )
        if dense_step is not None:
            check_int("dense_step", dense_step)
            if dense_step < 1:
                raise ValueError(f"`dense_step` ({dense_step}) must be >= 1")
        self.model = model
        self.config = config
        self.dense_step = dense_step
        self.masks = sparsify_(model, config, calibration=calibration)
        self.modules: dict[str, nn.Module] = {
            name: model.get_submodule(name) for name in self.masks
        }
        self._dense = False
        _follow_checkpoints(self.modules.values())

    def sparsity_at(self, step: int) -> float:
        """`config.target_sparsity` while sparse, 0 once dense."""
        if self.dense_step is not None and step >= self.dense_step:
            return 0.0
        return self.config.target_sparsity

    def _pending(self, step: int) -> bool:
        return self.dense_step is not None and not self._dense

    def _targets(self) -> Mapping[str, nn.Module]:
        return self.modules

    def _work(self, step: int) -> str:
        return f"removes it at `dense_step` ({self.dense_step}), now at step {step}"

    def _update(self, step: int) -> None:
        # only this schedule's masks: another schedule's (or sparsify_'s) stay
        if self.dense_step is not None and step >= self.dense_step and not self._dense:
            for linear in self.modules.values():
                remove_masks_(linear)
            self._dense = True

    def _restore(self, step: int) -> None:
        self._dense = False
        self._update(step)


class SparseThenDense(SparseFromStart):
    """Sparse (fixed mask) for `dense_step` steps, then dense on the same parameters."""

    def __init__(
        self,
        model: nn.Module,
        config: SparsityConfig,
        *,
        dense_step: int,
        calibration: Iterable[Mapping[str, Any]] | None = None,
    ) -> None:
        if dense_step is None:  # a SparseFromStart would never go dense
            raise ValueError(
                "`dense_step` (None) is required by SparseThenDense: the step at which the "
                "masks are removed; use SparseFromStart for a mask kept to the end"
            )
        super().__init__(model, config, calibration=calibration, dense_step=dense_step)
