"""What one training step dispatches, per engine: aten ops, the bytes they write, host reads.

Command (from the repo root; CPU, gloo, no GPU needed):

    python packages/shard-zero/benchmarks/bench_ops.py [--world 1] [--engines fsdp2,zero2]

The model, optimizer and precision are `bench_world1.py`'s (a small untied Llama,
`torch.optim.AdamW(lr=1e-4)`, bf16 compute, fp32 masters / reduce dtype). After 2 warm-up steps
one step runs under a `TorchDispatchMode` that counts every op (views excepted) and the bytes of
the tensors it returns, or of the arguments it writes when it returns nothing (`_foreach_copy_`,
FSDP2's `chunk_cat`): what a kernel writes, a copy, a cast, a collective's output; `empty` counts
what it allocates. Ops are split into forward, backward and optimizer step (`step()` +
`zero_grad()`); `--where` also splits them by the innermost shard_zero / FSDP source line (the
"engine's own" ops). Python-level host reads of tensor values (`tolist`, `item`) are counted too:
on a GPU a read of a device tensor is a sync (AdamW's 21 `item` are its host step counters). The
ops that are the same in both engines
(the model's own forward/backward, AdamW's math) cancel in the comparison; the differences are
each engine's own copies, casts, collectives and syncs. World > 1 spawns gloo ranks; rank 0's
counts are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_world1 import _wrap

from leanlm_testing.models import tiny_llama_config

PHASES = ("forward", "backward", "step")


class Counts(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Per (phase, op): calls and output bytes."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where = where
        self.phase = "forward"
        self.calls: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # writes nothing
            return out
        key = (self.phase, f"{func.namespace}.{func.overloadpacket.__name__}{self._site()}")
        self.calls[key] += 1
        written = out if out is not None else _written_args(func, args, kwargs or {})
        self.bytes[key] += sum(
            t.numel() * t.element_size()
            for t in tree_leaves(written)
            if isinstance(t, torch.Tensor)
        )
        return out

    def _site(self) -> str:
        """` @file:line` of the innermost shard_zero / FSDP frame (with `where`), else ''."""
        if not self.where:
            return ""
        stack = traceback.extract_stack()
        if any("torch/optim/" in f.filename for f in stack):
            return ""  # the wrapped optimizer's own math, the same in every engine
        for f in reversed(stack):
            for part in ("shard_zero/", "fsdp/"):
                if part in f.filename:
                    return f" @{f.filename.split(part)[-1]}:{f.lineno}"
        return ""


def _written_args(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an op that returns nothing writes (`_foreach_copy_`, FSDP2's `out=` ops)."""
    schema = func._schema.arguments
    given = {a.name: v for a, v in zip(schema, args, strict=False)} | kwargs
    return [
        given[a.name] for a in schema if a.alias_info and a.alias_info.is_write and a.name in given
    ]


def _count_host_reads() -> Counter[str]:
    reads: Counter[str] = Counter()
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def wrapped(self: torch.Tensor, *a: Any, _o: Any = original, _n: str = name) -> Any:
            reads[_n] += 1
            return _o(self, *a)

        setattr(torch.Tensor, name, wrapped)
    return reads


def _model(device: str) -> tuple[Any, torch.Tensor]:
    """A small untied Llama whose matrices all reach shard-zero's `min_shard_numel` (16384)."""
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    model.config.use_cache = False
    return model, torch.randint(0, cfg.vocab_size, (2, 32), device=device)


def measure(engine: str, where: bool = False) -> dict[str, Any]:
    """Counts of one step of `engine` (after 2 warm-ups) in this (initialised) process."""
    model, ids = _model("cpu")
    model, opt, ctx = _wrap(engine, model, "cpu")

    def step(mode: Counts | None) -> None:
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        if mode:
            mode.phase = "backward"
        loss.backward()
        if mode:
            mode.phase = "step"
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step(None)
    reads = _count_host_reads()
    mode = Counts(where)
    with mode:
        step(mode)
    return {"calls": mode.calls, "bytes": mode.bytes, "reads": dict(reads)}


def _worker(rank: int, world: int, init: str, job: tuple[list[str], bool, Any]) -> None:
    engines, where, q = job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for engine in engines:
            res = measure(engine, where)
            if rank == 0:
                q.put((engine, res))
    finally:
        dist.destroy_process_group()


def report(engine: str, res: dict[str, Any], top: int) -> None:
    calls, nbytes = res["calls"], res["bytes"]
    print(f"\n## {engine}: host reads {res['reads'] or 0}")
    for phase in PHASES:
        keys = [k for k in calls if k[0] == phase]
        total_c = sum(calls[k] for k in keys)
        total_b = sum(nbytes[k] for k in keys)
        own = [k for k in keys if "@" in k[1]]  # with --where: the engine's own ops
        print(
            f"{phase:9s} {total_c:6d} ops {total_b / 2**20:9.3f} MiB written; engine's own "
            f"{sum(calls[k] for k in own):5d} ops {sum(nbytes[k] for k in own) / 2**20:8.3f} MiB"
        )
        for k in sorted(keys, key=lambda k: -nbytes[k])[:top]:
            print(f"    {k[1]:32s} {calls[k]:5d} {nbytes[k] / 2**20:9.3f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--engines", default="fsdp2,zero2")
    p.add_argument("--where", action="store_true", help="split ops by engine source line")
    p.add_argument("--top", type=int, default=8, help="ops listed per phase (by bytes)")
    args = p.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        init = f"file://{tmp}/init"
        procs = [
            ctx.Process(target=_worker, args=(r, args.world, init, (engines, args.where, q)))
            for r in range(args.world)
        ]
        for proc in procs:
            proc.start()
        results = [q.get() for _ in engines]
        for proc in procs:
            proc.join()
    n = sum(p.numel() for p in _model("cpu")[0].parameters())
    print(f"# bench_ops: world {args.world} gloo, torch {torch.__version__}, {n:,} parameters")
    for engine, res in results:
        report(engine, res, args.top)


if __name__ == "__main__":
    main()
