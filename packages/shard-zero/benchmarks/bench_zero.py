"""Per-rank model-state memory, peak RSS, step time and communicated bytes: shard-zero vs DDP/FSDP2.

Command (from the repo root, 2 CPU cores, gloo):

    python packages/shard-zero/benchmarks/bench_zero.py [--steps 6] [--warmup 2]

Each system runs in a fresh 2-process gloo world on the same Llama (hidden 256, 4 layers, vocab
4096, ~5.3M parameters), fp32, AdamW, per-rank batch 4 x 128 tokens. Model-state bytes are summed
from the tensors each rank holds (parameters, gradients, optimizer state) after a step's backward
and step; peak RSS is the process high-water mark (includes torch itself). Communicated bytes are
counted in code: shard-zero's own counters; DDP through a counting comm hook; FSDP2 from its
layout (2 gathers + 1 reduce-scatter per layer, root kept). gloo emulates reduce-scatter with
all-reduce, so step times say nothing about communication cost on a real interconnect.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn


@dataclass(frozen=True)
class BenchConfig:
    """Model and run sizes."""

    hidden: int = 256
    layers: int = 4
    intermediate: int = 688
    vocab: int = 4096
    batch: int = 4
    seq: int = 128
    steps: int = 6
    warmup: int = 2


@dataclass
class Result:
    """One system's numbers (rank 0)."""

    system: str
    step_s: float
    model_state_bytes: int
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    peak_rss_mib: float
    comm_bytes_per_step: int
    loss: float


def _model(cfg: BenchConfig) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=cfg.seq,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        t = _local(tensor)
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen and key[1]:
            seen.add(key)
            total += key[1]
    return total


def _worker(  # noqa: PLR0917 (torch.multiprocessing.spawn passes arguments positionally)
    rank: int, world: int, system: str, cfg: BenchConfig, init: str, out: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = _model(cfg)
    psi = sum(p.numel() for p in model.parameters())
    comm = {"bytes": 0}

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    if system.startswith("shard-zero"):
        from shard_zero import ZeroConfig, memory_stats, prepare

        stage = int(system[-1])
        model, opt = prepare(model, adamw, ZeroConfig(stage=stage))  # type: ignore[arg-type]
    elif system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            buf = bucket.buffer()
            # a ring all-reduce moves what a reduce-scatter plus an all-gather do: 2 x buffer
            comm["bytes"] += 2 * buf.numel() * buf.element_size()
            buf.div_(world)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)
        opt = adamw(model.parameters())
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = adamw(model.parameters())
        root = sum(p.numel() for n, p in _model(cfg).named_parameters() if ".layers." not in n)
        comm["bytes"] = 4 * (3 * psi - root)
    else:
        raise ValueError(system)

    gen = torch.Generator().manual_seed(rank)
    times, loss = [], 0.0
    stats: dict[str, int] = {}
    for step in range(cfg.warmup + cfg.steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        out_ = model(input_ids=ids, labels=ids)
        out_.loss.backward()
        if step == cfg.warmup + cfg.steps - 1:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if system.startswith("shard-zero"):
                grads_b = memory_stats(model, opt)["grads"]
            else:
                grads_b = _bytes(grads)
        opt.step()
        if step == cfg.warmup + cfg.steps - 1:
            if system.startswith("shard-zero"):
                ms = memory_stats(model, opt)
                stats = {
                    "params": ms["params"] + ms["master_params"],
                    "grads": grads_b,
                    "optim": ms["optimizer_state"],
                    "comm": sum(v["bytes"] for v in ms["communication"].values()),
                }
            else:
                state = [v for s in opt.state.values() for v in s.values()]
                stats = {
                    "params": _bytes(list(model.parameters())),
                    "grads": grads_b,
                    "optim": _bytes([v for v in state if isinstance(v, torch.Tensor)]),
                    "comm": comm["bytes"] // (cfg.warmup + cfg.steps)
                    if system == "ddp"
                    else comm["bytes"],
                }
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        if step >= cfg.warmup:
            times.append(elapsed)
        loss = float(out_.loss.detach())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        result = Result(
            system=system,
            step_s=statistics.median(times),
            model_state_bytes=stats["params"] + stats["grads"] + stats["optim"],
            params_bytes=stats["params"],
            grads_bytes=stats["grads"],
            optim_bytes=stats["optim"],
            peak_rss_mib=rss,
            comm_bytes_per_step=stats["comm"],
            loss=loss,
        )
        Path(out).write_text(json.dumps(asdict(result)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    cfg = BenchConfig(steps=args.steps, warmup=args.warmup)
    systems = ["ddp", "fsdp2", "shard-zero-1", "shard-zero-2", "shard-zero-3"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for system in systems:
            init, out = f"{tmp}/init-{system}", f"{tmp}/{system}.json"
            spawn(_worker, args=(2, system, cfg, init, out), nprocs=2, join=True)
            results.append(Result(**json.loads(Path(out).read_text())))
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    psi = sum(p.numel() for p in _model(cfg).parameters())
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, git {sha}; world 2 gloo, Ψ = {psi:,} params, {cfg}"
    )
    ddp = next(r for r in results if r.system == "ddp")
    print(
        "| system | step (s) | x DDP | model state / rank (MiB) | x DDP | params | grads | "
        "optim | peak RSS (MiB) | comm / step (Ψ·4 B) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    mib = 2**20
    for r in results:
        print(
            f"| {r.system} | {r.step_s:.3f} | {r.step_s / ddp.step_s:.2f} | "
            f"{r.model_state_bytes / mib:.1f} | {r.model_state_bytes / ddp.model_state_bytes:.2f}"
            f" | {r.params_bytes / mib:.1f} | {r.grads_bytes / mib:.1f} | "
            f"{r.optim_bytes / mib:.1f} | {r.peak_rss_mib:.0f} | "
            f"{r.comm_bytes_per_step / (4 * psi):.2f} |"
        )


if __name__ == "__main__":
    main()
