#!/usr/bin/env python
"""Why torch's 2:4 kernels ran at 0.10-0.35x cuBLAS on an H100: one timed variant per suspect.

Command (from the repository root):
    python packages/sparse-kernels/benchmarks/bench_24.py --device cuda
        [--shapes 4096x4096 4096x14336] [--tokens 4096 16] [--rep-ms 25]

`bench_sparse.py` times 2:4 the way a user gets it (`to_semi_structured_`, then `F.linear`).
This script splits that path into the suspects of issue 24, each timed against `F.linear` on
the dense weight in the same run (bf16, no bias):

- `F.linear` on `to_sparse_semi_structured(w)`: the path bench_sparse times; the row names the
  class torch picked (cuSPARSELt unless `_FORCE_CUTLASS`).
- the same with `_FORCE_CUTLASS = True` (CUTLASS's 2:4 kernels are built for sm_8x).
- `torch._cslt_sparse_mm` called directly on the compressed weight (no subclass dispatch,
  the transpose fused through `transpose_result`), with algorithm 0 and with the algorithm
  `torch._cslt_sparse_mm_search` picks for this input; `F.linear` again with that algorithm.
- `compress`: `to_sparse_semi_structured` itself (what a path that compressed per call would
  add; ours compresses once).

Per row: median ms (`do_bench`, L2 flushed), median ms of CUDA-graph replays (no host work: a
row much faster replayed is host-bound), speedup = dense ms / variant ms, check = max |error| /
max |reference| against `F.linear` on the 2:4-masked dense weight, and the CUDA kernels one call
launches with their device microseconds (torch.profiler): which library ran, and any extra
copy or transpose kernels. A variant torch refuses prints its error instead.

`--device cpu` is a dry run of the script (torch's 2:4 kernels are CUDA-only: every variant row
says so; times are perf_counter medians).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from leanlm_testing import bench

Call = Callable[[], Tensor]
#: name -> builder(w24, x) returning (one call, a note: class or algorithm)
Builder = Callable[[Tensor, Tensor], tuple[Call, str]]
Timers = tuple[Callable[[Call], float], Callable[[Call], float] | None]  # plain, CUDA-graph


@contextlib.contextmanager
def forced_cutlass() -> Iterator[None]:
    cls = torch.sparse.SparseSemiStructuredTensor
    old = cls._FORCE_CUTLASS
    cls._FORCE_CUTLASS = True
    try:
        yield
    finally:
        cls._FORCE_CUTLASS = old


def _semi(w24: Tensor, x: Tensor, alg_id: int = 0) -> tuple[Call, str]:
    sparse = torch.sparse.to_sparse_semi_structured(w24, alg_id=alg_id)
    return (lambda: F.linear(x, sparse)), f"{type(sparse).__name__}, alg {alg_id}"


def _cutlass(w24: Tensor, x: Tensor) -> tuple[Call, str]:
    with forced_cutlass():
        sparse = torch.sparse.to_sparse_semi_structured(w24)
    return (lambda: F.linear(x, sparse)), type(sparse).__name__


def _searched_alg(packed: Tensor, x: Tensor) -> int:
    return int(torch._cslt_sparse_mm_search(packed, x.t(), transpose_result=True))


def _cslt(w24: Tensor, x: Tensor, *, search: bool) -> tuple[Call, str]:
    packed = torch._cslt_compress(w24)
    alg = _searched_alg(packed, x) if search else 0
    # (N, K) sparse @ (K, M) = W·xᵀ; transpose_result gives x·Wᵀ (M, N) without a copy kernel
    return (lambda: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True, alg_id=alg)), (
        f"alg {alg}"
    )


def _semi_searched(w24: Tensor, x: Tensor) -> tuple[Call, str]:
    return _semi(w24, x, _searched_alg(torch._cslt_compress(w24), x))


def _compress(w24: Tensor, x: Tensor) -> tuple[Call, str]:
    def call() -> Tensor:
        packed = torch.sparse.to_sparse_semi_structured(w24).packed
        assert packed is not None  # cuSPARSELt's compressed weight (CUTLASS keeps two tensors)
        return packed

    call()  # refuses here, not while timing, where torch cannot compress
    return call, "to_sparse_semi_structured"


VARIANTS: dict[str, Builder] = {
    "F.linear, semi-structured (default)": _semi,
    "F.linear, CUTLASS forced": _cutlass,
    "_cslt_sparse_mm, alg 0": lambda w, x: _cslt(w, x, search=False),
    "_cslt_sparse_mm, searched alg": lambda w, x: _cslt(w, x, search=True),
    "F.linear, semi-structured, searched alg": _semi_searched,
    "compress (per call)": _compress,
}


def make_timers(device: torch.device, rep_ms: int) -> Timers:
    """(ms per call, ms per CUDA-graph replay or None) for `device`."""
    if device.type != "cuda":
        return (lambda fn: 1e3 * bench.median_seconds(fn, 5)), None
    from triton.testing import do_bench, do_bench_cudagraph

    def plain(fn: Call) -> float:
        return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))

    def graph(fn: Call) -> float:
        return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))

    return plain, graph


def kernels(fn: Call, device: torch.device) -> str:
    """The CUDA kernels one call of `fn` launches, with their device microseconds."""
    if device.type != "cuda":
        return "-"
    top = bench.kernel_times(fn, device, calls=3)[:4]
    return "; ".join(f"{name[:70]} {us:.1f}" for name, _, us in top) or "none seen"


def rel_err(got: Tensor, ref: Tensor) -> float:
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def point(w: Tensor, x: Tensor, device: torch.device, timers: Timers) -> None:
    """The anchor and every variant at one weight and token count: one table row each."""
    from sparse_kernels.masks import nm_mask

    plain, graph = timers
    w24 = w * nm_mask(w.abs(), 2, 4)
    ref = F.linear(x, w24)
    where = f"| {w.shape[1]}->{w.shape[0]} | {x.shape[0]} |"

    def row(name: str, fn: Call, note: str, check: str, dense: float | None) -> float:
        ms = plain(fn)
        g = f"{graph(fn):.4f}" if graph is not None else "-"
        speed = f"{dense / ms:.2f}x" if dense is not None else "1.00x"
        print(f"{where} {name} | {note} | {ms:.4f} | {g} | {speed} | {check} | "
              f"{kernels(fn, device)} |", flush=True)  # fmt: skip
        return ms

    lib = "cuBLAS" if device.type == "cuda" else "CPU"
    dense = row("F.linear, dense (anchor)", lambda: F.linear(x, w), lib, "-", None)
    for name, build in VARIANTS.items():
        try:  # torch refuses devices, archs, shapes and versions: say why, go on
            fn, note = build(w24, x)
            check = "-" if name.startswith("compress") else f"{rel_err(fn(), ref):.1e}"
            row(name, fn, note, check, dense)
        except (RuntimeError, ValueError, NotImplementedError, AttributeError) as err:
            why = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
            print(f"{where} {name} | unavailable: {why} | - | - | - | - | - |", flush=True)


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    print(bench.header("bench_24", device, where=__file__))
    print(f"# bf16, no bias; weights (in x out) {args.shapes}; tokens {args.tokens}; "
          f"rep {args.rep_ms} ms; anchor F.linear on the dense weight\n")  # fmt: skip
    print("| in->out | tokens | variant | class / algorithm | ms | graph ms | x dense "
          "| check | kernels per call (µs) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    timers = make_timers(device, args.rep_ms)
    gen = torch.Generator(device=device).manual_seed(0)
    for in_f, out_f in args.shapes:
        w = ((torch.rand(out_f, in_f, generator=gen, device=device) * 2 - 1) * in_f**-0.5).to(
            torch.bfloat16
        )
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f, generator=gen, device=device).to(torch.bfloat16)
            point(w, x, device, timers)


def shape(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.lower().split("x"))
    except ValueError as err:
        why = f"--shapes: {text!r} is not IN x OUT (e.g. 4096x14336)"
        raise argparse.ArgumentTypeError(why) from err
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(4096, 4096), (4096, 14336)])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16])
    parser.add_argument("--rep-ms", type=int, default=25, help="do_bench time per point (ms)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    if args.device == "cpu":
        args.shapes, args.tokens = [(64, 96)], [33]  # a dry run: seconds
    run(args)


if __name__ == "__main__":
    main()
