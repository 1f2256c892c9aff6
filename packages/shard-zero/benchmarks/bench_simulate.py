"""Full-size cases of the scale simulator, and the issue's memory targets checked on them.

Command (from the repo root; on 2 otherwise idle CPU cores, no GPU: 40 s for the full
Llama-3-8B case and 205 s for the full Llama-3-70B case, several times that on busy cores;
needs optim-came for the CAME rows):

    python packages/shard-zero/benchmarks/bench_simulate.py
        [--cases 8b,8b-came,8b-accum,8b-accum-bf16,8b-accum-offload,70b,...] [--out DIR]

Every case is one `shard_zero.simulate.simulate` call: fake tensors and torch's fake process
group, so per-rank bytes are measured by `MemTracker` on rank 0 of the given world size while
nothing is computed or allocated. Prints a line of the environment (device, versions, git),
then, per case, the conditions line and the simulator's table, then the optimizer-step rows and
the targets table (each ratio between systems measured by the simulator; the ZeRO formula only
in its own column). With `--out`, each case's JSON summary and live-bytes timeline (PNG) are
written there.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leanlm_testing import bench
from shard_zero.simulate import SimConfig, SimReport, SystemResult, simulate
from shard_zero.simulate._report import GIB, conditions, plot, table, write_json

# CAME on shard-zero and on FSDP2 (optim-came runs on FSDP2's DTensor shards)
CAME = {"optimizer": "optim_came:CAME", "optimizer_kwargs": {"lr": 1e-4}, "fsdp2_optimizer": None}
SEQ = {"seq_len": 4096, "micro_batch": 1}


@dataclass(frozen=True)
class Case:
    """One simulate() call."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)


CASES = {
    c.name: c
    for c in (
        Case("8b", {"model": "llama-3-8b", "world_size": 8, "replica": True, **SEQ}),
        Case("8b-came", {"model": "llama-3-8b", "world_size": 8, **SEQ, **CAME}),
        Case(
            "8b-accum",
            {"model": "llama-3-8b", "world_size": 8, "stages": (3,), "micro_batches": 4, **SEQ},
        ),
        Case(
            "70b",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "replica": True,
                **SEQ,
            },
        ),
        Case(
            "70b-came",
            {"model": "llama-3-70b", "world_size": 64, "activation_checkpointing": True}
            | SEQ
            | CAME,
        ),
        Case(
            "70b-accum",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "stages": (3,),
                "micro_batches": 4,
                **SEQ,
            },
        ),
        Case(
            "8b-accum-bf16",
            {
                "model": "llama-3-8b",
                "world_size": 8,
                "stages": (3,),
                "micro_batches": 4,
                "accum_dtype": "bf16",
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "70b-accum-bf16",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "stages": (3,),
                "micro_batches": 4,
                "accum_dtype": "bf16",
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "8b-accum-offload",
            {
                "model": "llama-3-8b",
                "world_size": 8,
                "stages": (3,),
                "micro_batches": 4,
                "offload_accum": True,
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "70b-accum-offload",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "stages": (3,),
                "micro_batches": 4,
                "offload_accum": True,
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "8b-offload",
            {
                "model": "llama-3-8b",
                "world_size": 8,
                "offload_optimizer": True,
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "70b-offload",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "stages": (2, 3),
                "offload_optimizer": True,
                "fsdp2": False,
                **SEQ,
            },
        ),
        Case(
            "70b-z3-bucket-2e28",
            {
                "model": "llama-3-70b",
                "world_size": 64,
                "activation_checkpointing": True,
                "stages": (3,),
                "bucket_numel": 2**28,
                "fsdp2": False,
                **SEQ,
            },
        ),
    )
}


