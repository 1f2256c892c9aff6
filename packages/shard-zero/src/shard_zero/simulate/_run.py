"""`simulate`: one training step of a full-size model per system, on fake tensors.

Everything runs in this process under `FakeTensorMode` (shapes and dtypes, no data, no memory)
with torch's fake process group (every collective returns at once, any world size). We play
rank 0, which holds the largest row shards. Each system gets a fresh model, one warm-up step
(optimizer state now exists), then one measured step under `StepTracker` (live bytes by
category) and `CollectiveCounter` (collective calls and bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from shard_zero.simulate._formula import model_state_bytes, optimizer_k
from shard_zero.simulate._presets import model_config
from shard_zero.simulate._systems import (
    Built,
    OptimizerFactory,
    build_fsdp2,
    build_replica,
    build_shard_zero,
    make_optimizer,
    optimizer_name,
)
from shard_zero.simulate._tracker import CollectiveCounter, StepTracker

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What to simulate.

    Attributes:
        model: a preset (`tinyllama-1.1b`, `llama-3-8b`, `llama-3-70b`, `qwen2-7b`,
            `mistral-7b`) or the path of a Hugging Face `config.json`.
        num_layers: keep only this many decoder layers (None: all).
        world_size: data-parallel ranks.
        stages: the shard-zero stages to run.
        optimizer: `adamw`, a `module:Class` spec of an installed optimizer (e.g.
            `optim_came:CAME`, `optim_adafactor:Adafactor`, built as
            `Class(params, **optimizer_kwargs)`) or a factory `f(params) -> Optimizer`.
        optimizer_kwargs: keyword arguments of a `module:Class` optimizer (None: `lr=1e-4`).
        fsdp2_optimizer: the optimizer of the FSDP2 rows (default AdamW, the usual FSDP2
            anchor; None: the same as `optimizer`; optim-came / optim-adafactor run on FSDP2's
            DTensor shards).
        param_dtype: compute dtype (`bf16`: fp32 masters and fp32 gradient reduction; `fp32`).
        micro_batch: sequences per micro-batch and rank.
        seq_len: tokens per sequence.
        micro_batches: micro-batches per step (all but the last without gradient sync).
        accum_dtype: shard-zero's sharded gradient accumulator at stages 2-3 (`fp32`, or
            `bf16`: `ZeroConfig.accum_dtype=torch.bfloat16`); FSDP2 rows are unaffected.
        offload_accum: shard-zero stages 2-3 keep that accumulator in host memory between
            micro-batches (`ZeroConfig.offload_accum`); host bytes are reported apart (`host`)
            and left out of the per-rank peak, which counts the device only.
        offload_optimizer: shard-zero keeps the fp32 masters, their gradients and the
            optimizer's state in host memory and steps the optimizer there
            (`ZeroConfig.offload_optimizer`); those bytes and the step's temporaries are
            reported as `host`, the copies as `to_host` / `from_host`, and the ZeRO formula
            column (device model states with masters and state) is left out.
        bucket_numel: shard-zero's `ZeroConfig.bucket_numel` (None: its default, 2**24):
            the most elements of one gradient reduce-scatter (stage 3: per unit's bucket).
        activation_checkpointing: recompute each decoder layer in backward.
        fsdp2: also run FSDP2 with and without resharding after forward.
        replica: also run a plain replica in the compute dtype (the gradients DDP holds).
        foreach: AdamW's `foreach` (True: the GPU default, with its temporaries).
    """

    model: str = "llama-3-8b"
    num_layers: int | None = None
    world_size: int = 8
    stages: tuple[int, ...] = (1, 2, 3)
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw"
    optimizer_kwargs: Mapping[str, Any] | None = None
    fsdp2_optimizer: str | None = "adamw"
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    micro_batch: int = 1
    seq_len: int = 1024
    micro_batches: int = 1
    accum_dtype: Literal["fp32", "bf16"] = "fp32"
    offload_accum: bool = False
    offload_optimizer: bool = False
    bucket_numel: int | None = None
    activation_checkpointing: bool = False
    fsdp2: bool = True
    replica: bool = False
    foreach: bool = True

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch", "seq_len", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` ({value!r}) must be a positive int")
        if not self.stages or any(s not in (1, 2, 3) for s in self.stages):
            raise ValueError(f"`stages` ({self.stages!r}) must be a non-empty tuple of 1, 2, 3")
        if self.param_dtype not in _DTYPES:
            raise ValueError(f"`param_dtype` ({self.param_dtype!r}) must be 'bf16' or 'fp32'")
        if self.bucket_numel is not None and (
            isinstance(self.bucket_numel, bool)
            or not isinstance(self.bucket_numel, int)
            or self.bucket_numel < 1
        ):
            raise ValueError(f"`bucket_numel` ({self.bucket_numel!r}) must be a positive int")
        if self.accum_dtype not in _DTYPES:
            raise ValueError(f"`accum_dtype` ({self.accum_dtype!r}) must be 'bf16' or 'fp32'")


