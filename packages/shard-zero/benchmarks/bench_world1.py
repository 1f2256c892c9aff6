"""One device, world 1: each engine's own step time and peak memory, and what is live at the peak.

Command (from the repo root; on a GPU the 1.1B TinyLlama shape, on CPU a tiny one):

    python packages/shard-zero/benchmarks/bench_world1.py [--engines plain,fsdp2,zero2,zero3]
        [--steps 8] [--warmup 3] [--rounds 1] [--snapshot zero3,fsdp2] [--profile zero3]

At world 1 nothing is sharded, so the numbers are each engine's own copies, hooks and streams:
a plain fp32 model under bf16 autocast, FSDP2 (`fully_shard` per decoder layer + root,
`MixedPrecisionPolicy(bf16, fp32)`) and shard-zero stages (param_dtype bf16, fp32 masters), all
with `torch.optim.AdamW(lr=1e-4)` on batch 4 x 1024 (`fused=True` on the host for
`zero2-offload`). Each engine runs in a fresh process (`--engine NAME` is that child), so
nothing one leaves behind counts against the next; `--rounds` repeats the list, interleaved,
and the table gives medians.

Measured per engine: device memory allocated before the model is built, after it, and the peak
(`torch.cuda.max_memory_allocated` / `max_memory_reserved`), the median step time after the
warm-ups. `--snapshot` engines additionally record the caching allocator's history
(`torch.cuda.memory._record_memory_history`) from before the model is built, replay its trace to the
peak, and print what was live there, grouped by the first frame in shard_zero / torch.distributed
/ this script, with the bytes whose free was requested but not completed (a block held for another
stream by `record_stream`) shown apart. `--profile` engines run one more step under torch.profiler
(after the timed ones, in the last round) and print its kernel launches, the device time of its
kernels (the step time less that is host work or idle device) and the ten longest kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

ENGINES = ("plain", "fsdp2", "zero2", "zero3", "zero2-offload")
GiB = 2**30


def _model(device: str):
    from transformers import LlamaForCausalLM

    from leanlm_testing.models import tiny_llama_config, tinyllama_1b_config

    if device == "cuda":
        cfg, shape = tinyllama_1b_config(), (4, 1024)
    else:  # untied, LlamaConfig's 2048 positions: as the 1.1B shape
        cfg = tiny_llama_config(
            vocab_size=512, intermediate_size=128, max_position_embeddings=2048,
            tie_word_embeddings=False,
        )  # fmt: skip
        shape = (2, 32)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    ids = torch.randint(0, cfg.vocab_size, shape, device=device)
    return model, ids


def _wrap(name: str, model, device: str):
    """(model, optimizer, autocast context factory) for engine `name`."""

    def make_opt(params):
        # offload: the host masters step with torch's fused CPU AdamW (the README's advice; the
        # 2026-11-27 row, 1713.6 ms, ran its default for-loop); on the device torch's default
        return torch.optim.AdamW(params, lr=1e-4, fused=name.endswith("offload") or None)

    if name == "plain":
        return model, make_opt(model.parameters()), lambda: torch.autocast(device, torch.bfloat16)
    off = lambda: torch.autocast(device, enabled=False)  # noqa: E731
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, make_opt(model.parameters()), off
    from shard_zero import ZeroConfig, prepare

    stage = int(name[4])
    cfg = ZeroConfig(
        stage=stage, param_dtype=torch.bfloat16, offload_optimizer=name.endswith("offload")
    )
    model, opt = prepare(model, make_opt, cfg)
    return model, opt, off


def _key(frames: list[dict]) -> str:
    """The frame that says whose allocation this is."""
    for want in ("shard_zero", "torch/distributed", "bench_world1", "optim"):
        for f in frames:
            if want in f["filename"]:
                return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    return (
        f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}"
        if frames
        else "?"
    )


def analyse_peak(snapshot: dict, top: int = 18) -> dict:
    """Replay the allocator trace to its peak; group what is live there by `_key`."""
    trace = [e for dev in snapshot["device_traces"] for e in dev]
    live: dict[int, dict] = {}
    total = peak = peak_i = 0
    for i, e in enumerate(trace):  # pass 1: where the allocated total peaks
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, peak_i = total, i
    live, pending = {}, set()
    for e in trace[: peak_i + 1]:  # pass 2: the live set at that event
        if e["action"] == "alloc":
            live[e["addr"]] = e
            pending.discard(e["addr"])
        elif e["action"] == "free_requested":
            pending.add(e["addr"])
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            pending.discard(e["addr"])
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_stream: dict[int, int] = defaultdict(int)
    for addr, e in live.items():
        g = groups[("PENDING FREE " if addr in pending else "") + _key(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
        by_stream[e["stream"]] += e["size"]
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "replayed_peak_gib": peak / GiB,
        "events": len(trace),
        "pending_free_gib": sum(live[a]["size"] for a in pending if a in live) / GiB,
        "by_stream_gib": {str(k): v / GiB for k, v in by_stream.items()},
        "top": [(k, v[0] / GiB, v[1]) for k, v in rows],
    }


def child(args: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    mem = (lambda: torch.cuda.memory_allocated() / GiB) if cuda else (lambda: float("nan"))
    record = cuda and args.snapshot
    if record:
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    before = mem()
    model, ids = _model(device)
    built = mem()
    model, opt, ctx = _wrap(args.engine, model, device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []

    def train_step() -> torch.Tensor:
        """One forward, backward and optimizer step, then `sync`; returns the loss."""
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return loss

    for _ in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss = train_step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {
        "engine": args.engine,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "before_gib": before,
        "built_gib": built,
        "after_gib": mem(),
        "peak_gib": torch.cuda.max_memory_allocated() / GiB if cuda else float("nan"),
        "reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else float("nan"),
        "step_ms": statistics.median(times[args.warmup :]) * 1e3,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    if record:
        out["snapshot"] = analyse_peak(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.profile:  # after the timed steps: one more step, profiled
        from leanlm_testing.bench import kernel_times

        rows = kernel_times(train_step, device, warmup=0)
        out["profile"] = {
            "launches": sum(n for _, n, _ in rows),
            "kernel_ms": sum(us for *_, us in rows) / 1e3,
            "top": [(name[:70], n, us / 1e3) for name, n, us in rows[:10]],
        }
    dist.destroy_process_group()
    return out


def _run_child(args: argparse.Namespace, name: str, snap: bool, profile: bool) -> dict | None:
    """Run engine `name` in a fresh process; its RESULT line, or None (the failure is printed)."""
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        name,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--snapshot",
        "1" if snap else "",
        "--profile",
        "1" if profile else "",
    ]
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        print(f"{name}: timed out after {args.timeout} s", flush=True)
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"{name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(lines[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=ENGINES, help="(internal) run this engine in this process")
    p.add_argument("--engines", default="plain,fsdp2,zero2,zero3")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--snapshot", default="", help="engines whose allocator history is replayed")
    p.add_argument("--profile", default="", help="engines whose kernels are profiled")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per engine process")
    args = p.parse_args()
    if args.engine:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}",
        flush=True,
    )
    names = [n for n in args.engines.split(",") if n]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise SystemExit(f"--engines: unknown {bad}; choose from {ENGINES}")
    results: dict[str, list[dict]] = defaultdict(list)
    runs = [(r, n, False) for r in range(args.rounds) for n in names]
    runs += [(-1, n, True) for n in args.snapshot.split(",") if n]  # recorded: not in the table
    for r, name, snap in runs:
        last = r == args.rounds - 1  # the profiled step follows the timed ones: last round only
        profile = name in args.profile.split(",") and last and not snap
        res = _run_child(args, name, snap, profile=profile)
        if res is None:
            continue
        if not snap:
            results[name].append(res)
        tag = "recorded" if snap else f"round {r}"
        print(
            f"[{tag}] {name:14s} step {res['step_ms']:8.1f} ms  peak {res['peak_gib']:6.2f} GiB"
            f"  reserved {res['reserved_gib']:6.2f}  before {res['before_gib']:.2f} built "
            f"{res['built_gib']:.2f} after {res['after_gib']:.2f}  loss {res['loss_first']:.4f}"
            f" -> {res['loss_last']:.4f}",
            flush=True,
        )
        if "snapshot" in res:
            s = res["snapshot"]
            print(
                f"  replayed peak {s['replayed_peak_gib']:.2f} GiB over {s['events']} events; "
                f"pending frees {s['pending_free_gib']:.2f} GiB; by stream {s['by_stream_gib']}"
            )
            for key, gib, n in s["top"]:
                print(f"    {gib:7.3f} GiB {n:5d} blocks  {key}")
        if "profile" in res:
            prof = res["profile"]
            what = "CPU operators' own time" if res["device"] == "cpu" else "GPU device time"
            print(
                f"  profiled step: {prof['launches']:.0f} launches, {prof['kernel_ms']:.1f}"
                f" ms of kernels ({what})"
            )
            for kname, n, ms in prof["top"]:
                print(f"    {ms:8.3f} ms {n:5.0f}x  {kname}")
    print("\n| engine | step ms (median) | peak allocated GiB | peak reserved GiB | rounds |")
    print("|---|---:|---:|---:|---:|")
    for name, rs in results.items():

        def med(k: str, rs: list[dict] = rs) -> float:
            return statistics.median(x[k] for x in rs)

        print(
            f"| {name} | {med('step_ms'):.1f} | {med('peak_gib'):.2f} | {med('reserved_gib'):.2f} "
            f"| {len(rs)} |"
        )


if __name__ == "__main__":
    main()
