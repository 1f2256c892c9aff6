"""Per-rank model-state memory, peak memory, step time and communicated bytes of ZeRO systems.

Command (from the repo root, 2 CPU cores, gloo; DeepSpeed rows need `deepspeed` in the venv,
`nox -s "bench(shard-zero)"` builds one):

    DS_ACCELERATOR=cpu python packages/shard-zero/benchmarks/bench_zero.py [--steps 6] [--warmup 2]
        [--rounds 3] [--systems ddp,fsdp2,...] [--device cpu|cuda]

Systems: DDP (the anchor), FSDP2 (`fully_shard` per decoder layer + root), DDP +
`torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO-1), DeepSpeed ZeRO-1/2/3
(`deepspeed.initialize` with a config dict) and shard-zero stages 1-3. Every system trains the
same Llama (hidden 256, 4 layers, vocab 4096, ~5.0M parameters), fp32, with the same client
optimizer, `torch.optim.AdamW(lr=1e-3)` (DeepSpeed gets it as `optimizer=`: it is on DeepSpeed's
ZeRO allow-list and runs the same arithmetic as everywhere else), per-rank batch 4 x 128 tokens,
in a fresh 2-process world each; `--rounds` (default 3) repeats the whole list, so the systems
interleave over time, and every number is the median over the rounds.

Measured per rank 0: median step time (forward + backward + step + zero_grad); model-state bytes
summed over the distinct tensor storages each system holds (parameters incl. fp32 masters,
gradients after backward, optimizer state after step; for DeepSpeed the tensors its ZeRO optimizer
object holds, classified by attribute name); peak RSS (VmHWM, includes torch and every import)
and Δpeak = VmHWM minus the RSS after all imports and process-group setup (the high-water mark
is reset there through /proc/self/clear_refs), which is the comparable per-rank peak; on CUDA
also `torch.cuda.max_memory_allocated`. Communication is measured the same way for every
system: one extra, untimed step after the timed ones runs under a dispatch mode that sees every
`c10d` collective any library issues (`shard_zero.simulate._tracker.CollectiveCounter`) and adds
up its bytes per rank in the ZeRO paper's convention: an all-gather its gathered output, a
reduce-scatter its full input, a broadcast its buffer, an all-reduce twice its buffer (a ring
all-reduce moves a reduce-scatter plus an all-gather). Barriers carry no data and are not
counted. gloo emulates reduce-scatter with all-reduce, so CPU step times say nothing about
communication cost on a real interconnect.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from leanlm_testing import bench
from leanlm_testing.models import LlamaShape

SYSTEMS = (
    "ddp",
    "fsdp2",
    "zero-redundancy",
    "deepspeed-1",
    "deepspeed-2",
    "deepspeed-3",
    "shard-zero-1",
    "shard-zero-2",
    "shard-zero-3",
)
MIB = 2**20
SHAPE = LlamaShape(hidden=256, layers=4, ffn=688, vocab=4096, heads=8, kv_heads=4)


@dataclass(frozen=True)
class BenchConfig:
    """Model and run sizes."""

    shape: LlamaShape = SHAPE
    batch: int = 4
    seq: int = 128
    steps: int = 6
    warmup: int = 2


@dataclass
class Result:
    """One system's numbers (rank 0), or why it did not run."""

    system: str
    step_s: float = float("nan")
    model_state_bytes: int = 0
    params_bytes: int = 0
    grads_bytes: int = 0
    optim_bytes: int = 0
    peak_rss_mib: float = float("nan")
    peak_delta_mib: float = float("nan")
    peak_device_mib: float | None = None
    comm_bytes_per_step: int | None = None
    comm_calls: dict[str, int] = field(default_factory=dict)
    loss: float = float("nan")
    skipped: str = ""
    step_times: list[float] = field(default_factory=list)


