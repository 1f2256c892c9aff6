"""Factored-optimizer error of every ZeRO system against single-process training, measured.

Command (from the repo root, 2 CPU cores, gloo; DeepSpeed rows need `deepspeed` in the venv):

    DS_ACCELERATOR=cpu python packages/shard-zero/benchmarks/bench_factored_error.py
        [--steps 10] [--optimizers sgd,adamw,adafactor,came] [--systems ddp,fsdp2,...]

For each system of `bench_zero.py` (DDP, FSDP2, DDP + ZeroRedundancyOptimizer, DeepSpeed ZeRO-1/2/3
with the optimizer passed as `optimizer=`, shard-zero stages 1-3; each in a fresh 2-process
world, every system with its defaults, DeepSpeed without its default gradient clipping) and each
optimizer (`torch.optim.SGD(lr=0.1)` and `torch.optim.AdamW(lr=1e-3)` as controls,
`optim_adafactor.Adafactor()` with its Hugging Face defaults, `optim_came.CAME(lr=1e-3)`), train a
small Llama (hidden 128, 2 layers, vocab 512, ~0.5M parameters, fp32) for `--steps` steps, each
rank on its half of the same global batch (8 x 32 tokens), and compare the final parameters with
one process trained on the whole batch:

- max abs error: max over every parameter element of |sharded - single|;
- rel. update error: max over tensors of ||Δ_sharded - Δ_single|| / ||Δ_single||, with
  Δ = final - initial (the metric of shard-zero's parity tests; reordered float sums alone
  give ~1e-7..1e-6);
- what the optimizer that does the arithmetic saw on rank 0: its tensors and the elements of each
  state entry (`exp_avg_sq_row/col` = factored; a full `exp_avg_sq` on a 1-D flat partition =
  the unfactored fallback), or the exception if the system crashed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from leanlm_testing.models import LlamaShape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zero import (  # the sibling script, found through the sys.path entry above
    SYSTEMS,
    BenchConfig,
    deepspeed_available,
    header,
    init_worker,
    llama,
    preload,
    wrap,
)

OPTIMIZERS = ("sgd", "adamw", "adafactor", "came")
CFG = BenchConfig(
    shape=LlamaShape(hidden=128, layers=2, ffn=344, vocab=512, heads=4, kv_heads=2), batch=4, seq=32
)


@dataclass
class Outcome:
    """One (system, optimizer) run on rank 0."""

    system: str
    optimizer: str
    final: dict[str, torch.Tensor] | None
    view: str
    error: str = ""


def make_optimizer(name: str) -> Any:
    """The optimizer factory `name` (imported lazily: the bench runs without them too)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3)
    if name == "adafactor":
        from optim_adafactor import Adafactor

        return Adafactor  # its Hugging Face defaults: relative step, parameter scaling
    if name == "came":
        from optim_came import CAME

        return lambda params: CAME(params, lr=1e-3)
    raise ValueError(f"`--optimizers` has {name!r}; choose from {OPTIMIZERS}")


def global_batches(cfg: BenchConfig, steps: int) -> list[torch.Tensor]:
    """The same (2 * batch, seq) token batches in every process."""
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, cfg.shape.vocab, (2 * cfg.batch, cfg.seq), generator=gen)
        for _ in range(steps)
    ]


