#!/usr/bin/env python
"""Peak memory and time of the distillation losses, forward + backward, per implementation.

Commands (from the repository root):
    # CPU (what RESULTS.md reports): 2048 tokens x 32000 vocab, fp32 then bf16, forward KL
    python packages/prune-distill/benchmarks/bench_kl.py --dtype float32 bfloat16
    # CPU, reverse KL and JSD (beta 0.5)
    python packages/prune-distill/benchmarks/bench_kl.py --loss reverse_kl jsd --chunks 1024
    # GPU (pending: no GPU was lent when this was written)
    python packages/prune-distill/benchmarks/bench_kl.py --device cuda --tokens 8192 \
        --vocab 128256 --dtype bfloat16 --chunks 1024 4096 --loss forward_kl reverse_kl jsd

Losses (``--loss``, each with its own ``plain`` anchor): ``forward_kl``, ``reverse_kl`` and ``jsd``
(with ``--beta``), through `prune_distill.divergence`. Implementations, all on the same student
(requires grad) and teacher logits (tokens, vocab):

* ``plain``: ``chunk_size=None``, plain autograd (the reference, and the anchor);
* ``chunked``: ``backend="torch", chunk_size=c`` for each ``--chunks`` value;
* ``triton``: ``backend="triton"``, the fused kernel (CUDA only here: on CPU it needs the Triton
  interpreter, which is a correctness tool, not a benchmark);
* ``liger_kldiv`` / ``liger_jsd``: Liger-Kernel's ``LigerKLDIVLoss(log_target=True)`` (forward KL
  only: its backward gives no gradient to the target, which the reverse KL would need) and
  ``LigerJSD(beta)`` with ``beta`` = 0 (forward KL), 1 (reverse KL) or ``--beta`` (JSD; Liger's
  convention is ours: ``beta`` weights the teacher), if ``liger_kernel`` is importable (CUDA only;
  otherwise the row says "not installed"). Both take log-probabilities, so the log-softmax of
  both inputs (fp32, autograd for the student) is part of that measurement, as it would be in a
  training step.

Every configuration runs in a fresh subprocess (no allocator or high-water-mark carry-over):
inputs are built, one warm-up step runs, the timed steps run, then the peak is measured over each
of 3 more steps (median reported, with the max - min spread), each ending with the gradient in
``student.grad`` (part of every training step's footprint, so it is included; its size is printed
separately):

* CPU: resident set size. The child resets the kernel's high-water mark (``echo 5 >
  /proc/self/clear_refs``) before each measured step, reads ``VmRSS`` (baseline), runs the step
  and reads ``VmHWM``: peak extra = VmHWM - baseline. PyTorch's CPU allocator does not cache, and
  before these steps the child sets glibc's ``M_MMAP_THRESHOLD`` to 128 KiB (``mallopt``; fixing
  it turns the dynamic threshold off) and trims the heap, so every block >= 128 KiB is mapped on
  its own and unmapped on free: RSS follows live tensors (to within page granularity). Timing
  runs first, with glibc's defaults.
* CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` around the step, after
  ``reset_peak_memory_stats``.

Time: median of ``--repeats`` steps after the warm-up (CUDA: synchronised). Ratios are to
``plain`` measured in the same run. On an A100 or H100 the ``triton`` row also gets the time the
fused kernel's traffic implies at the datasheet HBM bandwidth (A100 SXM 2.0 TB/s, H100 SXM
3.35 TB/s): the KL kernels read both logit rows twice (the statistics sweep, then the gradient
sweep) and write the gradient once, ``tokens · vocab · (2·(s + t) + s)`` bytes for element sizes
s, t; the JSD kernel reads them three times (``3·(s + t) + s``); the exps (4 to 8 per element) are
far below the SFU rate, so the kernels are memory bound. The measured step
also contains what runs around the kernel (the loss reduction, autograd's handling of the
precomputed gradient), so measured / predicted > 1 is expected. Loss values are printed so every
row can be checked to compute the same number. All rows use no padding mask (every token counts)
so Liger's ``batchmean`` is the same reduction.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MEMORY_REPEATS = 3  # measured steps per configuration (the median peak is reported)


@dataclass(frozen=True)
class Case:
    """One configuration to measure (runs in its own process)."""

    impl: str
    loss: str
    beta: float
    chunk_size: int | None
    dtype: str
    tokens: int
    vocab: int
    temperature: float
    device: str
    repeats: int
    threads: int | None


@dataclass
class Result:
    """What one child measured."""

    case: Case
    peak_extra_mib: float | None = None
    peak_spread_mib: float | None = None
    median_ms: float | None = None
    grad_mib: float | None = None
    loss: float | None = None
    note: str = ""


def _step_fn(case: Case, s: Any, t: Any) -> Any:
    """A closure computing the loss for `case` (the caller runs backward)."""
    import torch.nn.functional as F

    from prune_distill import divergence

    temp = case.temperature
    kw = {"loss": case.loss, "beta": case.beta, "temperature": temp}
    if case.impl == "plain":
        return lambda: divergence(s, t, **kw, chunk_size=None, backend="torch")
    if case.impl == "chunked":
        return lambda: divergence(s, t, **kw, chunk_size=case.chunk_size, backend="torch")
    if case.impl == "triton":
        return lambda: divergence(s, t, **kw, backend="triton")
    if case.impl in ("liger_kldiv", "liger_jsd"):
        if case.impl == "liger_kldiv":
            from liger_kernel.transformers import LigerKLDIVLoss

            loss_fn: Any = LigerKLDIVLoss(reduction="batchmean", log_target=True)
        else:
            from liger_kernel.transformers import LigerJSD

            # Liger: beta = 0 is KL(teacher || student), 1 is KL(student || teacher)
            beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(case.loss, case.beta)
            loss_fn = LigerJSD(beta=beta)

        def liger() -> Any:
            logp_s = F.log_softmax(s.float() / temp, dim=-1)
            logp_t = F.log_softmax(t.float() / temp, dim=-1)
            return loss_fn(logp_s, logp_t) * temp * temp

        return liger
    raise ValueError(f"unknown impl {case.impl!r}")


def _run_child(case: Case) -> Result:
    import gc

    import torch

    from leanlm_testing import bench

    result = Result(case)
    if case.threads:
        torch.set_num_threads(case.threads)
    dev = torch.device(case.device)
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (case.tokens, case.vocab)
    s = (torch.randn(shape, generator=gen, device=dev) * 3).to(dtype).requires_grad_()
    t = (torch.randn(shape, generator=gen, device=dev) * 3).to(dtype)
    result.grad_mib = s.numel() * s.element_size() / 2**20
    try:
        fn = _step_fn(case, s, t)
    except ImportError:
        result.note = "not installed"
        return result
    cuda = dev.type == "cuda"

    def step() -> float:
        s.grad = None
        loss = fn()
        loss.backward()
        return float(loss.detach())

    # one warm-up (compilation, thread pools, cuBLAS / allocator set-up), then timed steps
    sync = bench.synchronizer(dev)
    result.median_ms = bench.median_seconds(step, case.repeats, sync=sync) * 1e3

    if not cuda:
        # Timing ran with glibc's defaults. For the memory steps, a fixed mmap threshold (which
        # turns the dynamic one off) maps every block >= 128 KiB on its own and unmaps it on
        # free, so RSS follows live tensors instead of keeping freed heap pages around.
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    peaks = []
    for _ in range(MEMORY_REPEATS):
        s.grad = None
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            libc.malloc_trim(0)
            base = int(bench.reset_peak_rss() * 2**20)  # VmHWM := VmRSS
        result.loss = step()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = int(bench.peak_rss_mib() * 2**20)
        peaks.append((peak - base) / 2**20)
    result.peak_extra_mib = statistics.median(peaks)
    result.peak_spread_mib = max(peaks) - min(peaks)
    return result


def _spawn(case: Case) -> Result:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # real kernels only
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Result(case, note=f"failed (rc {proc.returncode}): {tail[0][:120]}")
    data = json.loads(lines[-1])
    data["case"] = case
    return Result(**data)


def _environment(device: str) -> dict[str, str]:
    from leanlm_testing import bench

    return bench.environment(device, ["liger-kernel"], where=__file__)


def _cases(args: argparse.Namespace, device: str) -> list[Case]:
    def impls(loss: str) -> list[tuple[str, int | None]]:
        out: list[tuple[str, int | None]] = [("plain", None)]
        out += [("chunked", c) for c in args.chunks]
        if device == "cuda":
            out += [("triton", None), ("liger_jsd", None)]
            if loss == "forward_kl":
                out.append(("liger_kldiv", None))
        return out

    return [
        Case(
            impl=impl,
            loss=loss,
            beta=args.beta,
            chunk_size=chunk,
            dtype=dtype,
            tokens=args.tokens,
            vocab=args.vocab,
            temperature=args.temperature,
            device=device,
            repeats=args.repeats,
            threads=args.threads if device == "cpu" else None,
        )
        for loss in args.loss
        for dtype in args.dtype
        for impl, chunk in impls(loss)
    ]


BANDWIDTH = {"A100": 2.0e12, "H100": 3.35e12}  # datasheet HBM bytes/s (SXM parts)


def predicted_ms(case: Case, device_name: str) -> float | None:
    """Bandwidth-bound time of the fused Triton kernel on an A100/H100 (see the docstring)."""
    bw = next((v for k, v in BANDWIDTH.items() if k in device_name), None)
    if case.impl != "triton" or bw is None:
        return None
    elt = 4 if case.dtype == "float32" else 2
    reads = 3 if case.loss == "jsd" else 2  # sweeps over both logit rows, then one write
    return 1e3 * case.tokens * case.vocab * (2 * reads + 1) * elt / bw


def _table(results: list[Result], device_name: str = "") -> str:
    rows = [
        "| loss | impl | chunk | dtype | peak extra (MiB) | spread | x plain | of which grad (MiB) "
        "| median ms | x plain | loss value | predicted kernel ms | measured / predicted |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    anchors = {(r.case.loss, r.case.dtype): r for r in results if r.case.impl == "plain"}
    for r in results:
        c, a = r.case, anchors.get((r.case.loss, r.case.dtype))
        name = f"jsd (beta {c.beta:g})" if c.loss == "jsd" else c.loss
        if r.peak_extra_mib is None or r.median_ms is None:
            rows.append(f"| {name} | {c.impl} | | {c.dtype} | {r.note} | | | | | | | | |")
            continue
        mem_ratio = time_ratio = ""
        if a is not None and a.peak_extra_mib and a.median_ms:
            mem_ratio = f"{r.peak_extra_mib / a.peak_extra_mib:.2f}"
            time_ratio = f"{r.median_ms / a.median_ms:.2f}"
        pred = predicted_ms(c, device_name)
        roof = "- | -" if pred is None else f"{pred:.2f} | {r.median_ms / pred:.2f}"
        rows.append(
            f"| {name} | {c.impl} | {c.chunk_size or ''} | {c.dtype} | {r.peak_extra_mib:.0f} | "
            f"{r.peak_spread_mib or 0:.0f} | "
            f"{mem_ratio} | {r.grad_mib:.0f} | {r.median_ms:.0f} | {time_ratio} | "
            f"{r.loss:.6f} | {roof} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--loss", nargs="+", default=["forward_kl"], choices=["forward_kl", "reverse_kl", "jsd"]
    )
    parser.add_argument("--beta", type=float, default=0.5, help="JSD's teacher weight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU intra-op threads (default 1: on a shared, oversubscribed CPU more threads mostly "
        "measure OpenMP barrier stalls, and the memory does not depend on it)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _run_child(Case(**json.loads(args.child)))
        print(json.dumps({k: v for k, v in asdict(result).items() if k != "case"}))
        return

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    env = _environment(device)
    for key, value in env.items():
        print(f"{key}: {value}")
    print(f"shape: {args.tokens} tokens x {args.vocab} vocab, T = {args.temperature}")
    if device == "cpu":
        print(f"CPU threads per run: {args.threads}")
    if device == "cpu":
        print("triton, liger: GPU only, not run on CPU")
    results = []
    for case in _cases(args, device):
        results.append(_spawn(case))
        r = results[-1]
        print(
            f"  {case.loss:<10} {case.impl:<12} chunk={case.chunk_size} {case.dtype:<9} "
            f"peak+={r.peak_extra_mib} MiB median={r.median_ms} ms loss={r.loss} {r.note}",
            flush=True,
        )
    print()
    print(_table(results, env["device"]))
    if args.json:
        payload = {"environment": env, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
