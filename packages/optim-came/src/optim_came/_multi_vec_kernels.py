# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""Multi-tensor fused CAME step of small unfactored tensors: one launch for all of them.

The tensors are those optim-adafactor's batched vector step takes
(`optim_adafactor._multi_vec_kernels`: unfactored, at most `MAX_NUMEL` elements, such as norm
weights and biases), with their full second moment `v`. `_mt_came_vec_kernel` steps one tensor
per program as came-pytorch's vector step does (no confidence term), in two sweeps: `v` and
`Σ u²`, then `m` and `p`. Same address tables (`VecTables`), tile and warps as
optim-adafactor's vector step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim_adafactor import multi_tensor as mt

if TYPE_CHECKING:
    from optim_adafactor.base import FactoredOptimizer
    from optim_came._torch_path import Work

HAS_TRITON = mt.HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor.multi_tensor import (
        sr_vector_counters,
        store_update,
        tensor_seed,
        vector_ema,
        vector_load,
    )

    @triton.jit  # type: ignore[untyped-decorator]
    def _mt_came_vec_kernel(  # type: ignore[no-untyped-def]
        addr, geo, gaddr, g0, p0, m0, lr_ptr, lr, beta1, beta2, eps1, corr2, clip_threshold,
        weight_decay, seed_base,
        LR_TENSOR: tl.constexpr, HAS_DECAY: tl.constexpr, SR: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One unfactored tensor per program (came-pytorch's vector step, no confidence term).

        Sweep 1: `v = β2 v + (1-β2)(g² + ε1)` in place, `Σ u²` with `u = g · √corr2 / √v`;
        sweep 2: `m = β1 m + (1-β1)·clip·u`, `p ← p - lr·wd·p - lr·m`. `addr` rows: parameter,
        `exp_avg`, `v`; `geo` rows: numel, index.
        """
        pid = tl.program_id(0)
        numel = tl.load(geo + pid * 2)
        g_ptr = tl.load(gaddr + pid).to(g0.dtype)
        p_ptr = tl.load(addr + pid * 3).to(p0.dtype)
        m_ptr = tl.load(addr + pid * 3 + 1).to(m0.dtype)
        v_ptr = tl.load(addr + pid * 3 + 2).to(tl.pointer_type(tl.float32))
        usq = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, numel, BLOCK):
            offs, mask, g, v = vector_ema(g_ptr, v_ptr, k, numel, beta2, eps1, BLOCK)
            u = g * corr2 / tl.sqrt(v)
            usq += tl.where(mask, u * u, 0.0)
        rms = tl.sqrt(tl.sum(usq, axis=0) / numel.to(tl.float32))
        clip = 1.0 / tl.maximum(rms / clip_threshold, 1.0)
        lr_t = tl.load(lr_ptr).to(tl.float32) if LR_TENSOR else lr
        seed = 0
        if SR:
            seed = tensor_seed(seed_base, tl.load(geo + pid * 2 + 1))
        for k in range(0, numel, BLOCK):
            offs, mask, g, v = vector_load(g_ptr, v_ptr, k, numel, BLOCK)
            u = g * corr2 / tl.sqrt(v)
            mom = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            mom = beta1 * mom + u * (clip * (1.0 - beta1))
            tl.store(m_ptr + offs, mom.to(m_ptr.dtype.element_ty), mask=mask)
            mom = mom.to(m_ptr.dtype.element_ty).to(tl.float32)  # the stored value steps p
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            upd, wd_lr = lr_t * mom, lr_t * weight_decay
            ctr = sr_vector_counters(k, BLOCK)
            store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, ctr, HAS_DECAY, SR)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """Every launch `step_vectors` makes on a GPU (for tools/gpu_compile.py).

        Gradient/parameter dtypes bf16, fp16, fp32; `exp_avg` fp32 or bf16 (`state_dtype`);
        stochastic rounding for bf16 parameters.
        """
        i64, f32 = torch.int64, torch.float32
        launches: list[dict[str, Any]] = []
        args: dict[str, Any]
        for dtype in (torch.bfloat16, torch.float16, f32):
            for m_dtype in (f32, torch.bfloat16):
                for sr in (False, True) if dtype == torch.bfloat16 else (False,):
                    args = {"addr": i64, "geo": i64, "gaddr": i64, "g0": dtype, "p0": dtype,
                            "m0": m_dtype, "lr_ptr": f32, "lr": 1e-4, "beta1": 0.9,
                            "beta2": 0.999, "eps1": 1e-30, "corr2": 1.0, "clip_threshold": 1.0,
                            "weight_decay": 0.01, "seed_base": 12345, "LR_TENSOR": False,
                            "HAS_DECAY": True, "SR": sr, "BLOCK": mt.VEC_BLOCK}  # fmt: skip
                    launches.append({"kernel": _mt_came_vec_kernel, "args": args,
                                     "options": {"num_warps": mt.VEC_NUM_WARPS}})  # fmt: skip
        return launches


def step_vectors(
    opt: FactoredOptimizer, works: list[Work], cache: dict[tuple[object, ...], Any]
) -> None:
    """One fused step of every small unfactored tensor in `works` (same batch key): 1 launch."""
    w0 = works[0]
    o, step, p0, g0, m0 = w0.opts, w0.step, w0.param, w0.grad, w0.state["exp_avg"]
    tensors = [(w.param, w.state["exp_avg"], w.state["exp_avg_sq"]) for w in works]
    tables = mt.vec_tables(cache, "came-vec", tensors, works)
    (gaddr,) = tables.grad_addresses([w.grad for w in works])
    work = mt.Work.of([w.param.numel() for w in works])
    mb, pb, gb = mt.size(m0.dtype), mt.size(p0.dtype), mt.size(g0.dtype)
    if mt.planned(_mt_came_vec_kernel, work, work.total * (2 * gb + 16 + 4 * mb + 2 * pb)):
        return
    lr_tensor = isinstance(o.lr, Tensor)
    _mt_came_vec_kernel[(len(works),)](
        tables.addr, tables.geo, gaddr, g0, p0, m0, o.lr if lr_tensor else tables.scal,
        0.0 if lr_tensor else float(o.lr), o.beta1, o.beta2, o.eps1,
        math.sqrt(o.second_moment_correction(step)), o.clip_threshold, o.weight_decay,
        (opt._sr_seed + 1_000_003 * step) % (2**31 - 1), LR_TENSOR=lr_tensor,
        HAS_DECAY=o.weight_decay != 0, SR=o.stochastic_rounding and p0.dtype == torch.bfloat16,
        BLOCK=mt.VEC_BLOCK, num_warps=mt.VEC_NUM_WARPS,
    )  # fmt: skip
