"""The sections every run has (`[data]`, `[tokenizer]`, `[model]`) and the shared training settings.

A stage's own section lives in its module (`leanlm.pretrain.PretrainConfig`, ...); a stage that
trains subclasses `TrainConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from leanlm.config.configio import ConfigError, non_negative, positive

OptimizerName = Literal["came", "adamw", "adafactor"]
"""`came`: `optim_came.CAME` (Adam-like quality, factored second moments: about half AdamW's
state); `adamw`: `torch.optim.AdamW`; `adafactor`: `optim_adafactor.Adafactor` (factored second
moments, no first moment: O(rows + cols) state per matrix)."""

INIT_STAGE = "init"
"""The name a stage uses for `RunConfig.init_model`'s model (e.g. `distill.teacher_stage`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how it is cut into training sequences.

    A key for another `source` than the one set (`SOURCE_KEYS`) is refused, naming it: that
    source would ignore it.
    """

    source: Literal["stdlib", "files", "hub"] = "stdlib"
    """`stdlib`: the running interpreter's standard-library source plus `pydoc_data/topics.py`
    (no network); `files`: local text files; `hub`: a `datasets` name or local dataset folder."""
    files: tuple[str, ...] = ()
    """For `source="files"`: text files (one document each)."""
    validation_files: tuple[str, ...] = ()
    """For `source="files"`: explicit validation files; empty = split `files` by file."""
    hub_name: str = ""
    """For `source="hub"`: the `datasets.load_dataset` path, e.g. `wikitext`, a local folder, or
    a builder for local files (`json`, `parquet`, `text`, `csv`) with `data_files`."""
    data_files: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """For `source="hub"`: `datasets.load_dataset`'s `data_files`, split name -> files (paths or
    glob patterns), e.g. `{train = ["a.jsonl"], validation = ["b.jsonl"]}`; empty = none."""
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
    """For `source="stdlib"` / `"files"`: use files in sorted order until this many bytes (0 =
    all). Not applied to `hub`, so refused there."""
    validation_fraction: float = 0.05
    """For `source="stdlib"` / `"files"`: share of files held out for validation when splitting
    by file (by a hash of the name); with `validation_files` it is not used, so refused."""
    seq_len: int = 256
    """Tokens per training sequence and per validation window."""
    eval_windows: int = 64
    """Validation windows of `seq_len` tokens, spread evenly over the validation split, that every
    stage is scored on; 0 = all. With `streaming`: the first this many of the validation stream."""
    streaming: bool = False
    """For `source="hub"`: read the splits through `datasets` streaming and tokenize the training
    text on the fly, never holding the tokenized corpus in memory; training windows are taken
    in stream order (no shuffling) and the stream position is saved in checkpoints."""
    packing: bool = False
    """Pack documents into `seq_len` windows with per-document position ids (restarting at 0 after
    each end-of-sequence token), so attention never crosses a document boundary, and no loss on
    predicting a document's first token from the one before. Training stage `pretrain` only."""

    def __post_init__(self) -> None:
        positive(self, "seq_len")
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
        self._check_source_keys()
        for split, files in self.data_files.items():
            if not files:
                raise ConfigError(f"data_files.{split}", "must list at least one file")

    def _check_source_keys(self) -> None:
        """A key that `source` does not read is refused (it would be ignored), naming it.

        A key at its default counts as not given: a written-out config lists every key.
        """
        defaults = {f.name: f for f in dataclasses.fields(self)}
        for key, sources in SOURCE_KEYS.items():
            field = defaults[key]
            default = field.default_factory() if callable(field.default_factory) else field.default
            value = getattr(self, key)
            if self.source not in sources and value != default:
                which = " or ".join(f'`source = "{s}"`' for s in sources)
                shown = _as_toml(value)
                raise ConfigError(
                    key,
                    f"is for {which}, got {shown!r} with source {self.source!r}, which ignores "
                    "it: remove it",
                )
        fraction = self.validation_fraction
        if self.validation_files and fraction != defaults["validation_fraction"].default:
            raise ConfigError(
                "validation_fraction",
                f"({fraction}) splits `files` when `validation_files` is empty; "
                "with `validation_files` set it is not used: remove it",
            )


