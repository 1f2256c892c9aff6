# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""`@triton.jit` helpers shared by every kernel module of optim-adafactor and optim-came.

Tiles of the per-tensor (batch, row-block) grid (`row_tile`, `col_tile`) and of the
multi-tensor row and column items (`span`, `tile`, `row_item`), the vector loads and EMA of the
unfactored second moment (`vector_load`, `vector_ema`), the parameter store that ends every
apply kernel (`store_update`, `momentum_store`) and its stochastic rounding
(`stochastic_round_bf16`, `tensor_seed`, `sr_counters`, `sr_vector_counters`). They are inlined
into the kernels that call them; the public names are re-exported by `optim_adafactor.factored`
and `optim_adafactor.multi_tensor`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def stochastic_round_bf16(x, seed, counters):  # type: ignore[no-untyped-def]
        """fp32 `x` -> fp32 values representable in bf16, stochastically rounded (unbiased).

        Adds uniform 16-bit noise to the fp32 bit pattern and truncates the low 16 bits: rounds
        up with probability equal to the discarded fraction. The noise of 8 consecutive
        elements of the last dimension comes from one Philox4x32-10 draw,
        `tl.randint4x(seed, counter)` (4 x 32 bits = 8 x 16), with `counters` of x's shape but
        1/8 of its last dimension (`sr_counters`, `sr_vector_counters`): element `8k + s` takes
        the low (s even) or high (s odd) half of output `s // 2` of counter k. One draw per
        element would compute 8 times the Philox rounds and throw 7/8 of the bits away.
        """
        r0, r1, r2, r3 = tl.randint4x(seed, counters)
        # `tl.join` adds its choice as the LAST axis: [..., K, a, b, h] -> [..., 8K] puts
        # element 8k + 4a + 2b + h = 8k + 2t + h at half h of output t = 2a + b
        lo = tl.join(tl.join(r0 & 0xFFFF, r2 & 0xFFFF), tl.join(r1 & 0xFFFF, r3 & 0xFFFF))
        hi = tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16))
        noise = tl.reshape(tl.join(lo, hi), x.shape)
        bits = x.to(tl.int32, bitcast=True) + noise.to(tl.int32, bitcast=True)
        return (bits & -65536).to(tl.float32, bitcast=True)

    @triton.jit  # type: ignore[untyped-decorator]
    def sr_counters(rows, start, n_cols, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
        """`stochastic_round_bf16`'s counters of the `rows` x `[start, start + BLOCK_M)` tile.

        One counter per 8 columns of a row: `row · ⌈n_cols / 8⌉ + col // 8` (int64), shape
        [len(rows), BLOCK_M // 8]; `rows` count from the tensor's first row (a batched 3-D
        tensor's rows run on across the batch), `start` is a multiple of 8. A function of the
        element's row and column only, so every kernel and tiling draws the same noise.
        """
        tl.static_assert(BLOCK_M % 8 == 0, "stochastic rounding draws noise for 8 columns at once")
        groups = start // 8 + tl.arange(0, BLOCK_M // 8)
        return rows[:, None].to(tl.int64) * tl.cdiv(n_cols, 8) + groups[None, :]

    @triton.jit  # type: ignore[untyped-decorator]
    def sr_vector_counters(start, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """The counters of elements `[start, start + BLOCK)` of a vector (`sr_counters`' row 0)."""
        return start // 8 + tl.arange(0, BLOCK // 8)

    @triton.jit
    def tensor_seed(seed_base, index):  # type: ignore[no-untyped-def]
        """The stochastic-rounding seed of the tensor at `index` in a step.

        `seed_base` is `seed + 1_000_003 · step`: this is `FactoredOptimizer._kernel_seed`, which
        the PyTorch path uses too.
        """
        return ((seed_base + 7919 * index) % 2147483647).to(tl.int32)

    @triton.jit  # type: ignore[untyped-decorator]
    def row_tile(n_rows, n_cols, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
        """This program's rows of a (batch, n_rows, n_cols) launch on a (batch, row-block) grid.

        Returns `(pid_b, pid_r, rows, row_mask, base)`: the batch and row-block indices, the
        BLOCK_N row indices, their mask and the offset of the batch's first element (int64).
        """
        pid_b = tl.program_id(0)
        pid_r = tl.program_id(1)
        rows = pid_r * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        base = pid_b.to(tl.int64) * n_rows * n_cols
        return pid_b, pid_r, rows, row_mask, base

    @triton.jit  # type: ignore[untyped-decorator]
    def col_tile(start, rows, row_mask, base, n_cols, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
        """The BLOCK_N x BLOCK_M tile of `row_tile`'s rows at column `start`.

        Returns `(cols, col_mask, mask, offs)`: column indices, their mask, the tile's mask and
        its element offsets (int64).
        """
        cols = start + tl.arange(0, BLOCK_M)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        offs = base + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        return cols, col_mask, mask, offs

    @triton.jit  # type: ignore[untyped-decorator]
    def span(start, end, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """`(idx, idx < end)` for `idx = start + arange(BLOCK)`: a masked run of rows or columns."""
        idx = start + tl.arange(0, BLOCK)
        return idx, idx < end

    @triton.jit  # type: ignore[untyped-decorator]
    def row_item(items, geo, GEO: tl.constexpr):  # type: ignore[no-untyped-def]
        """`(mat, r0, r1, m, cf_off)` of this program's row item (5 int64 per item in `items`).

        The item's matrix, its rows `[r0, r1)`, and from the matrix's `geo` row (GEO int64
        each) its columns and the offset of its column factors: an apply kernel's prologue.
        """
        item = items + tl.program_id(0) * 5
        mat = tl.load(item)
        r0 = tl.load(item + 1)
        r1 = tl.load(item + 2)
        row = geo + mat * GEO
        return mat, r0, r1, tl.load(row + 1), tl.load(row + 2)

    @triton.jit
    def tile(rows, row_mask, cols, col_mask, m):  # type: ignore[no-untyped-def]
        """`(mask, offs)` of the rows x cols tile of a row-major matrix with `m` columns (int64)."""
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None].to(tl.int64) * m + cols[None, :]
        return mask, offs

    @triton.jit  # type: ignore[untyped-decorator]
    def vector_ema(g_ptr, v_ptr, k, numel, beta2, eps1, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Elements `k + arange(BLOCK)` of a vector: `v = β2 v + (1-β2)(g² + ε1)`, stored.

        Returns `(offs, mask, g, v)` with g upcast to fp32 (the unfactored second moment of the
        multi-tensor vector kernels here and in optim-came).
        """
        offs, mask = span(k, numel, BLOCK)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # upcast first
        v = tl.load(v_ptr + offs, mask=mask, other=1.0)
        v = beta2 * v + (1.0 - beta2) * (g * g + eps1)
        tl.store(v_ptr + offs, v, mask=mask)
        return offs, mask, g, v

    @triton.jit  # type: ignore[untyped-decorator]
    def vector_load(g_ptr, v_ptr, k, numel, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Elements `k + arange(BLOCK)` of a vector: `(offs, mask, g, v)`, g upcast to fp32."""
        offs, mask = span(k, numel, BLOCK)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=1.0)
        return offs, mask, g, v

    @triton.jit  # type: ignore[untyped-decorator]
    def store_update(  # type: ignore[no-untyped-def]
        p_ptr, offs, mask, p, upd, wd_lr, seed, counters, HAS_DECAY: tl.constexpr,
        SR: tl.constexpr,
    ):  # fmt: skip
        """Store `p - wd_lr·p - upd` (fp32 `p` as loaded from `p_ptr + offs`) in p's dtype.

        The end of every apply kernel here and in optim-came; SR rounds stochastically with
        the tile's `seed` and `counters` (`stochastic_round_bf16`; unused without SR). The
        decay is `p - wd_lr·p` (HF's and came-pytorch's `p.add_(p, alpha=-wd·lr)`), not
        `p·(1 - wd_lr)`: the fp32 rounding of `1 - wd_lr` would bias it by up to 0.3% near
        wd·lr = 1e-5. The caller loads `p` itself, where its kernel always did: moving the load
        changes the register allocation of the CAME kernels (tools/gpu_compile.py).
        """
        if HAS_DECAY:
            p = p - wd_lr * p
        p = p - upd
        if SR:
            p = stochastic_round_bf16(p, seed, counters)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def momentum_store(  # type: ignore[no-untyped-def]
        p_ptr, m_ptr, offs, mask, upd, beta1, wd_lr, seed, counters,
        HAS_M: tl.constexpr, HAS_DECAY: tl.constexpr, SR: tl.constexpr,
    ):  # fmt: skip
        """Adafactor's apply tail: the momentum, then `store_update` of the parameter.

        HAS_M: `m = β1 m + upd` (fp32, stored) steps instead of `upd`. Loads m and p here.
        """
        if HAS_M:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            m = beta1 * m + upd
            tl.store(m_ptr + offs, m, mask=mask)
            upd = m
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        store_update(p_ptr, offs, mask, p, upd, wd_lr, seed, counters, HAS_DECAY, SR)

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """No launches (for tools/gpu_compile.py): the helpers compile inside the kernels."""
        return []
