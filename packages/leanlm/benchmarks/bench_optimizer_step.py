"""The whole training step with each memory-lean optimizer against fused AdamW (issue 23's target).

Command (from the repo root; on a GPU the default size is the 1.1B TinyLlama shape):

    python packages/leanlm/benchmarks/bench_optimizer_step.py [--device cuda] [--size 1.1b]
        [--optimizers adamw came came-fp32 came-int8 adafactor adamw8bit] [--rounds 5] [--steps 2]

Every optimizer gets its own copy of the same bf16 Llama (same initial weights) and the same
batches. A round runs `--steps` training steps (forward, loss, backward, optimizer step,
`zero_grad(set_to_none=True)`) of each optimizer in turn; the table gives the median step time over
the rounds, its ratio to AdamW's measured in the same run, the optimizer step alone (median over
the rounds, after a backward), the optimizer state in bytes per parameter (counted from the
state tensors by `bench.state_bytes`) and the peak memory a step allocates above what the
resident models and states hold (CUDA only: `max_memory_allocated` after
`reset_peak_memory_stats`). A second table profiles one optimizer step of each (after the timed
rounds): its six longest kernels (CPU: operators) with launches and time and, for ours on a GPU,
the DRAM bytes the launch plan gives each kernel and the bandwidth that makes. CAME runs with a
bf16 first moment (`came`), fp32 (`came-fp32`) or int8 (`came-int8`), or bf16 with the
multi-tensor row items of before 7b70ad0 (`came-r16`, not in the default list: 16-row items of
5632-wide matrices instead of 8, to time both work splits in one run); CAME and Adafactor
stochastically round the bf16 parameters, AdamW is torch's fused one (foreach on CPU, where fused
is not built). `adamw8bit` (not in the default list) is bitsandbytes' `AdamW8bit` with AdamW's
lr and defaults; without bitsandbytes it is left out with a note.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import time
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanlm_testing import bench
from optim_adafactor import Adafactor
from optim_adafactor import _multi_tables as mt
from optim_came import CAME


def _llama(hidden: int, inter: int, layers: int, *, heads: int, kv: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        max_position_embeddings=2048,
    )  # fmt: skip


SIZES = {  # model, batch, sequence length
    "1.1b": (_llama(2048, 5632, 22, heads=32, kv=4, vocab=32000), 4, 1024),
    "tiny": (_llama(64, 176, 2, heads=4, kv=2, vocab=512), 2, 64),
}


def _adamw(params: list[torch.nn.Parameter], device: str) -> torch.optim.Optimizer:
    if device == "cuda":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _rows_rounded_up(n: int, m: int, sub: int) -> int:
    """The multi-tensor row items before 7b70ad0: R rounded *up* to about ITEM_ELEMENTS.

    (16-row items of TinyLlama's 5632-wide `down_proj`, 90,112 elements, in 3 groups; today's
    `rows_per_item` rounds down: 8 rows, 45,056 elements, 4 groups.) Kept here only to time
    both splits in one run (`came-r16`).
    """
    rows = sub * max(1, -(-mt.ITEM_ELEMENTS // (sub * m)))
    items_allowed = max(1, mt.MAX_PARTIAL_FLOATS // m)
    if -(-n // rows) > items_allowed:
        rows = sub * mt.ceil_div(mt.ceil_div(n, items_allowed), sub)
    return rows


class CameRoundedUp(CAME):
    """CAME whose multi-tensor tables are built with the items of before 7b70ad0 (A/B)."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """CAME's step, its tables (built at the first step, then cached) split the old way."""
        with unittest.mock.patch.object(mt, "rows_per_item", _rows_rounded_up):
            return super().step(closure)


#: ours: name -> (class, settings); all with lr 1e-4 and stochastic rounding of bf16 parameters
OURS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "came": (CAME, {"state_dtype": torch.bfloat16}),
    "came-r16": (CameRoundedUp, {"state_dtype": torch.bfloat16}),
    "came-fp32": (CAME, {}),
    "came-int8": (CAME, {"state_dtype": torch.int8}),
    "adafactor": (Adafactor, {"relative_step": False, "scale_parameter": False}),
}


def _ours(name: str, params: list[torch.nn.Parameter], **extra: Any) -> torch.optim.Optimizer:
    cls, settings = OURS[name]
    return cls(params, lr=1e-4, stochastic_rounding=True, **settings, **extra)


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], str], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    **{name: functools.partial(lambda n, p, _: _ours(n, p), name) for name in OURS},
    "adamw8bit": lambda p, _: importlib.import_module("bitsandbytes").optim.AdamW8bit(p, lr=1e-4),
}


