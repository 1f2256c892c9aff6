# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused Adafactor step of small unfactored tensors: one launch for all of them.

Vectors (norm weights, biases) and other unfactored tensors of at most `MAX_NUMEL` elements keep
a full second moment `v`. One program steps one tensor in two sweeps: `v` and Σu² (and Σp²),
then, after the step size and clip on the device, m and p as `_torch_path.apply` does; the
second sweep re-reads g and v from cache (at most `MAX_NUMEL` elements). Same tables and
address scheme as `_multi_kernels.py`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from optim_adafactor import _multi_tables as mt

if TYPE_CHECKING:
    from optim_adafactor._torch_path import Work
    from optim_adafactor.checks import Scalar


class Stepping(Protocol):
    """What the multi-tensor steps use of `Adafactor` (a protocol: `optimizer` imports them)."""

    _sr_seed: int
    _step_sizes: dict[Tensor, Scalar | tuple[Tensor, int]]


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
MAX_NUMEL = 1 << 16  # larger unfactored tensors keep the PyTorch path (one program each is slow)
BLOCK = 64 if _INTERPRET else 1024
NUM_WARPS = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._jit_helpers import (
        momentum_store,
        sr_vector_counters,
        tensor_seed,
        vector_ema,
        vector_load,
    )

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_vec_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, scal, g0, p0, lr_ptr, lr, beta2, eps1, eps2, clip_threshold, coef,
        beta1, weight_decay, seed_base,
        LR_TENSOR: tl.constexpr, HAS_P: tl.constexpr, CLIP: tl.constexpr, HAS_M: tl.constexpr,
        HAS_DECAY: tl.constexpr, SR: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One unfactored tensor per program: `v` EMA, `u = g/√v`, clip, momentum, write.

        `addr` rows: parameter, momentum (or the parameter), `v`; `geo` rows: numel, index.
        `scal[t, 3]` receives the step size `lr_t` (for `Adafactor._get_lr`).
        """
        pid = tl.program_id(0)
        numel = tl.load(geo + pid * 2)
        g_ptr = tl.load(gaddr + pid).to(g0.dtype)
        p_ptr = tl.load(addr + pid * 3).to(p0.dtype)
        m_ptr = tl.load(addr + pid * 3 + 1).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(addr + pid * 3 + 2).to(tl.pointer_type(tl.float32))
        usq = tl.zeros([BLOCK], dtype=tl.float32)
        psq = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, numel, BLOCK):
            offs, mask, g, v = vector_ema(g_ptr, v_ptr, k, numel, beta2, eps1, BLOCK)
            u = g / tl.sqrt(v)
            usq += tl.where(mask, u * u, 0.0)
            if HAS_P:
                p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                psq += p * p
        n_f = numel.to(tl.float32)
        lr_t = tl.load(lr_ptr).to(tl.float32) if LR_TENSOR else lr
        if HAS_P:
            lr_t = lr_t * tl.maximum(tl.sqrt(tl.sum(psq, axis=0) / n_f), eps2)
        scale = lr_t
        if CLIP:
            rms = tl.sqrt(tl.sum(usq, axis=0) / n_f)
            scale = scale / tl.maximum(rms / clip_threshold, 1.0)
        tl.store(scal + pid * 4 + 3, lr_t)
        scale = scale * coef
        wd_lr = lr_t * weight_decay
        seed = 0
        if SR:
            seed = tensor_seed(seed_base, tl.load(geo + pid * 2 + 1))
        for k in range(0, numel, BLOCK):
            offs, mask, g, v = vector_load(g_ptr, v_ptr, k, numel, BLOCK)
            upd = g / tl.sqrt(v) * scale
            ctr = sr_vector_counters(k, BLOCK)
            momentum_store(p_ptr, m_ptr, offs, mask, upd, beta1, wd_lr, seed, ctr, HAS_M,
                           HAS_DECAY, SR)  # fmt: skip

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_vectors` makes on a GPU (for tools/gpu_compile.py)."""
        i64, f32 = torch.int64, torch.float32
        launches: list[dict[str, Any]] = []
        for dtype in (torch.bfloat16, torch.float16, f32):
            for has_p in (False, True):
                for has_m in (False, True):
                    for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                        args = {"addr": i64, "geo": i64, "gaddr": i64, "scal": f32, "g0": dtype,
                                "p0": dtype, "lr_ptr": f32, "lr": 1e-3, "beta2": 0.999,
                                "eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "coef": 0.1,
                                "beta1": 0.9, "weight_decay": 0.01, "seed_base": 12345,
                                "LR_TENSOR": False, "HAS_P": has_p, "CLIP": True,
                                "HAS_M": has_m, "HAS_DECAY": True, "SR": sr,
                                "BLOCK": BLOCK}  # fmt: skip
                        launches.append({"kernel": _mt_vec_kernel, "args": args,
                                         "options": {"num_warps": NUM_WARPS}})  # fmt: skip
        return launches