def deepspeed_available() -> str:
    """'' when `import deepspeed` works, else the reason."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # any import failure means "not available"
        return f"deepspeed not installed ({type(exc).__name__})"
    return ""


def llama(cfg: BenchConfig) -> Any:
    """The benchmark's Llama, identical in every process (seed 0), in training mode."""
    model = cfg.shape.model(max_position_embeddings=cfg.seq, tie_word_embeddings=False)
    return model.train()


def init_worker(rank: int, world: int, init: str, device: str) -> torch.device:
    """One thread per rank, the process group (gloo on CPU, nccl on CUDA), env for DeepSpeed."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world)
    )
    backend = "gloo"
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend, dev = "nccl", torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    return dev


def deepspeed_config(stage: int, micro_batch: int, *, untested_ok: bool = False) -> dict[str, Any]:
    """fp32 ZeRO-`stage`, no gradient clipping, DeepSpeed's defaults otherwise.

    DeepSpeed clips gradients to a global norm of 1.0 unless told otherwise
    (`GRADIENT_CLIPPING_DEFAULT = 1.0` in 0.19.8); no other system here clips, so it is turned off.
    Buckets, overlap and the stage-3 persistence threshold keep their defaults.
    """
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": untested_ok,
        "steps_per_print": 2**30,
        "wall_clock_breakdown": False,
    }


def preload(system: str) -> None:
    """Import what `system` needs, so the memory baseline is taken after every import."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    if system.startswith("deepspeed"):
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.utils.logger.setLevel(logging.WARNING)
    elif system.startswith("shard-zero"):
        import shard_zero  # noqa: F401
    elif system == "fsdp2":
        import torch.distributed.fsdp
    elif system == "zero-redundancy":
        import torch.distributed.optim  # noqa: F401