def planned_bytes(name: str, shapes: list[torch.Size]) -> dict[str, int]:
    """DRAM bytes per kernel of one fused step on a GPU, from the launch plan (ours only).

    `optim_adafactor.multi_tensor.plan_launches` runs the optimizer's own launch code on meta
    tensors (no GPU needed), so the same numbers come out of the CPU dry run.
    """
    from optim_adafactor.multi_tensor import plan_launches

    if name not in OURS:
        return {}
    make = functools.partial(_ours, name, backend="triton")
    per_kernel: dict[str, int] = {}
    for launch in plan_launches(make, shapes, torch.bfloat16):
        per_kernel[launch.kernel] = per_kernel.get(launch.kernel, 0) + launch.bytes
    return per_kernel


def main() -> None:
    """Parse the command line, build one model per optimizer, time them interleaved, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="GPU 1.1b, CPU tiny")
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per optimizer per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("1.1b" if device == "cuda" else "tiny")
    names = args.optimizers or ["adamw", "came", "came-fp32", "came-int8", "adafactor"]
    if "adamw" not in names:
        names = ["adamw", *names]  # the anchor
    if "adamw8bit" in names:
        try:
            importlib.import_module("bitsandbytes")
        except ImportError as err:
            print(f"# adamw8bit left out: bitsandbytes does not import ({err})")
            names.remove("adamw8bit")
    for flag in ("rounds", "steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    dists = ("optim-came", "optim-adafactor", "bitsandbytes")
    print(bench.header("bench_optimizer_step", device, dists))
    config, batch, seq_len = SIZES[size]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
    sync = bench.synchronizer(device)
    cuda = device == "cuda"

    models, optimizers = {}, {}
    for name in names:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.config.use_cache = False
        models[name] = model
        optimizers[name] = OPTIMIZERS[name](list(model.parameters()), device)
    n_params = sum(p.numel() for p in models[names[0]].parameters())
    print(f"# size {size}: {n_params / 1e6:.1f}M params, bf16, batch {batch} x {seq_len}")

    def step(name: str) -> None:
        model, optimizer = models[name], optimizers[name]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name in names:
        for _ in range(args.warmup):
            step(name)
    sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    opt_times: dict[str, list[float]] = {n: [] for n in names}
    transient: dict[str, float] = dict.fromkeys(names, 0.0)
    for _ in range(args.rounds):
        for name in names:
            if cuda:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            sync()
            times[name].append((time.perf_counter() - start) / args.steps)
            if cuda:
                extra = (torch.cuda.max_memory_allocated() - base) / 2**30
                transient[name] = max(transient[name], extra)
            models[name](input_ids=ids, labels=ids).loss.backward()
            sync()
            start = time.perf_counter()
            optimizers[name].step()
            sync()
            opt_times[name].append(time.perf_counter() - start)
            optimizers[name].zero_grad(set_to_none=True)

    anchor = statistics.median(times["adamw"])
    anchor_opt = statistics.median(opt_times["adamw"])
    print(f"# median of {args.rounds} interleaved rounds of {args.steps} steps each")
    print(
        "| optimizer | step ms | x AdamW | optimizer step ms | x AdamW | state B/param "
        "| step peak above resident GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        med, opt = statistics.median(times[name]), statistics.median(opt_times[name])
        per = bench.state_bytes(optimizers[name]) / n_params
        peak = f"{transient[name]:.2f}" if cuda else "-"
        print(
            f"| {name} | {med * 1e3:.1f} | {med / anchor:.2f} | {opt * 1e3:.2f} | "
            f"{opt / anchor_opt:.2f} | {per:.2f} | {peak} |"
        )

    # Where each optimizer step's time goes: the kernels of one step after a backward
    print(f"\n# one optimizer step, profiled ({'GPU kernels' if cuda else 'CPU operators'}; top 6)")
    print("| optimizer | kernel | launches | ms | share of the step | planned MB | GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    shapes = [p.shape for p in models[names[0]].parameters()]
    for name in names:
        planned = planned_bytes(name, shapes)
        models[name](input_ids=ids, labels=ids).loss.backward()
        rows = bench.kernel_times(optimizers[name].step, device, warmup=0)
        optimizers[name].zero_grad(set_to_none=True)
        total = sum(us for *_, us in rows)
        for kernel, launches, us in rows[:6]:
            mb = gbs = "-"  # bytes only where the plan names this kernel (ours, on a GPU)
            if kernel in planned:
                mb, gbs = f"{planned[kernel] / 1e6:.0f}", f"{planned[kernel] / us / 1e3:.0f}"
            print(
                f"| {name} | {kernel[:80]} | {launches:.0f} | {us / 1e3:.3f} | {us / total:.1%} "
                f"| {mb} | {gbs} |"
            )
        if planned:
            print(f"| {name} | (plan: {sum(planned.values()) / 1e6:.0f} MB per step) | | | | | |")


if __name__ == "__main__":
    main()