@dataclass(slots=True)
class VecTables:
    """Address (n, 3) and geometry (n, 2) tables of a batch of small unfactored tensors."""

    addr: Tensor
    geo: Tensor
    scal: Tensor  # (n, 4) fp32; column 3: lr_t of the last step
    grad_addresses: mt.GradAddresses = field(default_factory=mt.GradAddresses)


def vec_tables(
    cache: dict[tuple[object, ...], Any], tag: str, tensors: Sequence[Sequence[Tensor]],
    works: Sequence[Any],
) -> VecTables:  # fmt: skip
    """The cached tables of a batch of vectors (`tensors[i]`: the addresses of `works[i]`)."""
    signature = (tag, *((tuple(t.data_ptr() for t in ts), ts[0].numel(), w.index)
                        for ts, w in zip(tensors, works, strict=True)))  # fmt: skip
    tables = cache.get(signature)
    if tables is None:
        device = tensors[0][0].device
        tables = VecTables(
            addr=mt.to_device([[t.data_ptr() for t in ts] for ts in tensors], device),
            geo=mt.to_device([[w.param.numel(), w.index] for w in works], device),
            scal=torch.empty((len(works), 4), dtype=torch.float32, device=device),
        )
        mt.remember(cache, signature, tables)
    return tables


def fusable(p: Tensor) -> bool:
    """Whether an unfactored parameter (and its gradient) can take the batched vector step."""
    g = p.grad
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return (
        type(p) in (Tensor, torch.nn.Parameter)
        and type(g) is Tensor
        and 0 < p.numel() <= MAX_NUMEL
        and p.is_contiguous()
        and g.is_contiguous()
        and p.dtype in dtypes
        and g.dtype in dtypes
    )


def step_vectors(opt: Stepping, works: list[Work], cache: dict[tuple[object, ...], Any]) -> None:
    """One fused step of every small unfactored tensor in `works` (same batch key): 1 launch."""
    w0 = works[0]
    o, step, p0, g0 = w0.opts, w0.step, w0.param, w0.grad
    has_m = o.beta1 is not None
    tensors = [
        (w.param, w.state["exp_avg"] if has_m else w.param, w.state["exp_avg_sq"]) for w in works
    ]
    tables = vec_tables(cache, "vec", tensors, works)
    (gaddr,) = tables.grad_addresses([w.grad for w in works])
    rel = o.relative_step_size(step)
    lr_tensor = isinstance(rel, Tensor)
    coef = (1.0 - o.beta1 if has_m else 1.0) * (-1.0 if o.maximize else 1.0)
    clip = o.clip_threshold
    work = mt.Work.of([w.param.numel() for w in works])
    pb, gb = mt.size(p0.dtype), mt.size(g0.dtype)
    nbytes = work.total * (gb + 8 + pb * (2 + o.needs_param_rms) + (8 if has_m else 0))
    if mt.planned(_mt_vec_kernel, work, nbytes):
        return
    _mt_vec_kernel[(len(works),)](
        tables.addr, tables.geo, gaddr, tables.scal, g0, p0, rel if lr_tensor else tables.scal,
        0.0 if lr_tensor else float(rel), o.beta2(step), w0.eps1, o.eps2,
        1.0 if clip is None else clip, coef, o.beta1 if has_m else 0.0, o.weight_decay,
        (opt._sr_seed + 1_000_003 * step) % (2**31 - 1), LR_TENSOR=lr_tensor,
        HAS_P=o.needs_param_rms, CLIP=clip is not None, HAS_M=has_m,
        HAS_DECAY=o.weight_decay != 0, SR=o.stochastic_rounding and p0.dtype == torch.bfloat16,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    for i, w in enumerate(works):
        opt._step_sizes[w.param] = (tables.scal, i)
