"""`leanlm` command line: `leanlm demo`, `leanlm run CONFIG.toml`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from leanlm.config import ConfigError, load_toml
from leanlm.presets import PRESETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leanlm",
        description="Train and compress small LLMs with less memory: run a pipeline of stages "
        "(pretrain, prune, distill, sparsify) and get a report.",
        epilog="Several processes: `torchrun --nproc_per_node 2 -m leanlm run CONFIG.toml` or "
        "`accelerate launch --multi_gpu --num_processes 2 -m leanlm run CONFIG.toml`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the built-in corpus (no download)")
    demo.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="size of the run (smoke: CI-sized, < 2 min; default: the README demo)",
    )
    demo.add_argument("--out", type=Path, help="run directory (default: runs/demo-<preset>)")
    demo.add_argument("--resume", action="store_true", help="continue the run in --out")
    demo.add_argument(
        "--processes",
        default="auto",
        help="processes to start (torchrun); auto = the GPUs, else 2 on a machine with >= 2 "
        "CPU cores, else 1",
    )
    run = sub.add_parser("run", help="run what a TOML config describes")
    run.add_argument("config", type=Path, help="a TOML file (see packages/leanlm/configs/)")
    run.add_argument("--out", type=Path, help="run directory (default: runs/<config file stem>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out")
    run.add_argument(
        "--processes",
        default="1",
        help="processes to start (torchrun; auto as for demo); or launch with torchrun yourself",
    )
    return parser


LAUNCHED_ENV = "LOCAL_RANK"
"""Set by torchrun / accelerate launch in every process they start."""


def resolve_nproc(value: str) -> int:
    """`--processes`: a positive integer, or `auto` (the GPUs, else 2 with >= 2 CPU cores, else 1).

    Raises:
        ValueError: for anything else.
    """
    if value == "auto":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return 2 if (os.cpu_count() or 1) >= 2 else 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"`--processes` must be a positive integer or 'auto', got {value!r}")
    return int(value)


def relaunch(nproc: int, argv: Sequence[str]) -> int:
    """Run `leanlm ARGV` in `nproc` processes under torchrun; returns its exit code.

    The started processes see torchrun's `LOCAL_RANK` and so do not start more.

    Each process gets `cpu_count // nproc` threads (unless OMP_NUM_THREADS is set).
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "leanlm",
        *argv,
    ]
    print(f"[leanlm] starting {nproc} processes: {' '.join(cmd[2:])}", file=sys.stderr)
    return subprocess.run(cmd, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `leanlm` script and `python -m leanlm`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        nproc = resolve_nproc(args.processes)
        if args.command == "demo":
            config = PRESETS[args.preset]()
            out = args.out or Path("runs") / f"demo-{args.preset}"
        else:
            config = load_toml(args.config)
            out = args.out or Path("runs") / args.config.stem
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"leanlm: error: {err}", file=sys.stderr)
        return 2
    if nproc > 1 and LAUNCHED_ENV not in os.environ:
        return relaunch(nproc, argv)
    from leanlm.pipeline import run_pipeline  # heavy imports only once the config is valid
    from leanlm.trainer import TrainingDivergedError

    try:
        run_pipeline(config, out, resume=args.resume)
    except (FileExistsError, ValueError, TrainingDivergedError) as err:
        print(f"leanlm: error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # before interpreter exit: gloo's threads must not outlive the interpreter
            dist.destroy_process_group()
    return 0
