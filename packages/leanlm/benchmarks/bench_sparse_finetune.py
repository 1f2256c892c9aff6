"""The sparsify stage's fine-tune, dense against block-sparse: training tokens/s (issue 24 item 5).

Command (from the repo root; a GPU run uses the CUDA defaults, a run without one is a dry run):

    python packages/leanlm/benchmarks/bench_sparse_finetune.py [--device cuda] [--rounds 5]
        [--steps 2] [--densities 0.5 0.25] [--block 128] [--layers 4] [--seq 2048] [--batch 4]
        [--dtype bf16] [--optimizer came]

The model is a Llama built from leanlm's `ModelConfig` (`leanlm.train.model.llama_config`, no
download): on CUDA the TinyLlama-1.1B widths (hidden 2048, MLP 5632, 32 heads / 4 kv, vocabulary
32000) with `--layers` layers, batch 4 x 2048 tokens, bf16 parameters; on the CPU a tiny one (hidden
512, MLP 1024, 2 layers, batch 2 x 64, fp32), which is a dry run of the script, not a speed claim.
One seeded model is copied into every case, so all start from the same weights:

* `dense`: not pruned;
* `masked d`: `sparsify_` with the stage's `SparsifyConfig(...).sparsity_config` (method
  magnitude: the tile choice does not change the cost) keeps `d` of the `--block` tiles of every
  decoder Linear, as a mask parametrization (dense compute): what the stage fine-tunes for
  `pattern = "block"` when `[sparsify] block_sparse_layers` is off (`false`, or `"auto"` on a CPU
  or with a `block_size` other than 16, 32, 64, 128);
* `block-sparse d`: the same masked model after `to_block_sparse_` (the masks' tiles kept
  exactly): `BlockSparseLinear` layers storing and training only those tiles. What the stage
  fine-tunes when `block_sparse_layers` is on (`"auto"`, the default, on CUDA with one of those
  block sizes; or `true`): after the one-shot evaluation it converts every masked decoder Linear
  that kept a tile with `to_block_sparse_(..., backend="auto")` (one with no tile stays masked),
  and turns them back into masked Linears (`to_masked_linear_`) before it saves (a resumed run
  keeps the choice its fine-tune started with).

Every case trains with the stage's optimizer step (`decay_param_groups`, `optimizer_over`,
`causal_lm_loss`, gradient clipping, the warmup + cosine schedule, `SparsifyConfig`'s defaults)
on the same batches. A round times `--steps` steps of each case in turn
(`bench.interleaved_medians`, one untimed call of each first: compiles); the table gives the
median step time, tokens/s, the ratio to `dense` measured in the same run, the last loss and, on
CUDA, the peak memory of one step
(`torch.cuda.max_memory_allocated`) with every other case's tensors left out: what the case needs
alone. After the timing one correctness check (not a timing): the stored tiles are exactly
sparsify_'s masks, the weights are zero outside them, the stored tiles trained, every loss is
finite, and before training block-sparse and masked models gave the same loss.

Precision: `--dtype bf16` trains bf16 parameters (no fp32 masters), `fp32` fp32 ones (the stage's
default, `mixed_precision = "no"`). bf16 parameters because, when this script was written,
`BlockSparseLinear` was not autocast-aware: under the stage's `mixed_precision = "bf16"` (fp32
masters under autocast) its Triton launchers (sm_80 and sm_90) raised a TypeError when o_proj
received bf16 inputs for fp32 tiles (seen under TRITON_INTERPRET=1 with CPU autocast). It now
casts x, tiles and bias to the autocast dtype as `nn.Linear` does, and the stage converts with
`[sparsify] block_sparse_layers`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LlamaForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

from leanlm.config import ModelConfig, SparsifyConfig
from leanlm.train.evaluate import causal_lm_loss
from leanlm.train.model import llama_config
from leanlm.train.optim import OPTIMIZERS, decay_param_groups, optimizer_over
from leanlm_testing import bench
from sparse_kernels import BlockSparseLinear, get_mask, sparsify_, to_block_sparse_
from sparse_kernels import _bsr_hopper as hopper  # the layer's own sm90/sm80 decision
from sparse_kernels.block_sparse import resolve_backend
from sparse_kernels.layout import blocks_to_dense

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_MODEL = ModelConfig(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip
CPU_MODEL = ModelConfig(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
DEFAULTS = {  # device -> model, vocabulary, batch, sequence length, dtype
    "cuda": (GPU_MODEL, 32000, 4, 2048, "bf16"),
    "cpu": (CPU_MODEL, 512, 2, 64, "fp32"),
}


@dataclass(kw_only=True)
class Case:
    """One model in training: its optimizer, schedule, masks and losses."""

    name: str
    density: float | None
    model: torch.nn.Module
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    """sparsify_'s masks (True = kept) of the pruned Linears; empty for `dense`."""
    before: torch.Tensor | None = None
    """The first pruned Linear's weight before training (to see that its tiles trained)."""
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    done: int = 0


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The (out, in) weight of a Linear (masked or not) or of a `BlockSparseLinear`."""
    if isinstance(module, BlockSparseLinear):
        return module.to_dense().detach()
    return module.weight.detach()  # type: ignore[operator]


def build_cases(
    base: torch.nn.Module, densities: list[float], block: int, cfg: SparsifyConfig
) -> list[Case]:
    """`dense`, then `masked d` and `block-sparse d` per density, all copies of `base`."""
    cases = [Case(name="dense", density=None, model=copy.deepcopy(base))]
    for density in densities:
        section = dataclasses.replace(
            cfg, pattern="block", method="magnitude", sparsity=1.0 - density, block_size=block
        )
        masked = copy.deepcopy(base)
        masks = sparsify_(masked, section.sparsity_config)  # as the stage calls it
        first = next(iter(masks))
        before = dense_weight(masked.get_submodule(first)).clone()
        sparse = copy.deepcopy(masked)
        to_block_sparse_(sparse, block_size=block)  # the masks' tiles, backend "auto"
        for name, model in ((f"masked {density:g}", masked), (f"block-sparse {density:g}", sparse)):
            cases.append(Case(name=name, density=density, model=model, masks=masks, before=before))
    return cases


def add_optimizer(case: Case, cfg: SparsifyConfig, total_steps: int) -> None:
    """The stage's optimizer (`Parallel.make_optimizer`) and schedule (`train`'s `_Loop`)."""
    groups = decay_param_groups(case.model.parameters(), cfg.weight_decay)
    case.optimizer = optimizer_over(
        cfg.optimizer, groups, lr=cfg.lr, betas=cfg.betas, state_dtype=cfg.state_dtype
    )
    case.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        case.optimizer, cfg.warmup_steps, total_steps, min_lr_rate=cfg.min_lr_ratio
    )


def trainer(
    case: Case, batches: list[torch.Tensor], steps: int, cfg: SparsifyConfig
) -> Callable[[], None]:
    """`steps` optimizer steps of `case` (the stage's step at one process, one micro-batch)."""
    assert case.optimizer is not None
    assert case.scheduler is not None
    optimizer, scheduler = case.optimizer, case.scheduler

    def run() -> None:
        for _ in range(steps):
            loss = causal_lm_loss(case.model, batches[case.done % len(batches)])
            loss.backward()  # type: ignore[no-untyped-call]
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(case.model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            case.losses.append(loss.detach())
            case.done += 1

    return run


def state_bytes(case: Case) -> int:
    """Bytes of the case's parameters and optimizer state."""
    assert case.optimizer is not None
    tensors: list[torch.Tensor] = list(case.model.parameters())
    tensors += [
        v for st in case.optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def step_peak_gib(case: Case, run_one: Callable[[], None]) -> float:
    """CUDA: the case's parameters and optimizer state plus the peak one step allocates on top."""
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_one()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - resident + state_bytes(case)) / 2**30


def kernel_paths(case: Case, tokens: int) -> str:
    """Which sparse-kernels path each BlockSparseLinear call takes: torch, sm80 or sm90.

    Decided per call by the layer from device, block size, dtype, tokens and stored elements
    (`block_sparse.resolve_backend`, then `_bsr_hopper.use_sm90` for forward, dX and dW alike);
    asked here of the same functions with this run's values.
    """
    paths: dict[str, set[str]] = {}
    for name, mod in case.model.named_modules():
        if not isinstance(mod, BlockSparseLinear):
            continue
        values, layout = mod.values, mod.layout
        path = resolve_backend(mod.backend, values.device, mod.block_size)
        if path == "triton":
            stored = layout.nnzb * mod.block_size**2
            sm90 = hopper.use_sm90(values.device, mod.block_size, values.dtype, tokens, stored)
            path = "sm90" if sm90 else "sm80"
        paths.setdefault(path, set()).add(name.rsplit(".", 1)[-1])
    return "; ".join(f"{p}: {', '.join(sorted(n))}" for p, n in sorted(paths.items()))


def check(cases: list[Case], initial: dict[str, float], rtol: float) -> list[str]:
    """The correctness check after the timed steps; returns the problems found."""
    problems = []
    for case in cases:
        if not all(bool(torch.isfinite(x)) for x in case.losses):
            problems.append(f"{case.name}: a loss is not finite")
        for name, mask in case.masks.items():
            mod = case.model.get_submodule(name)
            if isinstance(mod, BlockSparseLinear):
                kept = blocks_to_dense(torch.ones_like(mod.values), mod.layout) != 0
            else:
                kept = get_mask(mod)  # type: ignore[assignment]
            if kept is None or not torch.equal(kept, mask):
                problems.append(f"{case.name} {name}: stored/kept tiles are not sparsify_'s mask")
            if bool(dense_weight(mod)[~mask].any()):
                problems.append(f"{case.name} {name}: a pruned weight is not exactly zero")
        if case.masks and case.before is not None:
            first = case.model.get_submodule(next(iter(case.masks)))
            if torch.equal(dense_weight(first), case.before):
                problems.append(f"{case.name}: the stored tiles did not train")
    for case in cases:
        if case.name.startswith("block-sparse"):
            ref = initial[case.name.replace("block-sparse", "masked")]
            if abs(initial[case.name] - ref) > rtol * abs(ref):
                problems.append(f"{case.name}: initial loss {initial[case.name]} vs masked {ref}")
    return problems


def parse() -> argparse.Namespace:
    """The command line, with each device's defaults filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="default: cuda 5, cpu 3")
    parser.add_argument("--steps", type=int, default=2, help="steps per case per round")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--block", type=int, default=128, help="tile edge")
    parser.add_argument("--layers", type=int, default=None, help="default: cuda 4, cpu 2")
    parser.add_argument("--seq", type=int, default=None, help="default: cuda 2048, cpu 64")
    parser.add_argument("--batch", type=int, default=None, help="default: cuda 4, cpu 2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cuda bf16, cpu fp32")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=SparsifyConfig().optimizer)
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    model, args.vocab, batch, seq, dtype = DEFAULTS[args.device]
    args.rounds = args.rounds or (5 if args.device == "cuda" else 3)
    args.batch, args.seq, args.dtype = args.batch or batch, args.seq or seq, args.dtype or dtype
    layers = args.layers or model.num_hidden_layers
    for flag in ("rounds", "steps", "block", "seq", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if layers < 1:
        parser.error(f"--layers must be >= 1, got {layers}")
    if not all(0.0 < d <= 1.0 for d in args.densities):
        parser.error(f"--densities are kept-tile fractions in (0, 1], got {args.densities}")
    if len(set(args.densities)) != len(args.densities):
        parser.error(f"--densities must differ, got {args.densities}")
    args.model = dataclasses.replace(
        model, num_hidden_layers=layers, max_position_embeddings=max(args.seq, 2)
    )
    return args


def main() -> None:
    """Build the cases, check their initial losses, time them interleaved, check, print."""
    args = parse()
    device, dtype = args.device, DTYPES[args.dtype]
    dists = ("leanlm", "sparse-kernels", "optim-came", "transformers")
    print(bench.header("bench_sparse_finetune", device, dists, where=__file__))
    cfg = SparsifyConfig(optimizer=args.optimizer)
    config = llama_config(args.model, vocab_size=args.vocab, bos_id=0, eos_id=1, pad_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config).to(dtype)
    base.train()
    cases = build_cases(base, args.densities, args.block, cfg)
    del base
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
        for _ in range(4)
    ]
    tokens = args.batch * args.seq
    with torch.no_grad():  # the same function before training: block-sparse = masked
        initial = {c.name: float(causal_lm_loss(c.model, batches[0])) for c in cases}
    total = (1 + args.rounds) * args.steps + (1 if device == "cuda" else 0)
    for case in cases:
        add_optimizer(case, cfg, total)
    sync = bench.synchronizer(device)
    runs = {c.name: trainer(c, batches, args.steps, cfg) for c in cases}
    medians = bench.interleaved_medians(runs, args.rounds, warmup=1, sync=sync)
    peaks = {c.name: "n/a" for c in cases}
    if device == "cuda":
        peaks = {c.name: f"{step_peak_gib(c, trainer(c, batches, 1, cfg)):.2f}" for c in cases}

    n_params = {c.name: sum(p.numel() for p in c.model.parameters()) for c in cases}
    m = args.model
    print(
        f"# model: Llama hidden {m.hidden_size}, MLP {m.intermediate_size}, {m.num_hidden_layers} "
        f"layers, {m.num_attention_heads}/{m.num_key_value_heads} heads, vocabulary {args.vocab}, "
        f"{n_params['dense'] / 1e6:.1f}M params, {args.dtype} parameters; batch {args.batch} x "
        f"{args.seq} = {tokens} tokens/step; optimizer {cfg.optimizer} (the stage's step); "
        f"block {args.block}; median of {args.rounds} interleaved rounds of {args.steps} steps"
    )
    if device == "cpu":
        print(
            "# CPU dry run of the script: BlockSparseLinear runs its PyTorch path (backend "
            "'torch'); these times say nothing about GPU speed"
        )
    print(
        "| case | tile density | params (M) | ms/step | tokens/s | x dense | peak GiB | last loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    anchor = medians["dense"]
    for case in cases:
        step_s = medians[case.name] / args.steps
        density = "1" if case.density is None else f"{case.density:g}"
        print(
            f"| {case.name} | {density} | {n_params[case.name] / 1e6:.1f} | {step_s * 1e3:.1f} | "
            f"{tokens / step_s:,.0f} | {anchor / medians[case.name]:.2f} | {peaks[case.name]} | "
            f"{float(case.losses[-1]):.4f} |"
        )
    for case in cases:
        if case.name.startswith("block-sparse"):
            print(f"# sparse-kernels path, {case.name}: {kernel_paths(case, tokens)}")
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    problems = check(cases, initial, rtol)
    first = ", ".join(f"{k} {v:.4f}" for k, v in initial.items())
    print(f"# initial losses (batch 0, before training): {first}")
    print(
        "# correctness (not a timing): "
        + (
            "ok: stored/kept tiles = sparsify_'s masks, zeros outside them exact, stored tiles "
            f"trained, all losses finite, block-sparse initial loss = masked within {rtol:g}"
            if not problems
            else "FAILED: " + "; ".join(problems)
        )
    )
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
