"""Full state dicts and per-rank memory accounting."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shard_zero._api import engine_of
from shard_zero._layout import unpack_full
from shard_zero._optimizer import ZeroOptimizer

_FULL_STATE_IDENT = 700_000  # + entry index: what the full_state_dict gathers carry


def full_state_dict(
    model: nn.Module, *, dtype: torch.dtype | None = None, rank0_only: bool = False
) -> dict[str, Any]:
    """The unsharded state dict of `model` with its original keys, on the CPU (a collective).

    Trainable parameters come from the fp32 master shards, all-gathered one tensor at a time
    and copied to the CPU before the next: the device holds at most one full parameter (plus
    its padding) beyond its shards, never the whole fp32 model. They carry full precision even
    under mixed precision; buffers and frozen parameters are copied to the CPU as they are.
    Tied parameters appear under every key they had. Call it on every rank (e.g. save the
    result from rank 0 with `save_pretrained(..., state_dict=...)`).

    Args:
        model: a model returned by `prepare`.
        dtype: cast trainable parameters to this dtype (None: fp32).
        rank0_only: only rank 0 builds the dict (CPU memory for one copy of the model); the
            other ranks take part in the gathers and get `{}`.
    """
    engine = engine_of(model)
    keep = not rank0_only or engine.rank == 0
    gathered: dict[nn.Parameter, torch.Tensor] = {}
    for i, e in enumerate(engine.entries):
        if e.sharded:
            ident = _FULL_STATE_IDENT + i
            engine.comm.names[ident] = f"the master weight {e.name!r} (full_state_dict)"
            inp = torch.zeros(e.seg, dtype=torch.float32, device=engine.device)
            inp[: e.local_numel].copy_(e.master.detach().reshape(-1))
            out = torch.empty(engine.world * e.seg, dtype=torch.float32, device=engine.device)
            engine.comm.wait(engine.comm.all_gather(out, inp, ident=ident), ident)
            if keep:
                full = torch.empty(e.shape, dtype=torch.float32, device="cpu")
                unpack_full(out.view(engine.world, e.seg), 0, e, full)
                gathered[e.param] = full if dtype is None else full.to(dtype)
            del inp, out
        elif keep:
            full = e.master.detach().to("cpu", copy=True)
            gathered[e.param] = full if dtype is None else full.to(dtype)
    if not keep:
        return {}
    out_dict: dict[str, Any] = {}
    with engine.model_hooks.allow_reading():  # only the keys and the buffers are read
        entries = model.state_dict(keep_vars=True).items()
    for key, value in entries:
        full_value = gathered.get(value) if isinstance(value, nn.Parameter) else None
        if full_value is not None:
            out_dict[key] = full_value
        elif isinstance(value, torch.Tensor):
            out_dict[key] = value.detach().to("cpu", copy=True)
        else:
            out_dict[key] = value
    return out_dict


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _bytes(tensors: list[torch.Tensor], seen: set[tuple[int, int]]) -> int:
    """Bytes of the distinct storages of `tensors` not already in `seen` (updated)."""
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key[1] == 0 or key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def memory_stats(model: nn.Module, optimizer: ZeroOptimizer | None = None) -> dict[str, Any]:
    """Bytes of model state this rank holds now, and the last step's communication.

    Storages are counted once, at their allocated size (a stage-3 parameter counts only while
    gathered; a master shard that aliases the model's parameter counts under `params`). What
    lives on the model's device and what lives in host memory (`offload_accum`,
    `offload_optimizer`) is reported apart, by role: on a CPU model both are CPU memory.

    Returns:
        A dict with, on the device: `params` (the model's compute parameters, all of them),
        `master_params` (fp32 master shards not aliasing `params`), `grads` (shard gradients
        plus any full-size accumulators), `optimizer_state` (tensors in the optimizer's
        state), `total` (their sum); in host memory (not in `total`): `host_master_params`,
        `host_grads` (the buffers of `offload_accum` and of `offload_optimizer`'s gradients,
        allocated, whether or not they hold data), `host_optimizer_state`, `host_rows`
        (`offload_optimizer`: the rows cast to the compute dtype for the all-gathers),
        `host_total` (their sum); and `communication`: `{kind: {"calls": n, "bytes": b}}`
        for the last completed step.
    """
    engine = engine_of(model)
    entries = engine.entries
    # resting stage-3 parameters view one placeholder element per dtype: not model memory
    resting = engine.stage3.placeholder_storages() if engine.stage == 3 else []
    seen = {_storage_key(t) for t in resting}
    params = _bytes(list(model.parameters()), seen)
    state_tensors: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    host: dict[str, int] = {}
    if engine.offload:  # the masters, their gradients and the state are host tensors
        host["host_master_params"] = _bytes([e.master for e in entries], seen)
        host["host_optimizer_state"] = _bytes(state_tensors, seen)
        state_tensors = []
    host_grads = [e.host_acc for e in entries] + [e.host_grad for e in entries]
    host["host_grads"] = _bytes([g for g in host_grads if g is not None], seen)
    host["host_rows"] = _bytes([e.host_rows for e in entries if e.host_rows is not None], seen)
    masters = _bytes([e.master for e in entries], seen)
    grad_tensors = [e.master.grad for e in entries if e.master.grad is not None]
    grad_tensors += [e.dev_grad for e in entries if e.dev_grad is not None]
    grad_tensors += [e.acc for e in entries if e.acc is not None]
    grad_tensors += [e.low_acc for e in entries if e.low_acc is not None]
    grad_tensors += [p.grad for p in model.parameters() if p.grad is not None]
    grads = _bytes(grad_tensors, seen)
    opt_state = _bytes(state_tensors, seen)
    host_masters = host.get("host_master_params", 0)
    host_state = host.get("host_optimizer_state", 0)
    return {
        "params": params,
        "master_params": masters,
        "grads": grads,
        "optimizer_state": opt_state,
        "total": params + masters + grads + opt_state,
        "host_master_params": host_masters,
        "host_grads": host["host_grads"],
        "host_optimizer_state": host_state,
        "host_rows": host["host_rows"],
        "host_total": host_masters + host["host_grads"] + host_state + host["host_rows"],
        "communication": dict(engine.comm.last_step),
    }
