# Triton convention: upper-case constexpr kernel arguments, many positional kernel arguments.
# ruff: noqa: N803, PLR0917
"""`@triton.jit` helpers of the blockwise int8 first moment (`optim_adafactor.quant`).

Inlined into the kernels that step a momentum (Adafactor's apply kernels, optim-came's momentum
and apply kernels): `load_momentum` decodes int8 codes after the load (`dequant`), and
`store_momentum` encodes before the store (`quant_store`), with the same arithmetic, rounding
and hash as the PyTorch reference `quant.quantize_` / `quant.dequantize`, so the codes are
bit-equal. A tile holds whole blocks: BLOCK_M is a multiple of `QBLOCK`. Re-exported by
`optim_adafactor.quant`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None

QBLOCK = 128  # elements per scale; divides every shipped column tile (>= 128, powers of two)
QMAX = 127  # codes in [-QMAX, QMAX]
_MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x9E3779B1  # the multiplier of the element index in the hash's first round


def _int32(v: int) -> int:
    """The int32 with the low 32 bits of `v` (two's complement)."""
    v &= _MASK32
    return v - (1 << 32) if v >= 1 << 31 else v


if HAS_TRITON:
    import triton
    import triton.language as tl

    from optim_adafactor._jit_helpers import tensor_seed
    from optim_adafactor._multi_tables import GEO

    _GEO = tl.constexpr(GEO)

    _QB = tl.constexpr(QBLOCK)
    _QMAX_SQ = tl.constexpr(float(QMAX * QMAX))

    @triton.jit  # type: ignore[untyped-decorator]
    def _per_block(v, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
        """(BLOCK_N, BLOCK_M // QBLOCK) values, one per block -> each on its block's elements."""
        nb: tl.constexpr = BLOCK_M // _QB
        if nb == 1:  # no 3-D detour (it costs registers on scalar-load tiles)
            return tl.broadcast_to(v, (BLOCK_N, BLOCK_M))
        return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, nb, _QB)), (BLOCK_N, BLOCK_M))

    @triton.jit  # type: ignore[untyped-decorator]
    def _scale_ptrs(scale_ptr, srow, c0, n_blocks, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
        """(pointers, mask) of the (rows, BLOCK_M // QBLOCK) scales of the tile at column `c0`.

        `srow`: offset of each row's first scale (global row · blocks per row), -1 on masked
        rows; `c0` a multiple of QBLOCK. A block holds a valid element iff its row is valid and
        it starts before the row's end (`blk < n_blocks`), so no reduction of the element mask.
        """
        blk = c0 // _QB + tl.arange(0, BLOCK_M // _QB)
        bmask = (srow >= 0)[:, None] & (blk < n_blocks)[None, :]
        return scale_ptr + srow[:, None] + blk[None, :], bmask

    @triton.jit  # type: ignore[untyped-decorator]
    def dequant(  # type: ignore[no-untyped-def]
        m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """fp32 values of the int8 codes at `offs` (`quant.dequantize`: q·|q| · scale/127²).

        One scale load and one division per block (a row's block k starts at column
        k·QBLOCK), broadcast over its elements; the products round as the reference's.
        """
        q = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.float32)
        if BLOCK_M == _QB:  # one block per row: a vector of scales, as the row statistics
            sc = tl.load(scale_ptr + srow + c0 // _QB, mask=srow >= 0, other=0.0)[:, None]
        else:
            ptrs, bmask = _scale_ptrs(scale_ptr, srow, c0, n_blocks, BLOCK_M)
            sc = tl.load(ptrs, mask=bmask, other=0.0)
        step = tl.div_rn(sc, _QMAX_SQ)  # fl(scale / 127²), per block
        return (q * tl.abs(q)) * _per_block(step, BLOCK_N, BLOCK_M)

    @triton.jit  # type: ignore[untyped-decorator]
    def quant_store(  # type: ignore[no-untyped-def]
        m, m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, qseed, QSR: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Encode fp32 `m` (BLOCK_N x BLOCK_M, whole blocks; masked lanes 0) as `quant.quantize_`.

        Per block: absmax -> scale, `inv = 127²/absmax` (one division per block); per element
        `a = |m|·inv`, `lo = floor(√a)` by the fast sqrt. Nearest: up by one code iff
        `a - (lo + 1/2)² > 1/4` (the reference's division-free test of `(a - lo²)/(2lo+1) >
        1/2`, exact in fp32). QSR: `lo` corrected to the exact floor, up iff the element's noise
        (murmur3 of its flat index in uint32, `quant.hash_uniform`) is below
        `fl((a - lo²)/(2lo+1))`.
        Divisions round to nearest (`div_rn`), so the codes equal the PyTorch path's.
        """
        am = tl.abs(m)
        nb: tl.constexpr = BLOCK_M // _QB
        amax = tl.max(tl.reshape(am, (BLOCK_N, nb, _QB)), axis=2)
        ptrs, bmask = _scale_ptrs(scale_ptr, srow, c0, n_blocks, BLOCK_M)
        tl.store(ptrs, amax, mask=bmask)
        nonzero = amax > 0
        inv = tl.div_rn(tl.full(amax.shape, _QMAX_SQ, tl.float32), tl.where(nonzero, amax, 1.0))
        inv = tl.where(nonzero, inv, 0.0)
        a = tl.minimum(am * _per_block(inv, BLOCK_N, BLOCK_M), _QMAX_SQ)
        lo = tl.floor(tl.sqrt(a))  # the floor of √a, or one off where a is within ulps of k²
        if QSR:
            lo = lo - tl.where(lo * lo > a, 1.0, 0.0)  # exact floor: frac needs it
            lo = lo + tl.where((lo + 1.0) * (lo + 1.0) <= a, 1.0, 0.0)
            lo = tl.minimum(tl.maximum(lo, 0.0), 127.0)
            # murmur3's finaliser in uint32 (low 32 bits; `qseed` may be an int, a constexpr or
            # an int64): wraps modulo 2^32, shifts are logical
            h = (offs * 0x9E3779B1 + qseed).to(tl.uint32)
            h = h ^ (h >> 16)
            h = h * 0x85EBCA6B
            h = h ^ (h >> 13)
            h = h * 0xC2B2AE35
            h = h ^ (h >> 16)
            up = (h >> 8).to(tl.float32) * (2.0**-24) < tl.div_rn(a - lo * lo, 2.0 * lo + 1.0)
        else:
            # lo one too large (a just below k²) or too small (a just above) still gives k,
            # the nearest code, so the floor needs no correction here
            half = lo + 0.5
            up = a - half * half > 0.25  # (lo + 1/2)² is exact, so is the difference
        q = tl.minimum(lo + tl.where(up, 1.0, 0.0), 127.0)
        q = tl.where(m < 0, -q, q)
        tl.store(m_ptr + offs, q.to(tl.int8), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def load_momentum(  # type: ignore[no-untyped-def]
        m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, QUANT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """fp32 `exp_avg` at `offs`: int8 codes decoded (QUANT, `dequant`), else upcast."""
        if QUANT:
            return dequant(m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, BLOCK_N, BLOCK_M)
        return tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit  # type: ignore[untyped-decorator]
    def store_momentum(  # type: ignore[no-untyped-def]
        m, m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, qseed, QUANT: tl.constexpr,
        QSR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Store fp32 `m` as `exp_avg`: int8 codes (QUANT, `quant_store`), else in its dtype."""
        if QUANT:
            quant_store(m, m_ptr, scale_ptr, offs, mask, srow, c0, n_blocks, qseed, QSR,
                         BLOCK_N, BLOCK_M)  # fmt: skip
        else:
            tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def quant_args(  # type: ignore[no-untyped-def]
        addr, geo, mat, seed_base, NADDR: tl.constexpr, QUANT: tl.constexpr, QSR: tl.constexpr
    ):
        """(scale pointer, hash constant) of a matrix of a multi-tensor table (`quant.quant_seed`).

        The scales are the last of the matrix's NADDR addresses; the seed is the tensor's
        (`tensor_seed`: `FactoredOptimizer._kernel_seed`); unused unless QUANT (and QSR).
        """
        q_ptr = addr.to(tl.pointer_type(tl.float32))  # unused unless QUANT
        qseed = tl.zeros((), dtype=tl.int64)
        if QUANT:
            q_ptr = tl.load(addr + mat * NADDR + NADDR - 1).to(tl.pointer_type(tl.float32))
            if QSR:
                seed = tensor_seed(seed_base, tl.load(geo + mat * _GEO + 8)).to(tl.int64)
                qseed = (seed * 0x85EBCA6B + 0x27D4EB2F) & 0xFFFFFFFF
        return q_ptr, qseed

    def gpu_launch_configs() -> list[dict[str, Any]]:
        """No launches (for tools/gpu_compile.py): the helpers compile inside the kernels."""
        return []
