#!/usr/bin/env python
"""Toy-scale Minitron architecture search: rank depth/width mixes at one parameter budget.

Command (from the repository root):
    nice -n 19 python packages/prune-distill/benchmarks/bench_search.py [--steps 40]
        [--teacher-steps 400] [--teacher-lr 3e-3] [--batch 16] [--seed 0]
        [--distill-seeds 4 5]

Data: the bytes of the CPython standard library's `.py` files (the corpus leanlm embeds;
`test/`, `idlelib`, `lib2to3` and `site-packages` left out, in path order up to 4 MB),
read directly here (byte-level, vocabulary 256, chance = ln 256 = 5.545 nats). Every tenth file
is held out for validation. A Llama teacher (hidden 128, 4 layers, 4 query / 2 KV heads of 32,
MLP 384, tied embeddings; 820,352 parameters) is trained with AdamW (`--teacher-lr`, 5% warmup,
cosine to 10%) on random 64-byte windows of the training files; the script stops if its
validation loss is not below 60% of chance (a teacher at chance makes the search meaningless).
Then `prune_distill.search` enumerates the shapes of the search space within ±10% of 60% of the
teacher's parameters, prunes each from one `collect_importance` pass, distills each for
`--steps` steps (forward KL, AdamW lr 1e-3, batches of `--batch` x 64 bytes, the same batches
for every candidate) and ranks them by validation LM loss on 16 x 16 held-out windows. The
search runs once per `--distill-seeds` entry (other distillation windows, same teacher, scores
and validation set), to show how stable the ranking is.
Printed: the environment header, the teacher's validation loss, one ranked table (Markdown) per
seed, each shape's rank per seed, and the wall and CPU time.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leanlm_testing.bench import header
from prune_distill import DistillConfig, SearchSpace, collect_importance, search, validation_loss
from prune_distill.search import count_params

VOCAB, SEQ = 256, 64
EXCLUDED = {"test", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


def stdlib_bytes(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte streams of the stdlib's `.py` files; every 10th file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not EXCLUDED.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    train, val, total = bytearray(), bytearray(), 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        (val if i % 10 == 9 else train).extend(data + b"\n")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val)


def windows(stream: torch.Tensor, n: int, batch: int, seed: int) -> list[dict]:
    """`n` batches of `batch` random `SEQ`-byte windows of `stream` (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - SEQ, (n, batch), generator=gen)
    offsets = torch.arange(SEQ)
    return [{"input_ids": stream[s[:, None] + offsets]} for s in starts]


def train_teacher(
    model: LlamaForCausalLM, batches: list[dict], lr: float, warmup_frac: float = 0.05
) -> None:
    """AdamW, linear warmup then cosine decay to 10% of `lr`, gradient clipping at 1."""
    steps = len(batches)
    warmup = max(1, int(warmup_frac * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    for batch in batches:
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="distillation steps per candidate")
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--teacher-lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch")
    parser.add_argument("--seed", type=int, default=0, help="teacher init and data")
    parser.add_argument(
        "--distill-seeds",
        type=int,
        nargs="+",
        default=[4, 5],
        help="one search per seed (which windows the candidates distill on): rank stability",
    )
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    print(header("bench_search", "cpu", ["prune-distill", "transformers"], where=__file__))
    print(f"arguments: {vars(args)}", flush=True)
    start = time.perf_counter()
    train_stream, val_stream = stdlib_bytes(args.max_bytes)
    print(
        f"corpus: {train_stream.numel():,} training bytes, {val_stream.numel():,} validation "
        "bytes (CPython stdlib .py files)",
        flush=True,
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    teacher = LlamaForCausalLM(config)
    val = windows(val_stream, 16, 16, args.seed + 2)
    chance = math.log(VOCAB)
    print(f"untrained teacher: validation loss {validation_loss(teacher, val):.4f}", flush=True)
    train_teacher(
        teacher,
        windows(train_stream, args.teacher_steps, args.batch, args.seed + 1),
        args.teacher_lr,
    )
    teacher_loss = validation_loss(teacher, val)
    total = count_params(teacher)
    trained = time.perf_counter()
    print(
        f"teacher: {total:,} params, {args.teacher_steps} steps, validation loss "
        f"{teacher_loss:.4f} (chance ln {VOCAB} = {chance:.4f}); {trained - start:.0f} s",
        flush=True,
    )
    if teacher_loss > 0.6 * chance:
        raise SystemExit(
            f"the teacher's validation loss ({teacher_loss:.3f}) is not below 60% of chance "
            f"({0.6 * chance:.3f}): train it longer (--teacher-steps) or at another --teacher-lr"
        )

    scores = collect_importance(teacher, windows(train_stream, 8, 16, args.seed + 3))
    space = SearchSpace(
        num_hidden_layers=(2, 3, 4),
        hidden_size=(64, 96, 128),
        intermediate_size=(128, 192, 256, 384),
        num_attention_heads=(2, 4),
    )
    budget = int(0.6 * total)
    print(f"search space {space}", flush=True)
    ranks: dict[str, list[str]] = {}
    for seed in args.distill_seeds:
        t0 = time.perf_counter()
        result = search(
            teacher,
            scores,
            space,
            params=budget,
            tolerance=0.1,
            train_batches=windows(train_stream, args.steps, args.batch, seed),
            val_batches=val,
            distill_config=DistillConfig(lr=1e-3),
        )
        print(
            f"distill seed {seed}: budget {budget:,} params ±10%, {len(result.ranking)} "
            f"candidates, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        print(result.table(), flush=True)
        for rank, c in enumerate(result.ranking, 1):
            t = c.target
            shape = (
                f"{t.num_hidden_layers} layers, hidden {t.hidden_size}, MLP "
                f"{t.intermediate_size}, {t.num_attention_heads} heads"
            )
            ranks.setdefault(shape, []).append(f"{rank} ({c.loss_distilled:.4f})")
    print("rank (distilled val loss) per distill seed " + str(args.distill_seeds) + ":")
    for shape, r in ranks.items():
        print(f"  {shape}: {', '.join(r)}")
    print(
        f"wall time {time.perf_counter() - start:.0f} s, CPU time of this process "
        f"{time.process_time():.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
