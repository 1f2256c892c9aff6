"""The benchmark kit every package's `benchmarks/` scripts share.

One place for what each benchmark prints beside its numbers (git revision, device, versions,
load) and for how it times and measures: medians over interleaved rounds, CUDA-synchronised
when the device is a GPU, and the process's peak resident memory.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "LlamaShapes",
    "cpu_name",
    "device_name",
    "environment",
    "git_revision",
    "header",
    "interleaved_medians",
    "kernel_times",
    "median_seconds",
    "peak_rss_mib",
    "reset_peak_rss",
    "rss_kib",
    "state_bytes",
    "synchronizer",
    "version",
]


@dataclass(frozen=True, kw_only=True)
class LlamaShapes:
    """A Llama-shaped parameter set (untied embeddings, no biases): 50.3M parameters by default.

    `kv_hidden` is the rows of k and v (grouped-query attention); None: `hidden`.
    """

    hidden: int = 512
    intermediate: int = 1408
    layers: int = 8
    vocab: int = 24000
    kv_hidden: int | None = None

    def shapes(self) -> list[tuple[int, ...]]:
        """Embeddings and final norm, then q, k, v, o, gate, up, down and two norms per layer."""
        h, i = self.hidden, self.intermediate
        kv = h if self.kv_hidden is None else self.kv_hidden
        per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
        return [(self.vocab, h), (self.vocab, h), (h,)] + per_layer * self.layers


def random_params(
    shapes: Iterable[tuple[int, ...]], device: str | torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Parameters ~ N(0, 0.02²) with fixed gradients ~ N(0, 1e-3²), one per shape, in `dtype`.

    Drawn on the CPU from one generator seeded 0 (the same values on every device), so that
    every case of an optimizer benchmark steps the same parameters with the same gradients.
    """
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = (torch.randn(shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3).to(device, dtype)
        params.append(p)
    return params


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` (`numel · element_size`; meta tensors too).

    A tensor that several parameters' states hold counts once (bitsandbytes' 8-bit optimizers
    give every parameter's state the same two 256-entry quantization maps); non-tensors, nothing.
    """
    tensors = {
        id(v): v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


def git_revision(where: str | Path | None = None) -> str:
    """Short commit of the checkout holding `where` (default: the working directory).

    Marked "+ uncommitted changes" when files under `where` differ from that commit, and
    "unknown" outside a git checkout.
    """
    cwd = Path(where) if where is not None else Path.cwd()
    if cwd.is_file():
        cwd = cwd.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=cwd,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            check=True,
            cwd=cwd,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" (+ uncommitted changes)" if dirty else "")


def version(dist: str) -> str:
    """The installed version of distribution `dist`, or "not installed"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: str | torch.device) -> str:
    """A readable name of `device`: the GPU's name, or the CPU model and its core count."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"CUDA: {torch.cuda.get_device_name(dev)}"
    return f"CPU: {cpu_name()}, {os.cpu_count()} logical cores"


def environment(
    device: str | torch.device, dists: Iterable[str] = (), *, where: str | Path | None = None
) -> dict[str, str]:
    """What a result depends on: device, load, python/torch/triton and `dists` versions, git.

    On a CPU device also torch's intra-op thread count (`torch.set_num_threads`).
    """
    env = {"device": device_name(device)}
    if torch.device(device).type == "cpu":
        env["torch threads"] = str(torch.get_num_threads())
    env |= {
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": version("triton"),
    }
    for dist in dists:
        env[dist] = version(dist)
    env["git"] = git_revision(where)
    return env


def header(
    name: str,
    device: str | torch.device,
    dists: Iterable[str] = (),
    *,
    where: str | Path | None = None,
) -> str:
    """One line naming the benchmark and its `environment`, printed above its results."""
    env = environment(device, dists, where=where)
    return f"# {name}  " + ", ".join(f"{k} {v}" for k, v in env.items())


def start(name: str) -> str:
    """The default device ("cuda" when available, else "cpu"), after printing `header` for it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(header(name, device))
    return device


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """A function that waits for `device`'s queued work (a no-op on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall time of `fn` over `repeats` calls, after `warmup` untimed calls."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}")
    return interleaved_medians({"fn": fn}, rounds=repeats, warmup=warmup, sync=sync)["fn"]


def interleaved_medians(
    cases: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per case, timing the cases in turn within each of `rounds` rounds.

    Interleaving spreads a drift of the machine (load, clocks, caches) over every case
    instead of charging it to whichever ran last. Each case first runs `warmup` times.
    """
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1, got {rounds}")
    wait = sync or (lambda: None)
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    wait()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            wait()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_times(
    fn: Callable[[], object], device: str | torch.device, *, calls: int = 1, warmup: int = 1
) -> list[tuple[str, float, float]]:
    """What one call of `fn` runs, longest first: (name, launches, microseconds) per call.

    `torch.profiler` over `calls` calls after `warmup` unprofiled ones. On CUDA: the GPU
    kernels, copies and memsets with their device time (where a step's time goes, kernel by
    kernel); elsewhere the operators with their own CPU time.
    """
    from torch.profiler import DeviceType, ProfilerActivity, profile

    if calls < 1:
        raise ValueError(f"`calls` must be >= 1, got {calls}")
    cuda = torch.device(device).type == "cuda"
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != (DeviceType.CUDA if cuda else DeviceType.CPU):
            continue  # on CUDA: the host side of the launches
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us > 0:
            rows.append((evt.key, evt.count / calls, us / calls))
    return sorted(rows, key=lambda row: -row[2])


def rss_kib(field: str = "VmRSS") -> int:
    """A memory field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field!r} is not a field of /proc/self/status")


def reset_peak_rss() -> float:
    """Reset the peak-RSS mark (VmHWM) to the current RSS; return that RSS in MiB.

    Raises `OSError` where the kernel refuses the reset (then the peak would include
    everything before it, and a measured column would be wrong).
    """
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    """The peak resident memory of this process since start or the last `reset_peak_rss`."""
    return rss_kib("VmHWM") / 1024