def _as_toml(value: object) -> object:
    """`value` with its tuples as lists, as the TOML file wrote it (for messages)."""
    if isinstance(value, dict):
        return {k: _as_toml(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    "files": ("files",),
    "validation_files": ("files",),
    "include_tests": ("stdlib",),
    "max_bytes": ("stdlib", "files"),
    "validation_fraction": ("stdlib", "files"),
    "hub_name": ("hub",),
    "data_files": ("hub",),
    "hub_config": ("hub",),
    "hub_train_split": ("hub",),
    "hub_validation_split": ("hub",),
    "text_column": ("hub",),
    "streaming": ("hub",),
}
"""The `[data]` keys that only some sources read (`leanlm.data.sources.load_corpus`,
`leanlm.data.hub.load_hub`), with those sources; the other keys apply to every source."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """The byte-level BPE tokenizer trained on the training split."""

    vocab_size: int = 8192
    """Vocabulary size, special tokens included."""
    min_frequency: int = 2
    """Minimum pair frequency for a BPE merge."""

    def __post_init__(self) -> None:
        positive(self, "min_frequency")
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
        positive(
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
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim % 2:  # rotary embeddings rotate pairs of dimensions
            step = 2 * self.num_attention_heads
            fit = -(-self.hidden_size // step) * step
            raise ConfigError(
                "hidden_size",
                f"({self.hidden_size}) / `num_attention_heads` ({self.num_attention_heads}) = "
                f"{head_dim} dimensions per head, which rotary embeddings need even: use a "
                f"`hidden_size` that is a multiple of {step} (e.g. {fit})",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings shared by the stages that train (warmup + cosine schedule, checkpoints)."""

    optimizer: OptimizerName = "came"
    """`came` (optim-came: Adam-like quality at about half AdamW's optimizer memory), `adamw`
    (torch) or `adafactor` (optim-adafactor: factored second moments, least memory)."""
    engine: Literal["ddp", "zero", "fsdp2"] | None = None
    """How several processes share the work (`leanlm.train.engines`): `"ddp"` replicates the model
    (accelerate's DDP); `"zero"` shards it with shard-zero at `zero_stage`; `"fsdp2"` shards
    parameters, gradients and optimizer state with PyTorch's FSDP2 (`fully_shard` per decoder
    layer; any `optimizer`; checkpoints reshard). Unset: `"zero"` when `zero_stage` > 0, else
    `"ddp"`. One process runs unsharded, but its checkpoints keep this engine's format, so
    they resume on several processes (and theirs on one)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """For `engine = "zero"` (the default engine when this is > 0): 1/2/3 = shard optimizer
    state / + gradients / + parameters across processes with shard-zero (tested on CPU/gloo);
    0 = no sharding (then the engine is `"ddp"`)."""
    zero_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    """For `zero_stage` 2-3: the sharded accumulator that holds the reduced gradients between
    micro-batches (`grad_accum_steps` > 1). `bf16` halves it, rounding each micro-batch's
    reduced gradient to bf16 (shard-zero's `ZeroConfig.accum_dtype`)."""
    zero_offload_accum: bool = False
    """For `zero_stage` 2-3: keep that accumulator in host memory between micro-batches
    (shard-zero's `ZeroConfig.offload_accum`): accumulation then costs no accelerator memory,
    paid in host transfers of the accumulator's size per micro-batch."""
    zero_offload_optimizer: bool = False
    """For `engine = "zero"` (any `zero_stage`): ZeRO-Offload, shard-zero's
    `ZeroConfig.offload_optimizer`: the fp32 master shards, their gradients and the optimizer
    state live in host memory and the optimizer steps there, on the CPU; the accelerator keeps
    the compute parameters only. Same updates as without it."""
    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """For `optimizer = "came"`: the dtype of its one full-size state, the first moment
    (optim-came's `state_dtype`): `fp32` (4 B per parameter), `bf16` (2 B), or `int8`
    (blockwise 8-bit codes with one fp32 scale per 128 elements of a row, about 1.04 B; see the
    optim-came README for its quality and its CPU step time). `optimizer = "adafactor"` takes
    `int8` too: Adafactor then keeps a momentum (β1 = `betas[0]`) in those 8-bit codes (fp32:
    no momentum)."""
    compile: bool = False
    """`torch.compile` each decoder layer of the trained model (its `forward`, in place, before
    the engine wraps or shards it, as torchtitan compiles per block before FSDP; the engine's
    hooks stay outside the compiled code). The first step (and the first evaluation) pays the
    compile time, about a minute for the smoke preset on a 2-core CPU without inductor's on-disk
    cache (benchmarks/RESULTS.md)."""
    steps: int = 200
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per process per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (per process)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of `lr`: transformers'
    `get_cosine_with_min_lr_schedule_with_warmup`, whose value at step s (counted from 0) step
    s applies, so `lr x min_lr_ratio` is reached after the last step, which runs just above it."""
    warmup_steps: int = 20
    """Linear warmup steps: step s (counted from 0) < `warmup_steps` runs at
    `lr x s / warmup_steps`, the first at 0 (transformers' convention). `metrics.jsonl`'s `lr` is
    the one each step applied."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (norm weights are not decayed)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas; CAME takes β1 from here (β2, β3 = 0.999, 0.9999); Adafactor ignores them
    unless `state_dtype = "int8"` (then β1 = `betas[0]`)."""
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
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input during the forward and recompute the layer in the
    backward (transformers' `activation_checkpointing_enable`, non-reentrant
    `torch.utils.checkpoint`, per decoder layer, set before the engine wraps the model): activation
    memory falls from every layer's intermediates to each layer's input plus one layer's
    intermediates, for about one more forward per step."""

    _steps_given: ClassVar[bool] = True
    """False for a stage that computes its own `steps` (`control`)."""

    def __post_init__(self) -> None:
        positive(
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
        non_negative(
            self, "warmup_steps", "weight_decay", "grad_clip", "checkpoint_every", "max_bad_steps"
        )
        if self._steps_given and self.warmup_steps >= self.steps:
            raise ConfigError(
                "warmup_steps", f"({self.warmup_steps}) must be < `steps` ({self.steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must both be in [0, 1), got {self.betas}")
        if self.engine == "zero" and not self.zero_stage:
            raise ConfigError("zero_stage", 'must be 1, 2 or 3 with `engine = "zero"`, got 0')
        if self.engine in ("ddp", "fsdp2") and self.zero_stage:
            raise ConfigError(
                "zero_stage",
                f'({self.zero_stage}) is for `engine = "zero"`; with `engine = '
                f'"{self.engine}"` leave it at 0',
            )

        for key, default in (("zero_accum_dtype", "fp32"), ("zero_offload_accum", False)):
            value = getattr(self, key)
            if value != default and (self.resolved_engine != "zero" or self.zero_stage < 2):
                raise ConfigError(
                    key,
                    f'({value!r}) is for `engine = "zero"` with `zero_stage` 2 or 3 (stage 1 '
                    "accumulates full gradients, as DDP), got "
                    f"engine {self.resolved_engine!r}, zero_stage {self.zero_stage}",
                )

        adafactor_int8 = self.optimizer == "adafactor" and self.state_dtype == "int8"
        if self.state_dtype != "fp32" and self.optimizer != "came" and not adafactor_int8:
            raise ConfigError(
                "state_dtype",
                f'({self.state_dtype!r}) is for `optimizer = "came"`, got optimizer '
                f'{self.optimizer!r}: leave it at "fp32" (`optimizer = "adafactor"` takes '
                '"int8" only: momentum with β1 = `betas[0]`, kept in 8 bits)',
            )

        if self.zero_offload_optimizer and self.resolved_engine != "zero":
            raise ConfigError(
                "zero_offload_optimizer",
                f'(True) is for `engine = "zero"` (shard-zero\'s ZeRO-Offload), got engine '
                f"{self.resolved_engine!r}: set `zero_stage` to 1, 2 or 3, or leave it false",
            )

    @property
    def resolved_engine(self) -> Literal["ddp", "zero", "fsdp2"]:
        """`engine`, or its default: `"zero"` when `zero_stage` > 0, else `"ddp"`."""
        if self.engine is not None:
            return self.engine
        return "zero" if self.zero_stage else "ddp"