def describe(opt: torch.optim.Optimizer) -> str:
    """Tensors the optimizer steps and the elements of each state entry (local shards)."""
    dims: Counter[str] = Counter()
    numel = 0
    for group in opt.param_groups:
        for p in group["params"]:
            t = p.to_local() if hasattr(p, "to_local") else p
            dims[f"{t.dim()}-D"] += 1
            numel += t.numel()
    state: Counter[str] = Counter()
    for entry in opt.state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                state[key] += local.numel()
    shapes = " + ".join(f"{n} x {d}" for d, n in sorted(dims.items()))
    entries = ", ".join(f"`{k}` {n:,}" for k, n in sorted(state.items()))
    return f"{shapes} ({numel:,} el.); state {entries or 'none'}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _worker(  # noqa: PLR0917 (torch.multiprocessing.spawn passes arguments positionally)
    rank: int, world: int, system: str, optimizers: list[str], steps: int, init: str, out: str
) -> None:
    dev = init_worker(rank, world, init, "cpu")
    preload(system)
    batches = global_batches(CFG, steps)
    part = slice(rank * CFG.batch, (rank + 1) * CFG.batch)
    outcomes = []
    for name in optimizers:
        model = llama(CFG).to(dev)
        final, view, error = None, "", ""
        try:
            w = wrap(system, model, make_optimizer(name), world=world, micro_batch=CFG.batch)
            for ids in batches:
                w.forward_backward(ids[part].to(dev))
                w.step()
                w.zero_grad()
            view = describe(w.inner)
            if system == "deepspeed-3":  # its flat fp32 partitions join the group only in step()
                flat = w.optimizer.fp32_partitioned_groups_flat
                view += f"; flat fp32 partitions {[tuple(t.shape) for t in flat]}"
            final = w.full_params()
        except Exception as exc:  # a crash is a result: record it
            error = _first_line(exc)
            if "w" in locals():
                with contextlib.suppress(Exception):  # best effort: the view before the crash
                    view = describe(w.inner)
        dist.barrier()
        outcomes.append(Outcome(system, name, final, view, error))
    if rank == 0:
        torch.save([o.__dict__ for o in outcomes], out)
    dist.barrier()
    dist.destroy_process_group()


def reference(
    name: str, steps: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """Single process on the global batch: (initial, final, optimizer view)."""
    torch.set_num_threads(1)
    model = llama(CFG)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_optimizer(name)(list(model.parameters()))
    for ids in global_batches(CFG, steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return init, final, describe(opt)


def errors(
    init: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(max abs error, max over tensors of the relative update error)."""
    if missing := sorted(set(ref) - set(got)):
        raise KeyError(f"parameters missing from the sharded run: {missing[:3]}")
    max_abs = rel = 0.0
    for key, final in ref.items():
        diff = got[key].double() - final.double()
        max_abs = max(max_abs, float(diff.abs().max()))
        d_ref = (final - init[key]).double()
        rel = max(rel, float(diff.norm() / d_ref.norm().clamp_min(1e-30)))
    return max_abs, rel


def run_systems(systems: list[str], optimizers: list[str], steps: int, tmp: Path) -> list[Outcome]:
    """Every system in a fresh 2-process world; a crash or a missing DeepSpeed becomes a row."""
    outcomes: list[Outcome] = []
    for system in systems:
        if system.startswith("deepspeed") and (why := deepspeed_available()):
            outcomes += [Outcome(system, o, None, "", why) for o in optimizers]
            continue
        out = tmp / f"{system}.pt"
        try:
            spawn(
                _worker,
                args=(2, system, optimizers, steps, str(tmp / f"init-{system}"), str(out)),
                nprocs=2,
                join=True,
            )
            outcomes += [Outcome(**d) for d in torch.load(out, weights_only=False)]
        except Exception as exc:  # a whole-system crash is a result too
            outcomes += [Outcome(system, o, None, "", _first_line(exc)) for o in optimizers]
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    optimizers = [o for o in args.optimizers.split(",") if o]
    systems = [s for s in args.systems.split(",") if s]
    if bad := sorted(set(systems) - set(SYSTEMS)):
        raise ValueError(f"`--systems` has unknown names {bad}; choose from {SYSTEMS}")
    for name in optimizers:
        make_optimizer(name)
    if args.steps < 1:
        raise ValueError(f"`--steps` ({args.steps}) must be >= 1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run_systems(systems, optimizers, args.steps, Path(tmp))
    refs = {name: reference(name, args.steps) for name in optimizers}
    print(header(CFG, "cpu", "bench_factored_error"))
    print(
        f"# {args.steps} steps, world 2, global batch {2 * CFG.batch} x {CFG.seq}; load average "
        f"before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "| optimizer | system | max abs error | rel. update error | inner optimizer sees (rank 0) |"
    )
    print("|---|---|---|---|---|")
    for name in optimizers:
        init, ref, view = refs[name]
        print(f"| {name} | single process | 0 | 0 | {view} |")
        for o in (o for o in outcomes if o.optimizer == name):
            if o.final is None:
                print(f"| {name} | {o.system} | - | - | **{o.error}**; {o.view} |")
                continue
            max_abs, rel = errors(init, ref, o.final)
            print(f"| {name} | {o.system} | {max_abs:.1e} | {rel:.1e} | {o.view} |")


if __name__ == "__main__":
    main()