@dataclass
class SystemResult:
    """One system's measured step (bytes are per rank)."""

    name: str
    peak: dict[str, int] = field(default_factory=dict)  # breakdown at the peak, + "total"
    maxima: dict[str, int] = field(default_factory=dict)  # each category's own maximum
    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    overlap: float = 0.0  # share of backward matmuls after the first reduce-scatter
    timeline: list[int] = field(default_factory=list)
    marks: list[tuple[str, int]] = field(default_factory=list)
    formula: float | None = None  # the ZeRO paper's model states
    formula_stage: int | None = None
    seconds: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # collectives in order: (op index, kind, bytes, in backward, phase, live bytes before)
    events: list[tuple[int, str, int, bool, str, int]] = field(default_factory=list)


@dataclass
class SimReport:
    """Every system of one `simulate` call."""

    config: SimConfig
    psi: int
    systems: list[SystemResult]
    versions: dict[str, str]

    def get(self, name: str) -> SystemResult:
        """The result named `name` (e.g. `shard-zero-3`, `fsdp2-reshard`)."""
        for result in self.systems:
            if result.name == name:
                return result
        raise KeyError(f"no system {name!r}; have {[r.name for r in self.systems]}")


def simulate(config: SimConfig) -> SimReport:
    """Run the systems of `config` on fake tensors and return what they measured.

    Creates (and destroys) a fake process group of `config.world_size` ranks; raises
    `RuntimeError` if this process already has a process group.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "simulate() creates its own fake process group: run it in a process without one"
        )
    model_cfg = model_config(config.model, num_layers=config.num_layers)
    param_dtype = _DTYPES[config.param_dtype]
    kwargs = config.optimizer_kwargs
    optimizer = make_optimizer(config.optimizer, foreach=config.foreach, kwargs=kwargs)
    fsdp2_opt = make_optimizer(
        config.fsdp2_optimizer or config.optimizer, foreach=config.foreach, kwargs=kwargs
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.world_size)
    try:
        mesh = init_device_mesh("cpu", (config.world_size,))  # outside fake mode: real values
        with FakeTensorMode():
            psi = sum(p.numel() for p in _new_model(model_cfg, config).parameters())
            runs = _runs(config, mesh, param_dtype, optimizer, fsdp2_opt)
            results = [_run_one(name, build, model_cfg, config) for name, build, _ in runs]
    finally:
        dist.destroy_process_group()
    param_bytes = param_dtype.itemsize
    for result, (name, _, stage) in zip(results, runs, strict=True):
        opt_name = config.optimizer if name.startswith("shard-zero") else config.fsdp2_optimizer
        if name.startswith("shard-zero") and config.offload_optimizer:
            continue  # the formula counts masters and state on the device
        if name.startswith("fsdp2") and opt_name is None:
            opt_name = config.optimizer
        k = optimizer_k(optimizer_name(opt_name), param_bytes) if opt_name is not None else None
        if stage is not None and k is not None:
            result.formula_stage = stage
            result.formula = model_state_bytes(
                psi=psi, world=config.world_size, stage=stage, param_bytes=param_bytes, k=k
            )
    return SimReport(config, psi, results, _versions())


Builder = Callable[[nn.Module], Built]


def _runs(
    config: SimConfig,
    mesh: Any,
    param_dtype: torch.dtype,
    optimizer: OptimizerFactory,
    fsdp2_opt: OptimizerFactory,
) -> list[tuple[str, Builder, int | None]]:
    """`(name, builder, ZeRO stage of its formula)` for every system to run."""
    runs: list[tuple[str, Builder, int | None]] = []
    for stage in config.stages:

        def zero(m: nn.Module, s: int = stage) -> Built:
            return build_shard_zero(
                m,
                stage=s,
                param_dtype=param_dtype,
                optimizer=optimizer,
                accum_dtype=_DTYPES[config.accum_dtype] if s > 1 else None,
                offload_accum=config.offload_accum and s > 1,
                offload_optimizer=config.offload_optimizer,
                bucket_numel=config.bucket_numel,
            )

        runs.append((f"shard-zero-{stage}", zero, stage))
    if config.fsdp2:
        for reshard, stage in ((True, 3), (False, 2)):

            def fsdp2(m: nn.Module, r: bool = reshard) -> Built:
                return build_fsdp2(
                    m, mesh=mesh, reshard=r, param_dtype=param_dtype, optimizer=fsdp2_opt
                )

            runs.append(("fsdp2-reshard" if reshard else "fsdp2-no-reshard", fsdp2, stage))
    if config.replica:
        runs.append(("replica", lambda m: build_replica(m, param_dtype=param_dtype), None))
    return runs


def _new_model(model_cfg: Any, config: SimConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        model_cfg, attn_implementation="sdpa", dtype=torch.float32
    )
    model.train()
    if config.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model  # type: ignore[no-any-return]


def _run_one(name: str, build: Builder, model_cfg: Any, config: SimConfig) -> SystemResult:
    result = SystemResult(name)
    start = time.perf_counter()
    try:
        built = build(_new_model(model_cfg, config))
        _step(built, config, model_cfg.vocab_size, None)  # warm-up: optimizer state exists
        host = built.host()  # allocated by the warm-up step
        tracker = StepTracker(built.masters, built.grads, host)
        opt = [built.optimizer] if built.optimizer is not None else []
        tracker.track_external(built.model, *opt, *built.masters, *host)
        if built.host_optimizer is not None:  # its step's temporaries are host memory
            built.host_optimizer.register_step_pre_hook(lambda *_: tracker.on_host(True))
            built.host_optimizer.register_step_post_hook(lambda *_: tracker.on_host(False))
        counter = CollectiveCounter()
        counter.tracker = tracker
        with tracker, counter:
            _step(built, config, model_cfg.vocab_size, tracker)
    except Exception as exc:  # a system that cannot run this case is reported, not fatal
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result.seconds = time.perf_counter() - start
        return result
    result.peak = tracker.peak()
    result.maxima = tracker.maxima()
    result.calls = dict(counter.log.calls)
    result.bytes = dict(counter.log.bytes)
    result.overlap = counter.log.overlap()
    result.events = counter.log.events
    result.timeline = tracker.timeline
    result.marks = tracker.marks
    result.extra = built.extra
    result.seconds = time.perf_counter() - start
    return result


def _step(built: Built, config: SimConfig, vocab: int, tracker: StepTracker | None) -> None:
    model = built.model
    k = config.micro_batches
    for i in range(k):
        ids = torch.randint(0, vocab, (config.micro_batch, config.seq_len))
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker needs this before every repeated forward
            tracker.mark("forward")
        with built.sync(i == k - 1):
            loss = model(input_ids=ids, labels=ids).loss / k
            if tracker is not None:
                tracker.mark("backward")
            loss.backward()
        del loss
    if tracker is not None:
        tracker.mark("step")
    if built.optimizer is not None:
        built.optimizer.step()
        built.optimizer.zero_grad()
    else:
        model.zero_grad(set_to_none=True)
    if tracker is not None:
        tracker.mark("end")


def _versions() -> dict[str, str]:
    import platform

    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