def step_rows(report: SimReport) -> list[str]:
    """Per system: live bytes when the optimizer step starts, its peak, the gathers' spread."""
    rows = [
        "| system | live at step start (GiB) | peak in step (GiB) | step peak - start (GiB) | "
        "live-bytes spread over the step's parameter all-gathers (GiB) | all-gathers in step |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.systems:
        if r.error is not None or not r.marks:
            continue
        start = dict(r.marks).get("step")
        if start is None or start >= len(r.timeline):
            continue
        live0, top = r.timeline[start], max(r.timeline[start:])
        gathers = [e[5] for e in r.events if e[4] == "step" and e[1] == "all_gather"]
        spread = f"{(max(gathers) - min(gathers)) / GIB:.3f}" if gathers else "-"
        rows.append(
            f"| {r.name} | {live0 / GIB:.2f} | {top / GIB:.2f} | {(top - live0) / GIB:.2f} | "
            f"{spread} | {len(gathers)} |"
        )
    return rows


def _ok(result: SystemResult | None) -> SystemResult | None:
    return result if result is not None and result.error is None else None


def _find(reports: dict[str, SimReport], case: str, system: str) -> SystemResult | None:
    report = reports.get(case)
    if report is None:
        return None
    try:
        return _ok(report.get(system))
    except KeyError:
        return None


def targets(reports: dict[str, SimReport], size: str) -> list[str]:
    """The issue's targets for one model size (`8b` or `70b`), measured ratio and verdict."""
    rows = ["| case | target | measured | verdict |", "|---|---|---|---|"]

    def peak(case: str, system: str) -> float | None:
        r = _find(reports, case, system)
        return None if r is None else r.peak["total"] / GIB

    def row(case: str, target: str, ratio: float | None, bound: float, detail: str) -> None:
        if ratio is None:
            rows.append(f"| {case} | {target} | not run | - |")
            return
        verdict = "pass" if ratio <= bound else "**miss**"
        rows.append(f"| {case} | {target} | {ratio:.3f} ({detail}) | {verdict} |")

    z3, fr = peak(size, "shard-zero-3"), peak(size, "fsdp2-reshard")
    ratio = None if z3 is None or fr is None else z3 / fr
    detail = f"{z3:.2f} / {fr:.2f} GiB" if ratio is not None else ""
    row("stage 3, AdamW", "≤ 1.05 x FSDP2 (reshard)", ratio, 1.05, detail)
    came3 = peak(f"{size}-came", "shard-zero-3")
    if came3 is not None and z3 is not None and fr is not None:
        best = min(z3, fr)
        row("stage 3, CAME", "below both", came3 / best, 0.999999, f"{came3:.2f} GiB vs {best:.2f}")
    else:
        row("stage 3, CAME", "below both", None, 1.0, "")
    fc = peak(f"{size}-came", "fsdp2-reshard")
    ratio = None if came3 is None or fc is None else came3 / fc
    detail = f"{came3:.2f} / {fc:.2f} GiB" if ratio is not None else ""
    row("stage 3, CAME", "≤ 1.05 x FSDP2 (reshard) with CAME", ratio, 1.05, detail)
    accumulators = {
        "accum": "stage 3, 4 micro-batches",
        "accum-bf16": "stage 3, 4 micro-batches, bf16 accumulator",
        "accum-offload": "stage 3, 4 micro-batches, accumulator offloaded to host memory",
    }
    for case, name in accumulators.items():
        four = peak(f"{size}-{case}", "shard-zero-3")
        ratio = None if four is None or z3 is None else four / z3
        detail = f"{four:.2f} / {z3:.2f} GiB" if ratio is not None else ""
        row(name, "≤ 1.05 x 1 micro-batch", ratio, 1.05, detail)
    f4, f1 = peak(f"{size}-accum", "fsdp2-reshard"), fr
    if f4 is not None and f1 is not None:
        rows.append(
            f"| FSDP2 (reshard), 4 micro-batches | (for reference) | {f4 / f1:.3f} "
            f"({f4:.2f} / {f1:.2f} GiB) | - |"
        )
    z2, fk = peak(size, "shard-zero-2"), peak(size, "fsdp2-no-reshard")
    ratio = None if z2 is None or fk is None else z2 / fk
    row("stage 2", "≤ 1.05 x FSDP2 (no reshard)", ratio, 1.05, f"{z2:.2f} / {fk:.2f} GiB")
    for stage in (1, 2):
        r = _find(reports, size, f"shard-zero-{stage}")
        if r is None:
            row(f"stage {stage} step", "no second parameter copy", None, 1.0, "")
            continue
        gathers = [e[5] for e in r.events if e[4] == "step" and e[1] == "all_gather"]
        copy = 2 * reports[size].psi  # a full bf16 copy of the parameters
        spread = (max(gathers) - min(gathers)) if gathers else 0
        row(
            f"stage {stage} optimizer step",
            "no second full parameter copy (gather spread / full bf16 copy)",
            spread / copy,
            0.05,
            f"{spread / GIB:.3f} GiB over {len(gathers)} gathers vs {copy / GIB:.2f}",
        )
    z1, rep = _find(reports, size, "shard-zero-1"), _find(reports, size, "replica")
    if z1 is not None and rep is not None:
        g1, gd = z1.maxima["grads"], rep.maxima["grads"]
        detail = f"{g1 / GIB:.2f} / {gd / GIB:.2f} GiB"
        row("stage 1", "gradient memory ≤ DDP's", g1 / gd, 1.0, detail)
    else:
        row("stage 1", "gradient memory ≤ DDP's", None, 1.0, "")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"from {', '.join(CASES)}")
    parser.add_argument("--out", default=None, help="folder for JSON summaries and PNG timelines")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    if bad := sorted(set(names) - set(CASES)):
        raise ValueError(f"`--cases` has unknown names {bad}; choose from {sorted(CASES)}")
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    dists = ["shard-zero", "transformers", "optim-came"]
    print(bench.header("bench_simulate", "cpu", dists, where=Path(__file__).parents[1]) + "\n")
    reports: dict[str, SimReport] = {}
    for name in names:
        start = time.perf_counter()
        report = simulate(SimConfig(**CASES[name].config))
        seconds = time.perf_counter() - start
        reports[name] = report
        print(f"## case {name} ({seconds:.0f} s)\n\n{conditions(report)}\n")
        print(table(report) + "\n")
        print("\n".join(step_rows(report)) + "\n", flush=True)
        if out is not None:
            write_json(report, out / f"{name}.json")
            plot(report, out / f"{name}.png")
    for size in ("8b", "70b"):
        if any(n.startswith(size) for n in names):
            print(f"## targets, {size}\n\n" + "\n".join(targets(reports, size)) + "\n")


if __name__ == "__main__":
    main()
