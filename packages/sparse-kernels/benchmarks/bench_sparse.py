#!/usr/bin/env python
"""BlockSparseLinear vs dense: CPU (PyTorch path, fp32) or GPU (Triton, bf16, vs cuBLAS).

Commands (from the repository root):
    # CPU: PyTorch path vs nn.Linear, fp32, forward and forward+backward
    python packages/sparse-kernels/benchmarks/bench_sparse.py [--size 4096] [--tokens 1024]
        [--blocks 32 64] [--sparsities 0.5 0.75 0.9] [--repeats 5]
    # GPU: Triton BlockSparseLinear and torch 2:4 vs F.linear (cuBLAS), bf16, prefill + decode
    python packages/sparse-kernels/benchmarks/bench_sparse.py --device cuda
        [--prefill-tokens 2048 4096 8192] [--decode-tokens 1 8 32] [--blocks 32 64 128]
        [--shapes 4096x4096,4096x14336,5120x20480]
    # dry run of the GPU code path on CPU through the Triton interpreter (tiny shapes)
    python packages/sparse-kernels/benchmarks/bench_sparse.py --device cpu --backend triton --tiny
        [--kernels sm90 --blocks 64]

CPU mode: weight `size x size` fp32, input `tokens x size`; block sparsity = fraction of tiles
dropped (tiles chosen by magnitude, random for a random init). Times are medians over
`repeats` interleaved rounds (dense and sparse timed in turn) after one warm-up. FLOPs count
2·tokens·size² per dense GEMM (3 GEMMs for forward+backward) and density x that for the
sparse layer; "useful GFLOP/s" divides the sparse layer's (non-zero) FLOPs by its time.

GPU mode: bf16 weights, no bias, `--shapes` IN x OUT (default 4096x4096, an attention
projection; 4096x14336, the Llama-3-8B MLP up-projection; 5120x20480, the GPT-13B one);
prefill (tokens 2048-8192: forward and forward+backward) and decode (tokens 1-32: forward).
Anchor: `F.linear` on the dense weight (cuBLAS), timed in the same run. Sparse:
`BlockSparseLinear(backend="triton")` at each block size and sparsity, and 2:4 through
`to_semi_structured_` (torch's cuSPARSELt/CUTLASS kernels; forward only). `--kernels`:
the forward/dX kernels of the block rows, "sm80" (`_bsr_kernels`, SPARSE_KERNELS_SM90=0), "sm90"
(the TMA/wgmma persistent kernel of `_bsr_hopper`, forced with SPARSE_KERNELS_SM90=1; blocks 64
and 128 only) or "both" (the default on an sm_90 GPU: each block row twice; else "sm80"). Times are
`triton.testing.do_bench` medians (CUDA events, L2 flushed between calls). Per point:
speedup = dense ms / sparse ms; dense TFLOP/s = dense FLOPs / dense time; useful TFLOP/s =
density x dense FLOPs / sparse time; efficiency = useful / dense TFLOP/s = density x speedup
(1.0 = the sparse kernel is as fast per non-zero FLOP as cuBLAS is per FLOP). Before timing,
the output (forward points) or dX and the stored dW tiles (forward+backward points) are
checked against cuBLAS on the masked dense weight: `check` = max |error| / max |reference|.
On an A100 or H100 each point also gets a predicted time for the dense anchor and the sparse
kernels (FLOPs, HBM and L2 bytes from the kernels' launch configuration; L2-resident re-reads
at L2 bandwidth: `roofline.py` states the counts, `leanlm_testing.roofline` the constants, printed
in the header) and measured / predicted. `--kernel-times` adds a column: the device µs of the
kernels of one call, dense / sparse (`torch.profiler`); the time per call less that is spent
outside the kernels (launches, host work, or the cold L2 that do_bench's flush leaves).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from roofline import HOST_H100_112DEA4, GpuPoint, GpuResult, predictions
from torch import nn

from leanlm_testing import bench
from leanlm_testing.roofline import kernel_assumptions


@dataclass(frozen=True)
class Config:
    """One benchmark point."""

    size: int
    tokens: int
    block: int
    sparsity: float


@dataclass(frozen=True)
class Result:
    """Median times of one point (seconds)."""

    config: Config
    density: float
    dense_fwd_s: float
    sparse_fwd_s: float
    dense_fwdbwd_s: float
    sparse_fwdbwd_s: float


def fwd_bwd(layer: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        y.backward(torch.ones_like(y))
        return y

    return run


def fwd(layer: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return layer(x)

    return run


def versions() -> str:
    triton = bench.version("triton")
    return f"git {bench.git_revision(__file__)}, torch {torch.__version__}, triton {triton}"


def run_cpu(args: argparse.Namespace) -> None:
    """The PyTorch path vs nn.Linear, fp32 (the CPU table of RESULTS.md)."""
    from sparse_kernels import BlockSparseLinear

    print(f"# bench_sparse: {versions()}")
    print(f"# device: {bench.device_name('cpu')}, torch threads {torch.get_num_threads()}; no GPU")
    print(
        f"# weight {args.size}x{args.size} fp32, tokens {args.tokens}; per point the dense layer "
        f"and the sparse one are timed in turn over {args.repeats} rounds (medians)"
    )

    torch.manual_seed(0)
    dense = nn.Linear(args.size, args.size)
    x = torch.randn(args.tokens, args.size, requires_grad=True)
    flops = 2 * args.tokens * args.size * args.size
    print()
    print(
        "| block | sparsity | fwd ms (dense / sparse) | fwd speedup | fwd+bwd ms (dense / sparse)"
        " | fwd+bwd speedup | useful GFLOP/s fwd+bwd |"
    )
    print("|---|---|---|---|---|---|---|")
    for block in args.blocks:
        for sparsity in args.sparsities:
            cfg = Config(args.size, args.tokens, block, sparsity)
            layer = BlockSparseLinear.from_dense(
                dense, block_size=block, sparsity=sparsity, backend="torch"
            )
            t = bench.interleaved_medians(
                {
                    "dense fwd": fwd(dense, x),
                    "sparse fwd": fwd(layer, x),
                    "dense fwdbwd": fwd_bwd(dense, x),
                    "sparse fwdbwd": fwd_bwd(layer, x),
                },
                rounds=args.repeats,
            )
            r = Result(
                cfg,
                layer.density,
                t["dense fwd"],
                t["sparse fwd"],
                t["dense fwdbwd"],
                t["sparse fwdbwd"],
            )
            useful = 3 * flops * r.density / r.sparse_fwdbwd_s / 1e9
            print(
                f"| {block} | {sparsity:.2f} | {r.dense_fwd_s * 1e3:.0f} / "
                f"{r.sparse_fwd_s * 1e3:.0f} | {r.dense_fwd_s / r.sparse_fwd_s:.2f}x | "
                f"{r.dense_fwdbwd_s * 1e3:.0f} / {r.sparse_fwdbwd_s * 1e3:.0f} | "
                f"{r.dense_fwdbwd_s / r.sparse_fwdbwd_s:.2f}x | {useful:.1f} |",
                flush=True,
            )


# ------------------------------------------------------------------------------- GPU mode
def make_timer(
    device: torch.device, args: argparse.Namespace
) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds per call: `do_bench` median on CUDA, `bench.median_seconds` elsewhere (dry run).

    With `--cuda-graphs`, `do_bench_cudagraph` replays the calls from a CUDA graph, which removes
    the Python and launch overhead that dominates decode-sized calls (no L2 flush there). With
    `--kernel-times`, each timed call is also profiled (`KERNEL_US`).
    """

    def kernels(fn: Callable[[], Any]) -> None:
        if args.kernel_times:  # device µs of the kernels of one call (CPU: operators' own time)
            KERNEL_US.append(sum(us for *_, us in bench.kernel_times(fn, device, calls=3)))

    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        def cuda_ms(fn: Callable[[], Any]) -> float:
            kernels(fn)
            if args.cuda_graphs:
                return float(do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median"))
            return float(do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median"))

        return cuda_ms

    def cpu_ms(fn: Callable[[], Any]) -> float:
        kernels(fn)
        return 1e3 * bench.median_seconds(fn, args.repeats)

    return cpu_ms


#: with --kernel-times, what the timer profiled for the current point: [dense µs, sparse µs]
KERNEL_US: list[float] = []


def kernel_cell() -> str:
    """The --kernel-times cell of the current point ("" without the flag)."""
    if not KERNEL_US:
        return ""
    return " " + " / ".join(f"{us:.1f}" for us in KERNEL_US) + " |"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:  # no stored tile (tiny shapes at high sparsity): nothing to compare
        return 0.0
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def bench_block(
    pt: GpuPoint, w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, *, timer: Any
) -> GpuResult:
    """Triton BlockSparseLinear vs F.linear on the dense weight (the anchor)."""
    from sparse_kernels import BlockSparseLinear
    from sparse_kernels.layout import dense_to_blocks

    dense = nn.Linear(pt.in_f, pt.out_f, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        dense.weight.copy_(w)
    layer = BlockSparseLinear.from_dense(
        dense, block_size=pt.block, sparsity=pt.sparsity, backend="triton"
    )
    # read by the launchers at every call: the timed calls run the point's kernels
    os.environ["SPARSE_KERNELS_SM90"] = "1" if pt.kernels == "sm90" else "0"
    wd = layer.to_dense().detach().requires_grad_(True)  # masked dense weight: the reference
    w_req = w.detach().requires_grad_(pt.op == "fwd+bwd")
    if pt.op == "fwd":
        with torch.no_grad():  # inference: no autograd graph for either side
            check = rel_err(layer(x), F.linear(x, wd))
            dense_ms = timer(lambda: F.linear(x, w))
            sparse_ms = timer(lambda: layer(x))
    else:
        xg = x.detach().requires_grad_(True)
        got = torch.autograd.grad(layer(xg), (xg, layer.values), dy)
        ref_dx, ref_dw = torch.autograd.grad(F.linear(xg, wd), (xg, wd), dy)
        check = max(rel_err(got[0], ref_dx), rel_err(got[1], dense_to_blocks(ref_dw, layer.layout)))
        dense_ms = timer(lambda: torch.autograd.grad(F.linear(xg, w_req), (xg, w_req), dy))
        sparse_ms = timer(lambda: torch.autograd.grad(layer(xg), (xg, layer.values), dy))
    return GpuResult(pt, layer.density, dense_ms, sparse_ms, check)


def bench_24(pt: GpuPoint, w: torch.Tensor, x: torch.Tensor, timer: Any) -> GpuResult | str:
    """2:4 with torch's kernels (via `to_semi_structured_`) vs F.linear; forward only."""
    from sparse_kernels import to_semi_structured_
    from sparse_kernels.masks import nm_mask

    w24 = w * nm_mask(w.abs(), 2, 4)
    linear = nn.Linear(pt.in_f, pt.out_f, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w24)
    try:  # torch refuses some devices, archs and shapes: report why instead of stopping
        to_semi_structured_(linear)
        with torch.no_grad():
            check = rel_err(linear(x), F.linear(x, w24))
            dense_ms = timer(lambda: F.linear(x, w))
            sparse_ms = timer(lambda: linear(x))
    except (ValueError, RuntimeError, NotImplementedError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    return GpuResult(pt, 0.5, dense_ms, sparse_ms, check)


def gpu_points(args: argparse.Namespace) -> list[GpuPoint]:
    pts = []
    for phase, tokens_list, ops in (
        ("prefill", args.prefill_tokens, ("fwd", "fwd+bwd")),
        ("decode", args.decode_tokens, ("fwd",)),
    ):
        for in_f, out_f in args.shapes:
            for tokens in tokens_list:
                for op in ops:
                    if not args.no_24 and op == "fwd":
                        pts.append(GpuPoint(phase, tokens, in_f, out_f, op, "2:4", 0, 0.5))
                    for block in args.blocks:
                        for s in args.sparsities:
                            for kern in args.kernel_paths:
                                if kern == "sm90" and block not in (64, 128):
                                    continue
                                pt = GpuPoint(
                                    phase, tokens, in_f, out_f, op, "block", block, s, kern
                                )
                                pts.append(pt)
    return pts


def run_gpu(args: argparse.Namespace) -> None:
    """Triton BlockSparseLinear and 2:4 vs cuBLAS (or the interpreter dry run on CPU)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (
            f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
            f"CUDA {torch.version.cuda}"
        )
    else:
        where = (
            f"{bench.device_name(device)} under TRITON_INTERPRET=1 (dry run: times are meaningless)"
        )
    print(f"# bench_sparse --device {args.device}: {versions()}")
    print(f"# device: {where}")
    print(
        f"# bf16, no bias; weights (in->out) {args.shapes}; prefill tokens {args.prefill_tokens}, "
        f"decode tokens {args.decode_tokens}; blocks {args.blocks}, sparsities {args.sparsities}"
    )
    bench_fn = "do_bench_cudagraph" if args.cuda_graphs else "do_bench"
    timing = f"{bench_fn} median, rep {args.rep_ms} ms" if device.type == "cuda" else "perf_counter"
    anchor = "F.linear (cuBLAS)" if device.type == "cuda" else "F.linear (CPU)"
    print(f"# timing: {timing}; anchor {anchor} on the dense weight")
    print(f"# predictions: {kernel_assumptions()}; {HOST_H100_112DEA4.describe()}\n")
    timer = make_timer(device, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        "| phase | in->out | tokens | op | kernel | density | dense ms | sparse ms | speedup "
        "| dense TFLOP/s | useful TFLOP/s | efficiency | check | predicted dense / sparse ms "
        "(bound) | measured / predicted dense, sparse |"
        + (" kernel µs dense / sparse |" if args.kernel_times else "")
    )
    print("|---" * (15 + args.kernel_times) + "|")
    gen = torch.Generator(device=device).manual_seed(0)
    weights: dict[tuple[int, int], torch.Tensor] = {}
    failed = 0
    for pt in gpu_points(args):
        key = (pt.in_f, pt.out_f)
        if key not in weights:
            bound = pt.in_f**-0.5  # nn.Linear's init scale
            weights[key] = (
                torch.rand(pt.out_f, pt.in_f, generator=gen, device=device) * 2 - 1
            ).mul_(bound).to(dtype)  # fmt: skip
        w = weights[key]
        x = torch.randn(pt.tokens, pt.in_f, generator=gen, device=device).to(dtype)
        dy = torch.randn(pt.tokens, pt.out_f, generator=gen, device=device).to(dtype)
        KERNEL_US.clear()
        if pt.kind == "2:4":
            res: GpuResult | str = bench_24(pt, w, x, timer)
            label = "2:4 (torch semi-structured)"
        else:
            res = bench_block(pt, w, x, dy, timer=timer)
            label = f"triton block {pt.block} ({pt.kernels})"
        prefix = f"| {pt.phase} | {pt.in_f}->{pt.out_f} | {pt.tokens} | {pt.op} | {label} |"
        if isinstance(res, str):
            print(f"{prefix} 0.500 | - | - | - | - | - | - | unavailable: {res} | - | - |"
                  + (" - |" if args.kernel_times else ""))  # fmt: skip
            continue
        flag = "" if res.check <= args.tolerance else " FAIL"
        failed += bool(flag)
        tiles = -(-pt.out_f // max(pt.block, 1)) * -(-pt.in_f // max(pt.block, 1))
        pred = predictions(pt, round(res.density * tiles), name)
        roof = "- | -"
        if pred is not None:
            roof = (
                f"{pred[0]:.4f} / {pred[1]:.4f} ({pred[2]}) | "
                f"{res.dense_ms / pred[0]:.2f}, {res.sparse_ms / pred[1]:.2f}"
            )
        print(
            f"{prefix} {res.density:.3f} | {res.dense_ms:.4f} | {res.sparse_ms:.4f} | "
            f"{res.speedup:.2f}x | {res.dense_tflops:.1f} | {res.useful_tflops:.1f} | "
            f"{res.efficiency:.2f} | {res.check:.1e}{flag} | {roof} |" + kernel_cell(),
            flush=True,
        )
    print(f"\n# parity checks above tolerance {args.tolerance}: {failed}")
    if failed:
        raise SystemExit(1)


def shapes_arg(text: str) -> list[tuple[int, int]]:
    """`--shapes`: comma-separated IN x OUT weight shapes, e.g. "4096x4096,5120x20480"."""
    shapes = [tuple(item.strip().lower().split("x")) for item in text.split(",")]
    if not all(len(s) == 2 and all(d.isdigit() and int(d) > 0 for d in s) for s in shapes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of INxOUT positive integers, "
            "e.g. 4096x4096,4096x14336,5120x20480"
        )
    return [(int(a), int(b)) for a, b in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend",
        choices=("torch", "triton"),
        help="cpu: torch (default, the CPU table) or triton (interpreter dry run, needs --tiny); "
        "cuda: triton (default)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (interpreter dry run)")
    parser.add_argument("--size", type=int, default=4096, help="CPU mode: weight size x size")
    parser.add_argument("--tokens", type=int, default=1024, help="CPU mode: tokens")
    parser.add_argument("--blocks", type=int, nargs="+", help="default: CPU 32 64, GPU 32 64 128")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    parser.add_argument("--repeats", type=int, default=5, help="CPU timing repeats")
    parser.add_argument(
        "--shapes", type=shapes_arg,
        help="GPU mode and --tiny: weights IN x OUT, comma-separated (default: cuda "
        "4096x4096,4096x14336,5120x20480; --tiny 64x96,64x160); ignored by the CPU table "
        "(--size), as the GPU token options are, so gpu_checks.sh's CPU dry run takes it",
    )  # fmt: skip
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench time per point (ms)")
    parser.add_argument("--no-24", action="store_true", help="skip the 2:4 rows")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="time CUDA-graph replays (no launch overhead)"
    )
    parser.add_argument(
        "--kernel-times", action="store_true",
        help="profile each timed call too: a column with its kernels' device µs (torch.profiler)",
    )  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=2e-2, help="max check (bf16)")
    parser.add_argument(
        "--kernels", choices=("sm80", "sm90", "both"),
        help="block forward/dX kernels (default: both on an sm_90 GPU, else sm80)",
    )  # fmt: skip
    args = parser.parse_args()
    backend = args.backend or ("triton" if args.device == "cuda" else "torch")
    if args.device == "cuda" and backend != "triton":
        parser.error("--device cuda benchmarks the Triton backend (drop --backend torch)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if args.device == "cpu" and backend == "triton" and not args.tiny:
        parser.error("--device cpu --backend triton runs the interpreter: add --tiny")
    if backend == "torch":  # the CPU table: --size, not --shapes (nor the GPU token options)
        args.blocks = args.blocks or [32, 64]
        run_cpu(args)
        return
    if args.tiny:  # a few tiles per weight, odd token counts: seconds under the interpreter
        args.shapes = args.shapes or [(64, 96), (64, 160)]
        args.prefill_tokens, args.decode_tokens = [33], [1, 8]
        args.blocks = args.blocks or [16, 32]
        args.repeats = 1
    args.shapes = args.shapes or [(4096, 4096), (4096, 14336), (5120, 20480)]
    args.blocks = args.blocks or [32, 64, 128]
    hopper = args.device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    kernels = args.kernels or ("both" if hopper else "sm80")
    args.kernel_paths = ["sm80", "sm90"] if kernels == "both" else [kernels]
    if args.device == "cpu":
        # The kernels read this at import: set before the first `sparse_kernels` import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run_gpu(args)


if __name__ == "__main__":
    main()
