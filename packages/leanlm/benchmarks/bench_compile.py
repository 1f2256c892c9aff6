"""Training throughput with `compile = true` against eager, on the CPU (or `--device cuda`).

Command (from the repo root):

    python packages/leanlm/benchmarks/bench_compile.py [--sizes tiny smoke] [--rounds 7]
        [--steps 10] [--threads N] [--device cpu]

For each size, two copies of the same Llama (`leanlm.train.model.llama_config`, same initial
weights) train with AdamW on the same random batches: one eager, one with
`leanlm.train.engines.compile_layers` applied (what `compile = true` does before the engine
wraps the model). A round times `--steps` optimizer steps (forward, `causal_lm_loss`, backward,
step) of each in turn; the table gives the median tokens per second over `--rounds` interleaved
rounds and the ratio compiled / eager. The first call of each (compiling, for the compiled one)
is timed separately and not in the medians.
Sizes: `tiny` is the tests' model (hidden 32, 2 layers, 4 x 32 tokens per step, vocabulary 512),
`smoke` the smoke preset's (hidden 64, 2 layers, 8 x 128 tokens, vocabulary 2048). The header
names the device, thread count, load, versions and git SHA.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from leanlm.config import ModelConfig
from leanlm.presets import PRESETS
from leanlm.train.engines import compile_layers
from leanlm.train.evaluate import causal_lm_loss
from leanlm.train.model import llama_config
from leanlm_testing import bench


@dataclass(frozen=True, kw_only=True)
class Size:
    """A model and batch shape."""

    model: ModelConfig
    vocab: int
    batch: int
    seq_len: int


def _sizes() -> dict[str, Size]:
    smoke = PRESETS["smoke"]()
    model = smoke.model
    tiny = dataclasses.replace(
        model, hidden_size=32, intermediate_size=64, max_position_embeddings=64
    )
    return {
        "tiny": Size(model=tiny, vocab=512, batch=4, seq_len=32),
        "smoke": Size(
            model=model,
            vocab=smoke.tokenizer.vocab_size,
            batch=smoke.pretrain.micro_batch_size,
            seq_len=smoke.data.seq_len,
        ),
    }


SIZES = _sizes()
"""`tiny`: the tests' model (`tiny_config` in tests/conftest.py); `smoke`: the smoke preset's."""


@dataclass(frozen=True)
class Result:
    """One size's eager and compiled throughput."""

    size: str
    tokens_per_step: int
    first_s: dict[str, float]
    """Seconds of the first step (the compiled one compiles in it)."""
    median_s: dict[str, float]
    """Median seconds of `steps` steps."""
    steps: int

    def row(self) -> str:
        """A markdown table row."""
        rate = {k: self.steps * self.tokens_per_step / s for k, s in self.median_s.items()}
        return (
            f"| {self.size} | {self.tokens_per_step} | {rate['eager']:,.0f} | "
            f"{rate['compiled']:,.0f} | {rate['compiled'] / rate['eager']:.2f} | "
            f"{self.first_s['eager']:.2f} | {self.first_s['compiled']:.1f} |"
        )


def _trainer(model: torch.nn.Module, batches: list[torch.Tensor], steps: int) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    position = [0]

    def run() -> None:
        for _ in range(steps):
            batch = batches[position[0] % len(batches)]
            position[0] += 1
            causal_lm_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def measure(name: str, size: Size, *, rounds: int, steps: int, device: str) -> Result:
    """Eager vs compiled training steps of one size."""
    config = llama_config(size.model, vocab_size=size.vocab, bos_id=0, eos_id=1, pad_id=2)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(config).to(device)
    compiled = LlamaForCausalLM(config).to(device)
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, size.vocab, (size.batch, size.seq_len), generator=gen).to(device)
        for _ in range(8)
    ]
    sync = bench.synchronizer(device)
    cases = {
        "eager": _trainer(eager, batches, steps),
        "compiled": _trainer(compiled, batches, steps),
    }
    first = {}
    for key, model in (("eager", eager), ("compiled", compiled)):
        start = time.perf_counter()
        causal_lm_loss(model, batches[0]).backward()
        model.zero_grad(set_to_none=True)
        sync()
        first[key] = time.perf_counter() - start
    medians = bench.interleaved_medians(cases, rounds=rounds, warmup=1, sync=sync)
    return Result(name, size.batch * size.seq_len, first, medians, steps)


def main() -> None:
    """Parse the command line, run every size, print the header and the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "smoke"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per round")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = Path(__file__).parent
    print(bench.header("bench_compile", args.device, ["leanlm", "transformers"], where=where))
    print(f"rounds {args.rounds}, {args.steps} AdamW steps per round, fp32\n")
    print(
        "| size | tokens/step | eager tokens/s | compiled tokens/s | compiled / eager "
        "| eager 1st step s | compiled 1st step s (compiling) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.sizes:
        result = measure(
            name, SIZES[name], rounds=args.rounds, steps=args.steps, device=args.device
        )
        print(result.row(), flush=True)


if __name__ == "__main__":
    main()
