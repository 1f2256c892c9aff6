"""`leanlm plan CONFIG --processes N [--json FILE]`: the memory plan of a run (`leanlm.plan`)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leanlm.plan import StagePlan


def add_plan_parser(sub: Any) -> None:
    """The `plan` subcommand's arguments."""
    plan = sub.add_parser(
        "plan",
        help="plan each stage's peak memory per process at full size, from config.json alone "
        "(fake tensors: no weights, no GPU)",
    )
    plan.add_argument("config", type=Path, help="a TOML config (as for `leanlm run`)")
    plan.add_argument(
        "--processes", type=int, default=1, help="processes the run will use (default 1)"
    )
    plan.add_argument("--json", type=Path, help="also write the plan to this JSON file")
    plan.add_argument(
        "--layers",
        metavar="A,B",
        help="plan at A and B decoder layers and extrapolate linearly to the model's depth "
        "(faster; see `leanlm.plan.plan_stage`); default: the whole model",
    )
    plan.add_argument("--debug", action="store_true", help="print tracebacks of errors")


def _layers(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"`--layers` must be two layer counts A,B with 1 <= A < B, got {value!r}")
    a, b = (int(p) for p in parts)
    if not 1 <= a < b:
        raise ValueError(f"`--layers` must be two layer counts A,B with 1 <= A < B, got {value!r}")
    return a, b


def plan_command(args: argparse.Namespace) -> int:
    """Print the plan's table (and write `--json`); 2 on a bad config or argument."""
    from leanlm.config import load_toml

    try:
        if args.processes < 1:
            raise ValueError(f"`--processes` must be >= 1, got {args.processes}")
        layers = _layers(args.layers)
        config = load_toml(args.config)
        if config.init_model:
            from leanlm.run.rundir import check_init_model

            check_init_model(config.init_model, weights=False)
    except (ValueError, FileNotFoundError) as err:
        if args.debug:
            traceback.print_exception(err)
        print(f"leanlm: error: {err}", file=sys.stderr)
        return 2
    from leanlm.plan import plan

    plans = plan(config, layers=layers)
    print(table(plans))
    if args.processes > 1:
        print(
            f"(per process of {args.processes}: the model, optimizer and batch of one process, "
            "unsharded; the sharding engines (`zero`, `fsdp2`) hold less)"
        )
    if args.json is not None:
        write_json(plans, args.json, processes=args.processes)
    return 0


def write_json(plans: dict[str, StagePlan], path: Path, *, processes: int) -> None:
    """`{"processes": N, "stages": {name: {"peak_bytes_per_process": int, ...}}}`."""
    data = {"processes": processes, "stages": {k: v.as_dict() for k, v in plans.items()}}
    path.write_text(json.dumps(data, indent=2) + "\n")


def table(plans: dict[str, StagePlan]) -> str:
    """The plan as a text table in GiB: each stage's peak, where it falls, its parts there."""
    from leanlm.plan import PARTS

    heads = ["stage", "peak", "at", *PARTS, "params"]
    rows = [heads]
    for name, p in plans.items():
        gib = [f"{v / 2**30:.2f}" for v in (p.peak_bytes_per_process, *p.parts.values())]
        rows.append([name, gib[0], p.peak_phase, *gib[1:], f"{p.model_params / 1e9:.2f}B"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(["GiB per process:", *lines])
