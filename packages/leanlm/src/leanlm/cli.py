"""`leanlm` command line: `leanlm demo`, `leanlm run CONFIG.toml`."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from leanlm.config import STAGE_NAMES, ConfigError, RunConfig, load_toml, override
from leanlm.presets import PRESETS
from leanlm.run.interrupt import LAUNCHER_ENV, Interrupted
from leanlm.run.lock import RunLock, RunLockedError
from leanlm.run.rundir import (
    DISK_ERRNOS,
    check_out_dir,
    disk_full,
    preflight,
)
from leanlm.stages import STAGES


def _parser() -> argparse.ArgumentParser:
    stages = ", ".join(
        f"{name}: {STAGES[name].summary}" if STAGES[name].summary else name for name in STAGE_NAMES
    )
    parser = argparse.ArgumentParser(
        prog="leanlm",
        description="Train and compress small LLMs with less memory: run a pipeline of stages "
        f"({stages}) and get a report.",
        epilog="Several processes: `torchrun --nproc_per_node 2 -m leanlm run CONFIG.toml` or "
        "`accelerate launch --multi_gpu --num_processes 2 -m leanlm run CONFIG.toml`.",
    )
    parser.add_argument("--version", action="version", version=f"leanlm {version('leanlm')}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--resume", action="store_true", help="continue the run in --out")
    common.add_argument(
        "--restart-changed",
        action="store_true",
        help="with --resume: rerun the stages whose results or checkpoints a config change "
        "invalidates (and every stage after them); without it such a resume stops and lists the "
        "changed keys",
    )
    common.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    common.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set pretrain.lr=3e-4 (repeatable; VALUE is read as "
        "in the TOML file: strings in quotes); recorded in the run's config.toml and report",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", parents=[common], help="run the main job on the built-in corpus (no download)"
    )
    demo.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="size of the run (smoke: CI-sized; default: the README demo)",
    )
    demo.add_argument("--out", type=Path, help="run directory (default: runs/demo-<preset>)")
    demo.add_argument(
        "--processes",
        default="auto",
        help="processes to start (torchrun); auto = the GPUs, else 2 on a machine with >= 2 "
        "CPU cores, else 1",
    )
    run = sub.add_parser("run", parents=[common], help="run what a TOML config describes")
    run.add_argument("config", type=Path, help="a TOML file (see packages/leanlm/configs/)")
    run.add_argument("--out", type=Path, help="run directory (default: runs/<config file stem>)")
    run.add_argument(
        "--processes",
        default="1",
        help="processes to start (torchrun; auto as for demo); or launch with torchrun yourself",
    )
    from leanlm.plan_command import add_plan_parser

    add_plan_parser(sub)
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


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_user_error(err: BaseException) -> bool:
    """Errors every process hits alike (printed by rank 0 only, without a traceback)."""
    if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
        return True
    trainer = sys.modules.get("leanlm.train.trainer")
    if trainer is not None and isinstance(err, trainer.TrainingDivergedError):
        return True
    return isinstance(err, ValueError | FileExistsError | RunLockedError)


def _is_lost_peer(err: BaseException) -> bool:
    """A collective failed because another process ended (that one reports why)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(err, dist.DistError):
        return True
    return "gloo" in str(err).lower() or "connection closed by peer" in str(err).lower()


