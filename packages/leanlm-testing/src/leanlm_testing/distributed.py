"""Run a function in several processes joined into a gloo process group."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

# Workers fork from a server process that imported these once (one server per test process)
# instead of each starting an interpreter that imports torch and transformers again (a world-2
# start: ~0.8 s instead of ~3.3 s on two CPU cores). The server skips a module that is missing.
_PRELOAD = [
    "torch.distributed",
    "transformers.models.llama.modeling_llama",
    "leanlm_testing.distributed",
]


def _worker(
    rank: int,
    world_size: int,
    start: tuple[str, dict[str, str]],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    init_file, env = start  # the rendezvous file; the caller's environment (the server's is older)
    os.environ.clear()
    os.environ.update(env)
    # One thread per process: two processes on two cores, and reproducible reductions.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise  # `spawn` reports it with this worker's traceback
    # Clean exit. No rank may tear its sockets down while a peer still talks to it, and gloo's
    # worker threads must not outlive the interpreter: a process that reaches interpreter
    # finalization with a live gloo context (a work handle or group still referenced by a test's
    # objects) sometimes aborts ("terminate called without an active exception", SIGABRT) after
    # the test passed. So: barrier, destroy, then leave without running C++ static destructors.
    try:
        dist.barrier()
    except RuntimeError:
        # A peer failed and closed its sockets; its error is the one to report. Wait so that
        # `spawn` sees that peer exit first (it then reports it and terminates this process).
        time.sleep(60)
        raise
    dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# `@pytest.mark.parametrize("device", CPU_AND_CUDA)`: the CUDA case is a `gpu` test (skipped
# without CUDA by this package's pytest plugin)
CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@contextmanager
def single_process_group(device: str, tmp_path: str | os.PathLike[str]) -> Iterator[torch.device]:
    """A world-1 process group in this process for `device` ("cpu" or "cuda"); yields the device.

    CUDA: device 0, NCCL bound to it (else `barrier()` warns), gloo where NCCL is missing;
    CPU: gloo. The rendezvous is a file under `tmp_path`; the group is destroyed on exit.
    """
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    if device == "cuda":
        torch.cuda.set_device(where)
    store = dist.FileStore(str(Path(tmp_path) / "store"), 1)  # type: ignore[attr-defined]
    bound = where if backend == "nccl" else None
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=bound)
    try:
        yield where
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, tmp_path: str | os.PathLike[str]
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes (gloo, CPU).

    The processes fork from a server that has imported torch (`forkserver`) and take this
    process's environment; `fn`'s module is imported in them as under `spawn`. The rendezvous
    is a file under `tmp_path` (no TCP port, safe under pytest-xdist). `fn` and `args` must be
    picklable (define `fn` at module level). A failure in any worker is re-raised
    here with the worker's traceback.
    """
    if world_size < 1:
        raise ValueError(f"`world_size` ({world_size}) must be >= 1")
    init_file = Path(tmp_path) / f"dist-init-{os.getpid()}-{id(fn)}"
    init_file.unlink(missing_ok=True)
    args_ = (world_size, (str(init_file), dict(os.environ)), fn, args)
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts
    start_processes(  # type: ignore[no-untyped-call]
        _worker, args=args_, nprocs=world_size, start_method="forkserver"
    )
