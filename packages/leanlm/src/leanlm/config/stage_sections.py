"""The sections of the training stages: `[pretrain]`, `[distill]`, `[sparsify]`, `[control]`.

Each checks its own keys; the rules between sections (which stage comes first, the teacher
runs before `distill`, ...) are `leanlm.config.run`'s. Plain Python: no torch is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import prune_distill
from leanlm.config.configio import ConfigError, library_errors, non_negative, positive
from leanlm.config.sections import TrainConfig
from sparse_kernels import SparsityConfig  # plain Python: loading a config loads no torch
from sparse_kernels.config import BLOCK_SIZES


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainConfig(TrainConfig):
    """Stage `pretrain`: train `model` from scratch on the corpus."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig(TrainConfig):
    """Stage `distill`: train the previous stage's model to match a teacher's logits.

    The loss settings are `prune_distill.DistillConfig`'s (`options`), which checks them; the
    training settings are the other training stages'.
    """

    teacher_stage: str = "pretrain"
    """The earlier stage whose model is the teacher (`"init"`: `RunConfig.init_model`)."""
    teacher: Literal["online", "cached"] = "online"
    """`online`: the teacher (frozen, in its checkpoint's dtype) runs beside the student on
    every micro-batch. `cached`: before training, the main process writes the teacher's
    top-`top_k` logits (all of them with `top_k` = 0) of every micro-batch of the stage to
    `distill/teacher-cache` once (`prune_distill.cache_teacher_topk`; atomically, reused by a
    resume with the same settings), the others wait, and the student then trains from the
    files without the teacher in memory. Disk: `steps` x sequences per step x `seq_len` x
    (8 k + 8) bytes (fp32 values, int32 indices, int64 token ids), logged. Not with
    `hidden_loss_weight` or `teacher_correction_steps` (they need the teacher model)."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """The distillation divergence between the teacher's and the student's next-token
    distributions (prune-distill's `divergence`): `forward_kl` KL(teacher || student)
    (Minitron's), `reverse_kl` KL(student || teacher) (mode seeking, MiniLLM) or `jsd`, the
    generalized Jensen-Shannon divergence with mixture weight `beta`. `reverse_kl` (and `jsd`
    with `beta` = 1) needs the teacher's full distribution, so it is refused with `top_k` > 0
    (online or cached); `jsd` with `beta` < 1 stays finite on the renormalised top-k teacher."""
    beta: float = 0.5
    """`jsd`'s teacher weight in the mixture `m = beta * teacher + (1 - beta) * student`, in
    [0, 1]: 0 is the forward KL, 1 the reverse KL, 0.5 the symmetric JSD (TRL's and
    Liger-Kernel's convention). Read by `loss = "jsd"` only; checked to be in [0, 1] always."""
    temperature: float = 1.0
    """Softmax temperature of the divergence (the loss is scaled by T^2)."""
    lm_loss_weight: float = 0.0
    """Weight of the next-token cross-entropy in the loss (the KL gets 1 - this)."""
    top_k: int = 0
    """Distill on the teacher's top-k logits only (0 = the full vocabulary). At most the
    vocabulary, online or cached: a larger value is refused naming `distill.top_k`, at load
    against `tokenizer.vocab_size`, or with `init_model` before any work against its
    `config.json`'s `vocab_size` (a local folder) and when the stage loads its student."""
    hidden_loss_weight: float = 0.0
    """Weight of prune-distill's intermediate hidden-state loss, added to the KL/CE mix (0 = off):
    1 - cosine between student and teacher layer outputs after each model's final norm. When
    the `prune` stage made the student from this teacher, each student layer is matched to the
    layer it was cut from; otherwise the student's layers are spread evenly over the teacher's
    (last onto last). When the hidden sizes
    differ, a learned linear map to the teacher's width (initialised from the run's `seed`)
    trains with the student; it is kept in the training checkpoints but not in the saved model.
    Minitron found it helps only when depth is cut a lot."""
    teacher_correction_steps: int = 0
    """Before distilling, fine-tune a copy of the teacher for this many optimizer steps on the
    distillation data (Minitron's "teacher correction": next-token loss, the stage's optimizer,
    batch size and `grad_clip`, constant LR, the same batches as the first distillation steps;
    every process computes the same corrected teacher). Its tokens are the stage's
    `teacher_correction_tokens` metric, which `control` trains on for too. 0 = off."""
    teacher_correction_lr: float = 0.0
    """Learning rate of the teacher correction (0 = `lr` / 5, the ratio Minitron's second paper
    is reported to use for its teacher's fine-tune)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lm_loss_weight <= 1.0:  # a mix: the KL gets the rest
            raise ConfigError("lm_loss_weight", f"must be in [0, 1], got {self.lm_loss_weight}")
        with library_errors(self):
            self.options  # noqa: B018  (prune-distill checks the loss settings)
        non_negative(self, "teacher_correction_steps", zero="no correction")
        non_negative(self, "teacher_correction_lr", zero="`lr` / 5")
        if self.teacher == "cached":
            for key in ("hidden_loss_weight", "teacher_correction_steps"):
                if getattr(self, key):
                    raise ConfigError(
                        key,
                        f"({getattr(self, key)}) needs the teacher model, which `teacher = "
                        '"cached"` does not load: set it to 0 or use `teacher = "online"`',
                    )

    def check_top_k(self, vocab: int, whose: str) -> None:
        """`top_k` must not exceed the vocabulary of `vocab` tokens (`whose`: where it is read).

        Raises:
            ConfigError: naming `distill.top_k`, both values and what to do.
        """
        if self.top_k > vocab:
            raise ConfigError(
                "distill.top_k",
                f"({self.top_k}) must be <= the vocabulary ({vocab} tokens, {whose}); 0 "
                "distills on the whole vocabulary",
            )

    @property
    def options(self) -> prune_distill.DistillConfig:
        """The loss settings as `prune_distill.DistillConfig` (the KL weighted 1 - CE weight)."""
        return prune_distill.DistillConfig(
            temperature=self.temperature,
            kl_weight=1.0 - self.lm_loss_weight,
            lm_loss_weight=self.lm_loss_weight,
            top_k=self.top_k or None,
            hidden_loss_weight=self.hidden_loss_weight,
            loss=self.loss,
            beta=self.beta,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsifyConfig(TrainConfig):
    """Stage `sparsify`: one-shot pruning of the decoder Linears, then a sparse fine-tune.

    Pruning is sparse-kernels' `sparsify_` with the `SparsityConfig` of `pattern`, `method`,
    `sparsity` and `block_size` (`sparsity_config`, which checks them); the fine-tune (next-token
    loss) keeps the masks fixed; `steps` = 0 skips it.

    The fine-tune may be sharded with ZeRO-1/2/3 or FSDP2 (the masks hold, and the updates equal
    the replicated run's); when sharded, the output is written from the gathered weights. The
    output folder holds the dense-format model with zeros baked in (loads with
    `AutoModelForCausalLM`) plus its masks; `compressed.safetensors` next to it
    is the compact format (2:4 values + metadata, or bitmask + kept values).
    """

    pattern: str = "2:4"
    """`"N:M"` (keep N of every M input weights), `"unstructured"` or `"block"`."""
    method: Literal["magnitude", "wanda", "sparsegpt"] = "wanda"
    """How weights are scored: |W|, Wanda |W|·‖X‖, or SparseGPT (OBS with weight updates)."""
    sparsity: float = 0.5
    """Fraction of zeros for `unstructured` / `block`, in [0, 1). N:M patterns fix it at
    1 - N/M: with one, a value other than that and than this default is refused."""
    block_size: int = 16
    """Tile edge for `pattern = "block"`."""
    calibration_samples: int = 64
    """Training sequences used for Wanda / SparseGPT statistics."""
    calibration_batch_size: int = 16
    """Sequences per calibration forward pass."""
    sequential: bool = True
    """Wanda / SparseGPT: walk the decoder layers in order, scoring each layer on the outputs of
    the already-pruned layers before it, with one layer's statistics in memory (the reference
    implementations' algorithm; SparseGPT at Llama-3-8B shapes: 1.1 GiB of Hessians instead of
    36.5 GiB). Layers at `model.model.layers` only. `false`: score every layer on the dense
    model in one pass, every layer's statistics at once."""
    block_sparse_layers: Literal["auto", True, False] = "auto"
    """For `pattern = "block"`: fine-tune with sparse-kernels' `BlockSparseLinear` layers (only the
    kept tiles stored, trained by its Triton kernels on CUDA, by PyTorch ops on a CPU) instead of
    masked dense Linears. After the one-shot pruning and its evaluation, `to_block_sparse_`
    converts the masked Linears; before the model is saved, `to_masked_linear_` turns them back,
    so the output folder is the same as without. `true` needs `block_size` 16, 32, 64 or 128
    (the kernels' tiles); `"auto"` converts when that holds, there is a fine-tune and the run's
    device is CUDA; `false` never converts. The choice is recorded in the stage folder
    (`block_sparse_layers.json`) and a resumed run keeps it, so its checkpoints load: with
    `"auto"` a run started on a GPU continues block-sparse on a CPU (PyTorch ops) and one started
    on a CPU stays masked on a GPU; an explicit `true` / `false` that contradicts the record is a
    `ConfigError`. Every `engine` takes the layers: `ddp`, `zero`
    (stages 1-3: shard-zero cuts each (tiles, b, b) parameter by whole tiles) and `fsdp2`
    (`Shard(0)`: by tiles too); a sharded run saves its gathered state dict through a copy with
    the same block-sparse layers, so the folder is the same. With AdamW the updates are those
    of the masked fine-tune; with `came` / `adafactor` the factored second-moment statistics of
    a block-sparse layer are kept per b x b tile (its parameter is (tiles, b, b)), not per
    weight matrix."""
    steps: int = 50
    lr: float = 1e-3
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        non_negative(self, "steps", zero="no fine-tune")
        if self.steps:  # the training settings matter only when there is a fine-tune
            super().__post_init__()
        positive(self, "calibration_samples", "calibration_batch_size")
        with library_errors(self, keys={"n": "pattern", "m": "pattern"}):
            self.sparsity_config  # noqa: B018  (sparse-kernels checks the pruning settings)
        self._check_nm_sparsity()
        self._check_block_sparse_layers()

    def _check_nm_sparsity(self) -> None:
        """With an N:M pattern, `sparsity` is in [0, 1) and 1 - N/M (or left at its default).

        sparse-kernels ignores it there (checking it for the other patterns only).
        """
        pattern, value = self.sparsity_config.parsed, self.sparsity
        if pattern.kind != "nm" or not math.isfinite(value):  # NaN / inf: `check_finite`'s
            return
        if not 0.0 <= value < 1.0:
            raise ConfigError("sparsity", f"({value}) must be in [0, 1)")
        fixed = 1.0 - pattern.n / pattern.m
        default = type(self).__dataclass_fields__["sparsity"].default
        if value != default and not math.isclose(value, fixed, rel_tol=1e-6):
            raise ConfigError(
                "sparsity",
                f"({value}) disagrees with `pattern` ({self.pattern!r}), which prunes "
                f"1 - {pattern.n}/{pattern.m} = {fixed:g} of the weights: remove `sparsity` "
                f"(or set it to {fixed:g})",
            )

    def _check_block_sparse_layers(self) -> None:
        value = self.block_sparse_layers
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(
                "block_sparse_layers", f'must be "auto", true or false, got {value!r}'
            )
        if value is not True:
            return
        if self.pattern != "block":
            raise ConfigError(
                "block_sparse_layers",
                f'(true) needs `pattern = "block"`, got {self.pattern!r}: set it to false or '
                '"auto", or use the block pattern',
            )
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(
                "block_sparse_layers",
                f"(true) needs `block_size` in {list(BLOCK_SIZES)} (the block-sparse kernels' "
                f'tiles), got {self.block_size}: change `block_size` or set it to "auto"/false',
            )

    def block_sparse_on(self, device_type: str) -> bool:
        """Whether the fine-tune runs block-sparse layers on a `device_type` device."""
        value = self.block_sparse_layers
        if value != "auto":
            return bool(value) and self.steps > 0
        return (
            device_type == "cuda"
            and self.steps > 0
            and self.pattern == "block"
            and self.block_size in BLOCK_SIZES
        )

    @property
    def sparsity_config(self) -> SparsityConfig:
        """The `sparse_kernels.SparsityConfig` this section describes."""
        return SparsityConfig(
            pattern=self.pattern,
            method=self.method,
            sparsity=self.sparsity,
            block_size=self.block_size,
        )


DENSE_STAGE = "pretrain"
"""The stage whose model the control continues (`init_model` when the run has no pretrain)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControlConfig(TrainConfig):
    """Stage `control`: train the dense pretrained model on, as a fair baseline for compression.

    It continues the `pretrain` stage's model (or `init_model`) with next-token loss for as many
    tokens as the stages between it and `pretrain` used (their `tokens` plus calibration and
    teacher-correction tokens, read from their results), rounded up to whole optimizer steps,
    and scores it on the same validation windows. So `steps` is not read: the stage computes
    it. Everything else (optimizer, learning rate, batch, ...) is as in the other training
    stages.
    """

    _steps_given: ClassVar[bool] = False

    steps: int = 1
    """Not read: the stage trains for the compression stages' tokens (see above)."""
    warmup_steps: int = 5
    """Linear warmup steps (at most the computed steps - 1)."""
    lr: float = 1e-3