def _is_collective_timeout(err: BaseException) -> bool:
    """A collective gave up waiting for another process (gloo raises a RuntimeError)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    timed_out = re.search(r"timed out|timing out|timeout", str(err), re.IGNORECASE)
    return isinstance(err, RuntimeError) and timed_out is not None


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
        return f"cannot write {err.filename or ''}: {err.strerror}".replace(" :", ":")
    return str(err)


def report_failure(
    err: BaseException,
    *,
    debug: bool,
    out: Path | None = None,
    collective_timeout_s: float | None = None,
) -> int:
    """Print one clear line for `err` (this process's share of it); returns the exit code.

    An error while the disk of `out` is full (torch and safetensors report a failed write in
    their own words) is reported as the full disk. A collective that timed out (after
    `collective_timeout_s`) names the process that stopped answering, where it can be known
    (`leanlm.run.status`). A collective that failed because another process ended is reported by
    `leanlm`'s launcher (which knows how that process ended), else by the main process.
    """
    from leanlm.run import interrupt, status

    if isinstance(err, Interrupted | KeyboardInterrupt) or interrupt.requested():
        stop = err if isinstance(err, Interrupted) else interrupt.stopped()
        if debug:
            traceback.print_exception(err)
        if stop.quiet:  # torchrun's agent stopping us after another process failed
            return 1
        if _rank() == 0:
            print(f"leanlm: {stop}", file=sys.stderr, flush=True)
        return 0 if LAUNCHER_ENV in os.environ else interrupt.exit_code()
    user = _is_user_error(err)
    if not user and out is not None and disk_full(out):
        if debug:
            traceback.print_exception(err)
        err = OSError(errno.ENOSPC, "no space left on its disk", str(out))
        user = True
    if not user and collective_timeout_s is not None and _is_collective_timeout(err):
        if debug:
            traceback.print_exception(err)
        line, speak = status.timeout_message(collective_timeout_s)
        if speak:
            print(f"leanlm: error (process {_rank()}): {line}", file=sys.stderr, flush=True)
        return 1
    lost = not user and _is_lost_peer(err)
    if lost and LAUNCHER_ENV in os.environ:
        if debug:
            traceback.print_exception(err)
        return 1
    if _rank() == 0 or not (user or lost):
        if debug:
            traceback.print_exception(err)
        rank = f" (process {_rank()})" if LAUNCHED_ENV in os.environ and not user else ""
        kind = "" if user else f"{type(err).__name__}: "
        hint = "" if user or debug else " (--debug shows the traceback)"
        print(f"leanlm: error{rank}: {kind}{_message(err)}{hint}", file=sys.stderr, flush=True)
    return 2 if user else 1


def _work(config: RunConfig, out: Path, args: argparse.Namespace) -> int:
    """Run the pipeline in this process (one of several, or the only one)."""
    from leanlm.run import interrupt

    try:
        with interrupt.handling_signals():
            try:
                from leanlm.run.pipeline import run_pipeline  # heavy imports: the config is valid

                run_pipeline(
                    config,
                    out,
                    resume=args.resume,
                    restart_changed=args.restart_changed,
                    command="leanlm " + shlex.join(args.argv),
                )
            except BaseException as err:  # reported in one line, see report_failure
                if isinstance(err, SystemExit):
                    raise
                timeout = config.collective_timeout_s
                return report_failure(err, debug=args.debug, out=out, collective_timeout_s=timeout)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # before interpreter exit: gloo's threads must not outlive the interpreter
            dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `leanlm` script and `python -m leanlm`."""
    from leanlm.run.status import Heartbeat

    # a worker of leanlm's launcher says what it is doing, for the launcher's report
    heartbeat = Heartbeat.from_env() if LAUNCHED_ENV in os.environ else None
    code = 1
    try:
        code = _main(argv)
    finally:
        if heartbeat is not None:
            heartbeat.stop(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # for the report
    if args.command == "plan":
        from leanlm.plan_command import plan_command

        return plan_command(args)
    try:
        nproc = resolve_nproc(args.processes)
        if args.command == "demo":
            config = override(PRESETS[args.preset](), args.overrides)
            out = args.out or Path("runs") / f"demo-{args.preset}"
        else:
            config = load_toml(args.config, overrides=args.overrides)
            out = args.out or Path("runs") / args.config.stem
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"leanlm: error: {err}", file=sys.stderr)
        return 2
    worker = LAUNCHED_ENV in os.environ
    cores = os.cpu_count() or 1
    if nproc > cores and not worker:
        print(
            f"leanlm: warning: --processes {nproc} is more than the {cores} CPU cores; "
            "the processes will slow each other down",
            file=sys.stderr,
        )
    lock = None
    try:
        if LAUNCHER_ENV not in os.environ:  # else our launcher checked and holds the lock
            check_out_dir(out)
            if _rank() == 0:  # a live run in `out` is named before anything about its state
                lock = RunLock(out).acquire()
            processes = int(os.environ.get("WORLD_SIZE", "1")) if worker else nproc
            preflight(
                config,
                out,
                resume=args.resume,
                restart_changed=args.restart_changed,
                processes=processes,
            )
    except (ValueError, FileExistsError, RunLockedError, OSError) as err:
        if lock is not None:
            lock.release()
        return report_failure(err, debug=args.debug)
    try:
        if nproc > 1 and not worker:
            from leanlm.run.launch import relaunch

            return relaunch(nproc, argv)  # the workers print errors and where they stopped
        return _work(config, out, args)
    except KeyboardInterrupt:  # Ctrl-C before the workers' handlers are installed
        if _rank() == 0:
            print("leanlm: interrupted before the run started", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.release()
