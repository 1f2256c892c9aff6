"""The stage interface: what every pipeline stage is, receives, returns and writes.

A stage is a `Stage` subclass listed in `leanlm.stages.STAGES`; `docs/development.md` walks
through adding one. Stages never import each other: what one leaves for another (the prune
lineage) goes through a neutral module (`leanlm.stages.lineage`), so each can change alone. The
pipeline stores each result with a hash of everything the stage depends on, so a finished stage
is skipped on `--resume` unless its inputs changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from leanlm.config import STAGE_SECTIONS

if TYPE_CHECKING:
    from accelerate import Accelerator

    from leanlm.config import RunConfig
    from leanlm.data.resources import RunResources
    from leanlm.report.metrics import ScalarSink


@dataclass
class StageContext:
    """Everything a stage needs."""

    config: RunConfig
    run_dir: Path
    stage_dir: Path
    """This stage's folder (`run_dir / name`): its `model/`, metrics, checkpoints."""
    input_dir: Path | None
    """The previous stage's model folder; `None` for the first stage."""
    outputs: dict[str, Path]
    """Model folders of the stages that ran before this one, by stage name."""
    accelerator: Accelerator
    resources: RunResources
    resume: bool
    """Continue from this stage's latest training checkpoint if there is one."""
    config_hash: str
    """Hash of everything this stage depends on (its checkpoints must carry the same)."""
    sinks: tuple[ScalarSink, ...] = ()
    """Where the main process mirrors the stage's training scalars besides TensorBoard (a W&B
    run with `[logging] wandb = true`); `leanlm.report.metrics.MetricsLog` takes them."""

    @property
    def name(self) -> str:
        """The stage's name (its section and folder)."""
        return self.stage_dir.name

    @property
    def section(self) -> Any:
        """This stage's own config section (an instance of its `Stage.config`)."""
        return getattr(self.config, self.name)

    @property
    def model_dir(self) -> Path:
        """Where the stage writes its Hugging Face model (and tokenizer)."""
        return self.stage_dir / "model"

    def result(
        self,
        metrics: dict[str, Any],
        *,
        notes: list[str] | None = None,
        loss_label: str | None = None,
        perplexity_points: dict[str, float] | None = None,
    ) -> StageResult:
        """This stage's `StageResult` (its name, hash and model folder filled in)."""
        return StageResult(
            stage=self.name,
            config_hash=self.config_hash,
            model_dir=self.model_dir.relative_to(self.run_dir).as_posix(),
            metrics=metrics,
            loss_label=loss_label or StageResult.loss_label,
            notes=notes or [],
            perplexity_points=perplexity_points or {},
        )


@dataclass(frozen=True)
class StageResult:
    """What a finished stage reports; stored as `<stage_dir>/result.json`."""

    stage: str
    config_hash: str
    model_dir: str
    """The stage's model folder, relative to the run directory (the run can be moved)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Report columns: `params`, `tokens`, `wall_time_s`, `tokens_per_s`, `val_loss`,
    `val_perplexity`, `disk_bytes` (the smallest file of the model it wrote, when that is not
    the model folder's weights) ... (a stage fills what applies; the pipeline adds
    `weights_bytes`, `stored_params`, `nonzero_params` and `peak_rss_mib`)."""
    loss_label: str = "cross-entropy"
    """What the stage's training loss in `metrics.jsonl` is (the loss plot's axis)."""
    notes: list[str] = field(default_factory=list)
    """Sentences the report lists under the table for this stage."""
    perplexity_points: dict[str, float] = field(default_factory=dict)
    """Other validation perplexities of this stage's model at the same size, by label (e.g.
    `one-shot`: before a fine-tune); `size.png` draws each as a grey cross."""

    def save(self, stage_dir: Path) -> None:
        """Write `result.json` atomically (temp file + rename)."""
        stage_dir.mkdir(parents=True, exist_ok=True)
        tmp = stage_dir / "result.json.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, stage_dir / "result.json")

    @classmethod
    def load(cls, stage_dir: Path) -> StageResult | None:
        """The stored result of a finished stage, or `None`."""
        path = stage_dir / "result.json"
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


class Stage:
    """A pipeline stage; subclasses set `name` and `config` and implement `run`.

    `config` is the class of the stage's section (in `leanlm.config`, with the rules that involve
    other sections: which stages must come before it, sizes it must not exceed, ...). `run(ctx)`
    reads the previous stage's Hugging Face model folder (`ctx.input_dir`, `None` for the first
    stage), gets its section as `ctx.section`, writes its model under `ctx.model_dir`
    (`save_pretrained` + tokenizer) and returns a `StageResult` with everything the report shows.
    """

    name: ClassVar[str]
    """The stage's name: its `RunConfig` field, TOML table and run-directory folder."""
    config: ClassVar[type]
    """The class of its config section (a frozen keyword-only dataclass)."""
    summary: ClassVar[str] = ""
    """A few words for `leanlm --help`."""

    def run(self, ctx: StageContext) -> StageResult:
        """Run the stage and return its result (the pipeline saves it)."""
        raise NotImplementedError


STAGES: dict[str, type[Stage]] = {}
"""Stages by name, in pipeline order (`leanlm.stages` registers them)."""

S = TypeVar("S", bound=type[Stage])


def register_stage(cls: S) -> S:
    """Add a stage to `STAGES`; its name and section must be a `RunConfig` stage field's."""
    if cls.name in STAGES:
        raise ValueError(f"a stage named {cls.name!r} is already registered: {STAGES[cls.name]}")
    if not dataclasses.is_dataclass(getattr(cls, "config", None)):
        raise TypeError(f"stage {cls.name!r} must set `config` to its section's dataclass")
    if STAGE_SECTIONS.get(cls.name) is not cls.config:
        raise TypeError(
            f"stage {cls.name!r} needs `RunConfig.{cls.name}` of its section type "
            f"{cls.config.__name__}: add both to `leanlm.config.run.STAGE_SECTIONS` and `RunConfig`"
        )
    STAGES[cls.name] = cls
    return cls
