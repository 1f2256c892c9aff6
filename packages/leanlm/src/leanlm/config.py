"""Run configuration: frozen dataclasses, one per section, filled from Python or from TOML.

A TOML file mirrors the dataclasses: top-level keys of `RunConfig`, one table per section
(`[data]`, `[tokenizer]`, `[model]`) and one per stage (`[pretrain]`, ...). Unknown keys, wrong
types and impossible values raise `ConfigError` (a `ValueError`) naming the dotted key, before any
work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import tomli_w

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration value; `key` is the dotted path of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"config key `{key}`: {message}")

    def under(self, section: str) -> ConfigError:
        """The same error with `section.` prepended to its key."""
        return ConfigError(f"{section}.{self.key}", self.message)


def _non_negative(obj: object, *names: str, zero: str = "") -> None:
    """`ConfigError` unless every named field is >= 0; `zero` says what 0 means, if anything."""
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            meaning = f" (0 = {zero})" if zero else ""
            raise ConfigError(name, f"must be >= 0{meaning}, got {value!r}")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(name, f"must be > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it is cut into training sequences."""

    source: Literal["stdlib", "files", "hub"] = "stdlib"
    """`stdlib`: the running interpreter's standard-library source plus `pydoc_data/topics.py`
    (no network); `files`: local text files; `hub`: a `datasets` name or local dataset folder."""
    files: tuple[str, ...] = ()
    """For `source="files"`: text files (one document each)."""
    validation_files: tuple[str, ...] = ()
    """For `source="files"`: explicit validation files; empty = split `files` by file."""
    hub_name: str = ""
    """For `source="hub"`: the `datasets.load_dataset` path, e.g. `wikitext` or a local folder."""
    hub_config: str | None = None
    """For `source="hub"`: the dataset configuration, e.g. `wikitext-103-raw-v1`."""
    hub_train_split: str = "train"
    """For `source="hub"`: the split used for training."""
    hub_validation_split: str = "validation"
    """For `source="hub"`: the split used for validation."""
    text_column: str = "text"
    """For `source="hub"`: the column holding the text."""
    include_tests: bool = False
    """For `source="stdlib"`: also use the standard library's `test/` package."""
    max_bytes: int = 0
    """Use files in sorted order until this many bytes (0 = all). Not applied to `hub`."""
    validation_fraction: float = 0.05
    """Share of files held out for validation when splitting by file (by a hash of the name)."""
    seq_len: int = 256
    """Tokens per training sequence and per validation window."""
    eval_windows: int = 64
    """Validation windows of `seq_len` tokens, spread evenly over the validation split, that every
    stage is scored on; 0 = all."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len")
        if self.eval_windows < 0:
            raise ConfigError("eval_windows", f"must be >= 0 (0 = all), got {self.eval_windows}")
        if self.max_bytes < 0:
            raise ConfigError("max_bytes", f"must be >= 0 (0 = no limit), got {self.max_bytes}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError(
                "validation_fraction", f"must be in (0, 1), got {self.validation_fraction}"
            )
        if self.source == "files" and not self.files:
            raise ConfigError("files", 'must list at least one file when `source = "files"`')
        if self.source == "hub" and not self.hub_name:
            raise ConfigError("hub_name", 'must name a dataset when `source = "hub"`')


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """The byte-level BPE tokenizer trained on the training split."""

    vocab_size: int = 8192
    """Vocabulary size, special tokens included."""
    min_frequency: int = 2
    """Minimum pair frequency for a BPE merge."""

    def __post_init__(self) -> None:
        _positive(self, "min_frequency")
        if self.vocab_size < 260:
            # 256 byte symbols + the special tokens must fit.
            raise ConfigError(
                "vocab_size", f"must be >= 260 (256 bytes + specials), got {self.vocab_size}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama decoder (`LlamaForCausalLM`); its vocabulary comes from the tokenizer."""

    hidden_size: int = 256
    """Width of the residual stream."""
    intermediate_size: int = 688
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 4
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_key_value_heads: int = 2
    """Key/value heads per layer (GQA when fewer than query heads)."""
    max_position_embeddings: int = 1024
    """Longest sequence the rotary embedding is set up for (>= `data.seq_len`)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output projection."""
    initializer_range: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rope_theta",
            "initializer_range",
        )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"({self.num_attention_heads}) must divide `hidden_size` ({self.hidden_size})",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads})",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings shared by the stages that train (warmup + cosine schedule, checkpoints)."""

    optimizer: Literal["came", "adamw", "adafactor"] = "came"
    """`came` (optim-came: Adam-like quality at about half AdamW's optimizer memory), `adamw`
    (torch) or `adafactor` (optim-adafactor: factored second moments, least memory)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """With several processes: 0 = replicate (accelerate DDP); 1/2/3 = shard optimizer state /
    + gradients / + parameters across processes with shard-zero (CPU/gloo for now). Ignored with
    one process."""
    steps: int = 200
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per process per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (per process)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` (cosine decay)."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (norm weights are not decayed)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas; CAME takes β1 from here (β2, β3 = 0.999, 0.9999); Adafactor ignores them."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    eval_every: int = 50
    """Evaluate validation perplexity every this many steps (and at the end)."""
    eval_batch_size: int = 16
    """Windows per evaluation forward pass."""
    checkpoint_every: int = 50
    """Write a resumable training checkpoint every this many steps (0 = never)."""
    keep_checkpoints: int = 2
    """Training checkpoints kept on disk (older ones are deleted)."""
    log_every: int = 1
    """Write a `metrics.jsonl` / TensorBoard row every this many steps."""
    max_bad_steps: int = 10
    """Steps with a NaN/inf loss or gradient are skipped; past this many the stage writes a
    checkpoint and stops with an error."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "steps",
            "micro_batch_size",
            "grad_accum_steps",
            "lr",
            "eval_every",
            "eval_batch_size",
            "keep_checkpoints",
            "log_every",
        )
        _non_negative(
            self, "warmup_steps", "weight_decay", "grad_clip", "checkpoint_every", "max_bad_steps"
        )
        if self.warmup_steps >= self.steps:
            raise ConfigError(
                "warmup_steps", f"({self.warmup_steps}) must be < `steps` ({self.steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must both be in [0, 1), got {self.betas}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(TrainConfig):
    """Stage `pretrain`: train `model` from scratch on the corpus."""


PRUNE_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
)
"""The model sizes `[prune]` may lower (each also a `[model]` key)."""


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

    def __post_init__(self) -> None:
        _positive(self, "calibration_samples", "calibration_batch_size")
        _non_negative(self, *PRUNE_SIZES, zero="keep")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads and kv and heads % kv:
            raise ConfigError(
                "num_key_value_heads", f"({kv}) must divide `num_attention_heads` ({heads})"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig(TrainConfig):
    """Stage `distill`: train the previous stage's model to match a teacher's logits."""

    teacher_stage: str = "pretrain"
    """The earlier stage whose model is the teacher (`"init"`: `RunConfig.init_model`)."""
    temperature: float = 1.0
    """Softmax temperature of the KL (the loss is scaled by T^2)."""
    lm_loss_weight: float = 0.0
    """Weight of the next-token cross-entropy in the loss (the KL gets 1 - this)."""
    top_k: int = 0
    """Distill on the teacher's top-k logits only (0 = the full vocabulary)."""
    hidden_loss_weight: float = 0.0
    """Weight of prune-distill's intermediate hidden-state loss, added to the KL/CE mix (0 = off):
    1 - cosine between student and teacher layer outputs after each model's final norm. When
    the `prune` stage made the student from this teacher, each student layer is matched to the
    layer it was cut from; otherwise the student's layers are spread evenly over the teacher's
    (last onto last). When the hidden sizes
    differ, a learned linear map to the teacher's width trains with the student; it is kept in
    the training checkpoints but not in the saved model. Minitron found it helps only when depth
    is cut a lot."""
    teacher_correction_steps: int = 0
    """Before distilling, fine-tune a copy of the teacher for this many optimizer steps on the
    distillation data (Minitron's "teacher correction": next-token loss, the stage's optimizer,
    batch size and `grad_clip`, constant LR, the same batches as the first distillation steps;
    every process computes the same corrected teacher). 0 = off."""
    teacher_correction_lr: float = 0.0
    """Learning rate of the teacher correction (0 = `lr` / 5, the ratio Minitron's second paper
    is reported to use for its teacher's fine-tune)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "temperature")
        if not 0.0 <= self.lm_loss_weight <= 1.0:
            raise ConfigError("lm_loss_weight", f"must be in [0, 1], got {self.lm_loss_weight}")
        _non_negative(self, "top_k", zero="full vocabulary")
        _non_negative(self, "hidden_loss_weight", zero="off")
        _non_negative(self, "teacher_correction_steps", zero="no correction")
        _non_negative(self, "teacher_correction_lr", zero="`lr` / 5")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsifyConfig(TrainConfig):
    """Stage `sparsify`: one-shot pruning of the decoder Linears, then a sparse fine-tune.

    Pruning is sparse-kernels' `sparsify_`; the fine-tune (next-token loss) keeps the masks
    fixed; `steps` = 0 skips it.

    The fine-tune may be sharded with ZeRO-1/2 (the masks hold, and the updates equal the
    replicated run's; ZeRO-3 is not supported here yet). The output folder holds the
    dense-format model with zeros baked in (loads with `AutoModelForCausalLM`) plus its masks;
    `compressed.safetensors` next to it is the compact format (2:4 values + metadata, or
    bitmask + kept values).
    """

    pattern: str = "2:4"
    """`"N:M"` (keep N of every M input weights), `"unstructured"` or `"block"`."""
    method: Literal["magnitude", "wanda", "sparsegpt"] = "wanda"
    """How weights are scored: |W|, Wanda |W|·‖X‖, or SparseGPT (OBS with weight updates)."""
    sparsity: float = 0.5
    """Fraction of zeros for `unstructured` / `block` (N:M patterns fix it at 1 - N/M)."""
    block_size: int = 16
    """Tile edge for `pattern = "block"`."""
    calibration_samples: int = 64
    """Training sequences used for Wanda / SparseGPT statistics."""
    calibration_batch_size: int = 16
    """Sequences per calibration forward pass."""
    steps: int = 50
    lr: float = 1e-3
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        _non_negative(self, "steps", zero="no fine-tune")
        if self.steps:  # the training settings matter only when there is a fine-tune
            super().__post_init__()
        _positive(self, "calibration_samples", "calibration_batch_size", "block_size")
        if self.zero_stage == 3:
            raise ConfigError(
                "zero_stage",
                "(3) is not supported for sparse fine-tuning yet (ZeRO-3 frees the masked "
                "weights between uses and the sparse export reads them); use 0, 1 or 2",
            )
        nm = re.fullmatch(r"(\d+):(\d+)", self.pattern)
        if nm is None and self.pattern not in ("unstructured", "block"):
            raise ConfigError(
                "pattern",
                f"must be 'N:M' (e.g. '2:4'), 'unstructured' or 'block', got {self.pattern!r}",
            )
        if nm is not None and not 0 < int(nm[1]) < int(nm[2]):
            raise ConfigError("pattern", f"N:M needs 0 < N < M, got {self.pattern!r}")
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError("sparsity", f"must be in [0, 1), got {self.sparsity}")


STAGE_NAMES = ("pretrain", "prune", "distill", "sparsify")
INIT_STAGE = "init"
"""The name `distill.teacher_stage` uses for `RunConfig.init_model`."""
"""Stages a run can list."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run: data, tokenizer, model, and the stages to run in order."""

    name: str = "leanlm"
    """Shown in the report."""
    seed: int = 0
    """Seeds model initialisation and data order."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast precision for training and evaluation (parameters stay fp32)."""
    cache_dir: str | None = None
    """Tokenizer / dataset cache; default `$LEANLM_CACHE_DIR` or `~/.cache/leanlm`."""
    stages: tuple[str, ...] = ("pretrain",)
    """Stages to run, in order; each reads the previous stage's output directory."""
    init_model: str = ""
    """Start from this Hugging Face causal LM (a local folder or a hub id) instead of training
    one: its tokenizer replaces `[tokenizer]` and `[model]`, `pretrain` (if listed) continues
    training it, and the run may start with `prune`, `distill` or `sparsify`; `distill` may use
    it as teacher (`teacher_stage = "init"`). Empty: `pretrain` builds `[model]` from scratch."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """The corpus."""
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    """The tokenizer."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model trained by `pretrain`."""
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    """Settings of the `pretrain` stage."""
    prune: PruneConfig = dataclasses.field(default_factory=PruneConfig)
    """Settings of the `prune` stage."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """Settings of the `distill` stage."""
    sparsify: SparsifyConfig = dataclasses.field(default_factory=SparsifyConfig)
    """Settings of the `sparsify` stage."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError("stages", f"must list at least one stage of {list(STAGE_NAMES)}")
        for stage in self.stages:
            if stage not in STAGE_NAMES:
                raise ConfigError("stages", f"unknown stage {stage!r}; known: {list(STAGE_NAMES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages", f"lists a stage twice: {list(self.stages)}")
        if self.stages[0] != "pretrain" and not self.init_model:
            raise ConfigError(
                "stages",
                f"{self.stages[0]!r} needs a previous stage's model; start with 'pretrain' or "
                "set `init_model`",
            )
        if "pretrain" in self.stages[1:]:
            raise ConfigError("stages", f"'pretrain' can only come first: {list(self.stages)}")
        if "distill" in self.stages:
            teacher = self.distill.teacher_stage
            before = list(self.stages[: self.stages.index("distill")])
            if self.init_model:
                before.append(INIT_STAGE)
            if teacher not in before:
                init = " (or 'init' for `init_model`)" if self.init_model else ""
                raise ConfigError(
                    "distill.teacher_stage",
                    f"{teacher!r} must be a stage that runs before 'distill'{init}; "
                    f"stages: {list(self.stages)}",
                )
        if not self.init_model:  # with `init_model` the sizes come from that model
            self._check_prune_target()
        if self.model.max_position_embeddings < self.data.seq_len:
            raise ConfigError(
                "model.max_position_embeddings",
                f"({self.model.max_position_embeddings}) must be >= `data.seq_len` "
                f"({self.data.seq_len})",
            )

    def _check_prune_target(self) -> None:
        target, model = self.prune, self.model
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

    def stage_config(self, stage: str) -> Any:
        """The config section of `stage` (e.g. `self.pretrain`)."""
        return getattr(self, stage)

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all of them if none are given)."""
        data = to_dict(self)
        chosen = {k: data[k] for k in sections} if sections else data
        payload = json.dumps(chosen, sort_keys=True, default=str).encode()
        return hashlib.sha256(payload).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Mapping <-> dataclass conversion with key-naming errors.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert TOML lists / tables."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(key, f"must have {len(args)} items, got {len(value)}: {value!r}")
        return tuple(
            _convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a table, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, prefix=key)  # type: ignore[arg-type]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        raise ConfigError(key, f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build the dataclass `cls` from a (TOML) mapping, checking keys, types and values.

    Raises:
        ConfigError: naming the dotted key of the first unknown key, wrong type or bad value.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    dotted = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: k)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(dotted(key), f"unknown key{hint}")
    kwargs = {key: _convert(value, hints[key], dotted(key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise (err.under(prefix) if prefix else err) from None


def to_dict(config: Any) -> dict[str, Any]:
    """A config as plain TOML-friendly data (tuples become lists, `None` values are dropped)."""

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return clean(dataclasses.asdict(config))  # type: ignore[no-any-return]


def load_toml(path: str | Path) -> RunConfig:
    """Read a `RunConfig` from a TOML file.

    Raises:
        ConfigError: for unknown keys, wrong types or impossible values (naming the key).
        FileNotFoundError: if `path` does not exist.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from err
    return from_dict(RunConfig, data)


def dumps_toml(config: RunConfig) -> str:
    """The config as TOML text that `load_toml` reads back to an equal config."""
    return tomli_w.dumps(to_dict(config))
