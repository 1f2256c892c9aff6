"""`leanlm` command line: `leanlm demo`, `leanlm run CONFIG.toml`."""

from __future__ import annotations

import argparse
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
    run = sub.add_parser("run", help="run what a TOML config describes")
    run.add_argument("config", type=Path, help="a TOML file (see packages/leanlm/configs/)")
    run.add_argument("--out", type=Path, help="run directory (default: runs/<config file stem>)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `leanlm` script and `python -m leanlm`."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            config = PRESETS[args.preset]()
            out = args.out or Path("runs") / f"demo-{args.preset}"
        else:
            config = load_toml(args.config)
            out = args.out or Path("runs") / args.config.stem
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"leanlm: error: {err}", file=sys.stderr)
        return 2
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
