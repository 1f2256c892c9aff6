"""`python -m shard_zero.simulate`: simulate one training step per system and print the table.

Example (Llama-3-8B on 8 GPUs, ZeRO stages 1-3 against FSDP2, bf16 compute, AdamW):

    python -m shard_zero.simulate --model llama-3-8b --world-size 8 --plot timeline.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from shard_zero.simulate._presets import PRESETS
from shard_zero.simulate._report import conditions, plot, table, write_json
from shard_zero.simulate._run import SimConfig, simulate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shard_zero.simulate",
        description="Simulate one training step of a full-size model on fake tensors: per-rank "
        "peak bytes by category, collectives per step, shard-zero stages against FSDP2.",
    )
    p.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a config.json path",
    )
    p.add_argument("--layers", type=int, default=None, help="keep this many decoder layers")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="'adamw' or an installed optimizer as module:Class (e.g. optim_came:CAME, "
        "optim_adafactor:Adafactor)",
    )
    p.add_argument(
        "--optimizer-kwargs",
        default=None,
        help='JSON keyword arguments of a module:Class optimizer (default {"lr": 1e-4})',
    )
    p.add_argument(
        "--fsdp2-optimizer",
        default="adamw",
        help="optimizer of the FSDP2 rows ('same' for --optimizer; optim-came's CAME and "
        "optim-adafactor's Adafactor run on FSDP2's DTensor shards)",
    )
    p.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    p.add_argument(
        "--accum-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="shard-zero's sharded gradient accumulator at stages 2-3 (ZeroConfig.accum_dtype)",
    )
    p.add_argument(
        "--offload-accum",
        action="store_true",
        help="shard-zero stages 2-3 keep the accumulator in host memory between micro-batches "
        "(ZeroConfig.offload_accum)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="shard-zero keeps the fp32 masters, their gradients and the optimizer state in "
        "host memory and steps there (ZeroConfig.offload_optimizer)",
    )
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="shard-zero's ZeroConfig.bucket_numel (default 2**24): elements per gradient "
        "reduce-scatter",
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 rows")
    p.add_argument("--replica", action="store_true", help="add a plain replica (DDP's grads)")
    p.add_argument("--plot", default=None, help="write the live-bytes timeline to this PNG")
    p.add_argument("--json", default=None, help="write a JSON summary to this path")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, simulate, print the table (and write the plot / JSON if asked)."""
    args = _parser().parse_args(argv)
    try:
        kwargs = None
        if args.optimizer_kwargs is not None:
            try:
                kwargs = json.loads(args.optimizer_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"`--optimizer-kwargs` is not JSON: {exc}") from exc
            if not isinstance(kwargs, dict):
                raise ValueError(
                    f"`--optimizer-kwargs` ({args.optimizer_kwargs!r}) must be a JSON object"
                )
        config = SimConfig(
            model=args.model,
            num_layers=args.layers,
            world_size=args.world_size,
            stages=tuple(args.stages),
            optimizer=args.optimizer,
            optimizer_kwargs=kwargs,
            fsdp2_optimizer=None if args.fsdp2_optimizer == "same" else args.fsdp2_optimizer,
            param_dtype=args.param_dtype,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            micro_batches=args.micro_batches,
            accum_dtype=args.accum_dtype,
            offload_accum=args.offload_accum,
            offload_optimizer=args.offload_optimizer,
            bucket_numel=args.bucket_numel,
            activation_checkpointing=args.activation_checkpointing,
            fsdp2=not args.no_fsdp2,
            replica=args.replica,
        )
        report = simulate(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(conditions(report))
    print()
    print(table(report))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
