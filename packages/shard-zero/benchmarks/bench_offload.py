"""CPU optimizer-step throughput, the host side of ZeRO-Offload (`offload_optimizer`).

Command (from the repo root):

    python packages/shard-zero/benchmarks/bench_offload.py [--threads N] [--rounds 5]
        [--hidden 512 --intermediate 1408 --layers 8 --vocab 24000]

With `ZeroConfig(offload_optimizer=True)` shard-zero steps the wrapped optimizer on the host, over
this rank's fp32 master rows and their gradients, so the CPU's optimizer step bounds the training
step. This times exactly that step, one `optimizer.step()` over a Llama-shaped fp32 parameter set
(`leanlm_testing.bench.LlamaShapes`: untied embeddings, q/k/v/o, gate/up/down and two norms per
layer; 50.3M parameters by default, e.g. one rank's shard of a 400M model at world 8) with
random gradients, for

* torch's AdamW: the for-loop (what `torch.optim.AdamW()` picks on CPU tensors), `foreach=True`
  and `fused=True` (skipped where this torch has no CPU fused kernel);
* optim-came's CAME on its PyTorch path (`backend="torch"`, the path CPU tensors take);
* optim-adafactor's Adafactor on its PyTorch path (`backend="torch"`): Hugging Face's defaults
  (relative step, factored second moment, no momentum), and with `beta1=0.9, weight_decay=0.1`
  (adds an fp32 first moment).

Each case warms up once (allocating its state), then the cases run in turn for `--rounds`
rounds; the table gives the median ms per step, parameters per second (Ψ / median) and, for
AdamW, the bytes it moves at 28 B per parameter (read p, g, m, v; write p, m, v) in GB/s. The
header names the device, thread count, load, versions and git SHA.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm_testing import bench
from optim_adafactor import Adafactor
from optim_came import CAME

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
ADAMW_BYTES = 28  # per parameter: read p, g, m, v (16) and write p, m, v (12), fp32


@dataclass(frozen=True, kw_only=True)
class Config:
    """What one run measures."""

    shapes: bench.LlamaShapes
    rounds: int = 5
    threads: int | None = None


@dataclass(frozen=True)
class Result:
    """One optimizer's median step."""

    name: str
    seconds: float | None  # None: not supported here
    params: int
    bytes_per_param: int | None

    def row(self, anchor: float) -> str:
        """A markdown table row; `anchor`: the for-loop AdamW's seconds."""
        if self.seconds is None:
            return f"| {self.name} | not supported by this torch on CPU | | | |"
        rate = self.params / self.seconds
        gbs = (
            f"{self.params * self.bytes_per_param / self.seconds / 1e9:.2f}"
            if self.bytes_per_param
            else "-"
        )
        return (
            f"| {self.name} | {self.seconds * 1e3:.1f} | {rate / 1e6:.1f} | {gbs} | "
            f"{anchor / self.seconds:.2f} |"
        )


def _params(shapes: bench.LlamaShapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes.shapes():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def _adamw(*, foreach: bool = False, fused: bool = False) -> Factory:
    return lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=foreach, fused=fused)


CASES: dict[str, tuple[Factory, int | None]] = {
    "AdamW (for-loop, CPU default)": (_adamw(), ADAMW_BYTES),
    "AdamW foreach=True": (_adamw(foreach=True), ADAMW_BYTES),
    "AdamW fused=True": (_adamw(fused=True), ADAMW_BYTES),
    'CAME (optim-came, backend="torch")': (
        lambda ps: CAME(ps, lr=1e-4, weight_decay=0.1, backend="torch"),
        None,
    ),
    'Adafactor (optim-adafactor, HF defaults, backend="torch")': (
        lambda ps: Adafactor(ps, backend="torch"),
        None,
    ),
    'Adafactor beta1=0.9, weight_decay=0.1 (backend="torch")': (
        lambda ps: Adafactor(ps, beta1=0.9, weight_decay=0.1, backend="torch"),
        None,
    ),
}


def run(cfg: Config) -> list[Result]:
    """Build every case on its own copy of the parameters, then time them interleaved."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    steps: dict[str, Callable[[], object]] = {}
    numel = 0
    unsupported: list[str] = []
    for name, (make, _) in CASES.items():
        params = _params(cfg.shapes)
        numel = sum(p.numel() for p in params)
        try:
            opt = make(params)
            opt.step()  # warm-up: allocates the state (and fails here if unsupported)
        except (RuntimeError, ValueError) as exc:
            print(f"# {name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            unsupported.append(name)
            continue
        steps[name] = opt.step
    medians = bench.interleaved_medians(steps, rounds=cfg.rounds, warmup=1)
    return [
        Result(name, medians.get(name), numel, bytes_per_param)
        for name, (_, bytes_per_param) in CASES.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--rounds", type=int, default=5)
    defaults = bench.LlamaShapes()
    for field in ("hidden", "intermediate", "layers", "vocab"):
        parser.add_argument(f"--{field}", type=int, default=getattr(defaults, field))
    args = parser.parse_args()
    shapes = bench.LlamaShapes(
        hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, vocab=args.vocab
    )
    cfg = Config(shapes=shapes, rounds=args.rounds, threads=args.threads)
    results = run(cfg)
    where = Path(__file__).parents[1]
    print(
        bench.header(
            "bench_offload", "cpu", ["shard-zero", "optim-came", "optim-adafactor"], where=where
        )
    )
    psi = results[0].params
    print(f"# Ψ = {psi:,} fp32 parameters ({shapes}), {cfg.rounds} interleaved rounds")
    anchor = results[0].seconds or float("nan")
    print("| optimizer step on the CPU | ms | M params/s | GB/s (28 B/param) | x for-loop |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(r.row(anchor))


if __name__ == "__main__":
    main()