@dataclass
class Wrapped:
    """A model prepared by one system, with a uniform training interface."""

    system: str
    model: Any
    optimizer: Any
    inner: torch.optim.Optimizer  # the optimizer that does the arithmetic
    engine: Any = None  # DeepSpeed's engine

    def forward_backward(self, ids: torch.Tensor) -> torch.Tensor:
        """Loss on `ids` (B, T) and its backward; returns the detached loss."""
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()
        return loss.detach()  # type: ignore[no-any-return]  # HF outputs are untyped

    def step(self) -> None:
        """The optimizer step (DeepSpeed: `engine.step()`, which also zeroes gradients)."""
        (self.engine if self.engine is not None else self.optimizer).step()

    def zero_grad(self) -> None:
        """Drop the gradients (a no-op for DeepSpeed, see `step`)."""
        if self.engine is None:  # DeepSpeed's engine.step() zeroes the gradients itself
            self.optimizer.zero_grad()

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter at full size, original names, fp32 copies on the CPU."""
        if self.system.startswith("shard-zero"):
            from shard_zero import full_state_dict

            state = full_state_dict(self.model)
            return {n: t.detach().float().cpu().clone() for n, t in state.items()}
        module = self.model.module if hasattr(self.model, "module") else self.model
        if self.system == "deepspeed-3":
            import deepspeed

            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params):
                return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
        out = {}
        for name, p in module.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().float().cpu().clone()
        return out


def wrap(
    system: str,
    model: Any,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    world: int,
    micro_batch: int,
) -> Wrapped:
    """Prepare `model` (already on its device) with `system` (`world` ranks)."""
    if system.startswith("shard-zero"):
        from shard_zero import ZeroConfig, prepare

        stage = {"1": 1, "2": 2, "3": 3}[system[-1]]
        model, zero_opt = prepare(model, make_optimizer, ZeroConfig(stage=stage))  # type: ignore[arg-type]
        return Wrapped(system, model, zero_opt, zero_opt.optimizer)
    if system.startswith("deepspeed"):
        import deepspeed

        stage = int(system[-1])
        client = make_optimizer(model.parameters())
        known = isinstance(client, torch.optim.Adam | torch.optim.AdamW)
        engine, opt, _, _ = deepspeed.initialize(
            model=model,
            optimizer=client,
            config=deepspeed_config(stage, micro_batch, untested_ok=not known),
        )
        return Wrapped(system, engine, opt, opt.optimizer, engine=engine)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = make_optimizer(model.parameters())
        return Wrapped(system, model, opt, opt)
    if system in {"ddp", "zero-redundancy"}:
        from torch.nn.parallel import DistributedDataParallel

        on_cuda = next(model.parameters()).is_cuda
        ids = [torch.cuda.current_device()] if on_cuda else None
        model = DistributedDataParallel(model, device_ids=ids)
        if system == "ddp":
            opt = make_optimizer(model.parameters())
            return Wrapped(system, model, opt, opt)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zro = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=_OptimizerFactory(make_optimizer),  # type: ignore[arg-type]  # called only
        )
        return Wrapped(system, model, zro, zro.optim)
    raise ValueError(f"`system` ({system!r}) must be one of {SYSTEMS}")


class _OptimizerFactory:
    """ZeroRedundancyOptimizer calls `optimizer_class(params, **defaults)`: adapt a factory."""

    def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
        self.make = make

    def __call__(self, params: Any, **_: Any) -> torch.optim.Optimizer:
        return self.make(params)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(tensors: list[torch.Tensor]) -> dict[tuple[int, int], int]:
    out = {}
    for tensor in tensors:
        t = _local(tensor)
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[1] and t.device.type != "meta":
            out[key] = key[1]
    return out


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_storages(tensors).values())


def _tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors_in(v, depth - 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth - 1)]
    return []


def _deepspeed_buffers(w: Wrapped) -> dict[str, list[torch.Tensor]]:
    """The tensors DeepSpeed's ZeRO optimizer holds, split into params / grads / optimizer state.

    Attribute names decide: containing "grad" or "ipg" → gradients; "fp32", "fp16", "bit16",
    "param" or "partition" → parameters; module parameters (stage 3: their `ds_tensor` shards and
    the persistent ones) count as parameters; the inner optimizer's state as optimizer state.
    """
    module = w.engine.module
    params = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    params += list(module.parameters())  # stage 3: 0 bytes at rest unless persistent
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    state = [v for s in w.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    owned = {id(t) for t in state}
    for name, value in vars(w.optimizer).items():
        found = [t for t in _tensors_in(value) if id(t) not in owned]
        low = name.lower()
        if "grad" in low or "ipg" in low:
            grads += found
            grads += [t.grad for t in found if t.grad is not None]
        elif any(k in low for k in ("fp32", "fp16", "bit16", "param", "partition")):
            params += found
            grads += [t.grad for t in found if t.grad is not None]
    return {"params": params, "grads": grads, "optim": state}


def _model_state(w: Wrapped) -> dict[str, int]:
    """Bytes this rank holds: 'grads' read after backward, the rest after step."""
    if w.system.startswith("shard-zero"):
        from shard_zero import memory_stats

        ms = memory_stats(w.model, w.optimizer)
        return {
            "params": ms["params"] + ms["master_params"],
            "grads": ms["grads"],
            "optim": ms["optimizer_state"],
        }
    if w.system.startswith("deepspeed"):
        parts = _deepspeed_buffers(w)
        seen: dict[tuple[int, int], int] = {}
        out = {}
        for key in ("optim", "params", "grads"):  # a storage counts once, in the first kind
            fresh = {k: v for k, v in _storages(parts[key]).items() if k not in seen}
            seen.update(fresh)
            out[key] = sum(fresh.values())
        return out
    state = [v for s in w.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _bytes(list(w.model.parameters())),
        "grads": _bytes([p.grad for p in w.model.parameters() if p.grad is not None]),
        "optim": _bytes(state),
    }


def _worker(  # noqa: PLR0917 (torch.multiprocessing.spawn passes arguments positionally)
    rank: int, world: int, system: str, cfg: BenchConfig, init: str, out: str, device: str
) -> None:
    dev = init_worker(rank, world, init, device)
    preload(system)
    try:
        base = bench.reset_peak_rss()
    except OSError:
        base = 0.0  # the peak then includes the imports (reported as is, Δpeak as "-")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = llama(cfg).to(dev)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    w = wrap(system, model, adamw, world=world, micro_batch=cfg.batch)
    gen = torch.Generator().manual_seed(rank)
    sync = bench.synchronizer(dev)
    times, loss = [], torch.zeros(())
    stats: dict[str, int] = {}
    last = cfg.warmup + cfg.steps - 1
    for step in range(last + 1):
        ids = torch.randint(0, cfg.shape.vocab, (cfg.batch, cfg.seq), generator=gen).to(dev)
        dist.barrier()  # not timed: the ranks start each step together
        sync()
        start = time.perf_counter()
        loss = w.forward_backward(ids)
        if step == last:
            grads = _model_state(w)["grads"]
        w.step()
        if step == last:
            stats = {**_model_state(w), "grads": grads}
        w.zero_grad()
        sync()
        elapsed = time.perf_counter() - start
        if step >= cfg.warmup:
            times.append(elapsed)
    hwm = bench.peak_rss_mib()  # before the counted step: the dispatch mode costs memory
    comm_calls, comm_bytes = count_step_communication(w, cfg, gen, dev)
    if rank == 0:
        result = Result(
            system=system,
            step_s=statistics.median(times),
            model_state_bytes=stats["params"] + stats["grads"] + stats["optim"],
            params_bytes=stats["params"],
            grads_bytes=stats["grads"],
            optim_bytes=stats["optim"],
            peak_rss_mib=hwm,
            peak_delta_mib=hwm - base if base else float("nan"),
            peak_device_mib=torch.cuda.max_memory_allocated(dev) / MIB
            if dev.type == "cuda"
            else None,
            comm_bytes_per_step=comm_bytes,
            comm_calls=comm_calls,
            loss=float(loss),
            step_times=times,
        )
        Path(out).write_text(json.dumps(asdict(result)))
    dist.barrier()
    dist.destroy_process_group()


def count_step_communication(
    w: Wrapped, cfg: BenchConfig, gen: torch.Generator, dev: torch.device
) -> tuple[dict[str, int], int]:
    """Calls per kind and bytes per rank of every collective of one more (untimed) step."""
    from shard_zero.simulate._tracker import CollectiveCounter

    ids = torch.randint(0, cfg.shape.vocab, (cfg.batch, cfg.seq), generator=gen).to(dev)
    dist.barrier()
    counter = CollectiveCounter()
    with counter:
        w.forward_backward(ids)
        w.step()
        w.zero_grad()
    log = counter.log
    weight = {"all_reduce": 2}  # a ring all-reduce = reduce-scatter + all-gather
    total = sum(weight.get(kind, 1) * n for kind, n in log.bytes.items())
    return dict(log.calls), total


def run_system(system: str, cfg: BenchConfig, device: str, tmp: str, tag: str) -> Result:
    """`system` in a fresh 2-process world; a crash becomes a row that says why."""
    if system.startswith("deepspeed") and (why := deepspeed_available()):
        return Result(system=system, skipped=why)
    init, out = f"{tmp}/init-{system}-{tag}", f"{tmp}/{system}-{tag}.json"
    try:
        spawn(_worker, args=(2, system, cfg, init, out, device), nprocs=2, join=True)
    except Exception as exc:  # one system failing must not lose the others
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        if not Path(out).exists():
            return Result(system=system, skipped=f"failed: {last[:200]}")
        # rank 0 wrote its numbers before the final barrier: the crash came at teardown
        print(f"# {system}: measured, then at exit: {last[:200]}", flush=True)
    return Result(**json.loads(Path(out).read_text()))


def _merge(rounds: list[Result]) -> Result:
    """Median over rounds of the timings and peaks (one round: that round).

    Model-state bytes and communication do not change from round to round.
    """
    ok = [r for r in rounds if not r.skipped]
    if not ok:
        return rounds[0]
    merged = Result(**asdict(ok[0]))
    for name in ("step_s", "peak_rss_mib", "peak_delta_mib", "loss"):
        setattr(merged, name, statistics.median(getattr(r, name) for r in ok))
    if ok[0].peak_device_mib is not None:
        merged.peak_device_mib = statistics.median(r.peak_device_mib or 0.0 for r in ok)
    merged.step_times = [t for r in ok for t in r.step_times]
    return merged


def header(cfg: BenchConfig, device: str, name: str = "bench_zero") -> str:
    """Device, versions, git revision and sizes: the first line of every table."""
    dists = ["shard-zero", "transformers", "deepspeed"]
    env = bench.header(name, device, dists, where=Path(__file__).parents[1])
    psi = sum(p.numel() for p in llama(cfg).parameters())
    backend = "nccl" if device == "cuda" else "gloo"
    return f"{env}; world 2 {backend}, Ψ = {psi:,} params, {cfg}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def print_tables(results: list[Result], cfg: BenchConfig) -> None:
    """The DDP-anchored table of the original script, then ratios to FSDP2 and the peaks."""
    psi = sum(p.numel() for p in llama(cfg).parameters())
    ddp = next(r for r in results if r.system == "ddp")
    print(
        "| system | step (s) | x DDP | model state / rank (MiB) | x DDP | params | grads | "
        "optim | peak RSS (MiB) | comm / step (Ψ·4 B) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.skipped:
            print(f"| {r.system} | {r.skipped} | | | | | | | | |")
            continue
        comm = None if r.comm_bytes_per_step is None else r.comm_bytes_per_step / (4 * psi)
        print(
            f"| {r.system} | {r.step_s:.3f} | {r.step_s / ddp.step_s:.2f} | "
            f"{r.model_state_bytes / MIB:.1f} | {r.model_state_bytes / ddp.model_state_bytes:.2f}"
            f" | {r.params_bytes / MIB:.1f} | {r.grads_bytes / MIB:.1f} | "
            f"{r.optim_bytes / MIB:.1f} | {r.peak_rss_mib:.0f} | {_fmt(comm, '.2f')} |"
        )
    fsdp = next((r for r in results if r.system == "fsdp2" and not r.skipped), None)
    if fsdp is None:
        return
    print()
    print(
        "| system | step x FSDP2 | Δpeak / rank (MiB) | Δpeak x FSDP2 | peak device (MiB) | "
        "steps timed | min-max step (s) | final loss | collectives per step (calls) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.skipped:
            continue
        print(
            f"| {r.system} | {r.step_s / fsdp.step_s:.2f} | {_fmt(r.peak_delta_mib, '.0f')} | "
            f"{_fmt(r.peak_delta_mib / fsdp.peak_delta_mib, '.2f')} | "
            f"{_fmt(r.peak_device_mib, '.0f')} | {len(r.step_times)} | "
            f"{min(r.step_times):.3f}-{max(r.step_times):.3f} | {r.loss:.4f} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(r.comm_calls.items())) or '-'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=3, help="repeat the system list (interleaved; medians)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if bad := sorted(set(systems) - set(SYSTEMS)):
        raise ValueError(f"`--systems` has unknown names {bad}; choose from {SYSTEMS}")
    if "ddp" not in systems:
        raise ValueError("`--systems` must include the anchor 'ddp'")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise ValueError(
            f"`--steps` ({args.steps}) and `--rounds` ({args.rounds}) must be >= 1, "
            f"`--warmup` ({args.warmup}) >= 0"
        )
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError(f"`--device cuda` needs 2 GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("DS_ACCELERATOR", args.device)
    cfg = BenchConfig(steps=args.steps, warmup=args.warmup)
    load_before = os.getloadavg()
    runs: dict[str, list[Result]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for system in systems:
                runs[system].append(run_system(system, cfg, args.device, tmp, str(round_)))
    results = [_merge(runs[s]) for s in systems]
    print(header(cfg, args.device))
    print(
        f"# load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}; {args.rounds} round(s)"
    )
    print_tables(results, cfg)


if __name__ == "__main__":
    main()
