"""The PyTorch path's CPU sweeps, one chunk of rows after the other (`factored.row_chunks`).

A chunk's rows give the same row sums, g², codes, scales and noise as the whole tensor; only
the column sums add in another order (fp32 rounding). Parity with the references while the
chunks are forced small: test_parity.py (and optim-came's).
"""

import itertools
import types

import pytest
import torch

from optim_adafactor import Adafactor, factored, quant
from optim_adafactor.factored import factored_sumsq, gsq_stats, row_chunks


def _check_cover(chunks: list[slice], rows: int, cols: int, limit: int) -> None:
    assert chunks[0].start == 0
    assert chunks[-1].stop == rows
    for a, b in itertools.pairwise(chunks):
        assert a.stop == b.start
    assert all(s.stop - s.start >= 1 for s in chunks)
    assert all((s.stop - s.start) * cols <= max(limit, cols) for s in chunks)


def test_row_chunks_cover_the_rows_in_order(monkeypatch) -> None:
    assert factored.CPU_CHUNK == 1 << 20
    big = torch.empty(2048, 1024)  # 2 x CPU_CHUNK elements: two halves
    assert row_chunks(big) == [slice(0, 1024), slice(1024, 2048)]
    assert row_chunks(torch.empty(1024, 1024)) == [slice(None)]  # one chunk: one sweep
    monkeypatch.setattr(factored, "CPU_CHUNK", 1000)
    chunks = row_chunks(torch.empty(1000, 300))  # 3 rows of 300 per chunk, the last 1 row
    assert len(chunks) == 334
    assert chunks[-1] == slice(999, 1000)
    _check_cover(chunks, 1000, 300, 1000)
    wide = row_chunks(torch.empty(5, 1001))  # a row wider than a chunk: one row each
    assert wide == [slice(r, r + 1) for r in range(5)]
    # one sweep: small, not 2-D, not on the CPU
    assert row_chunks(torch.empty(10, 100)) == [slice(None)]
    assert row_chunks(torch.empty(4, 100, 300)) == [slice(None)]
    assert row_chunks(torch.empty(1000, 300, device="meta")) == [slice(None)]


def test_gsq_stats_by_chunks_equal_one_sweep_and_give_the_update_sumsq(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(37, 19, generator=gen)
    row0 = torch.rand(37, generator=gen) + 0.5
    runs = []
    for chunk in (factored.CPU_CHUNK, 40):  # one sweep; 2 rows per chunk, the last one alone
        monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
        buf, row = torch.full(factored.chunk_shape(g), float("nan")), row0.clone()
        runs.append((buf, row, *gsq_stats(g, buf, row, 0.9, 1e-30)))
    assert len(row_chunks(g)) == 19
    (buf1, row1, col1, over1), (buf2, row2, col2, over2) = runs
    assert torch.equal(buf1, g * g)
    assert buf2.shape == (2, 19)
    assert torch.equal(buf2[:1], (g * g)[36:])  # the last chunk's g²
    assert torch.equal(row2, row1)  # a row's sum and EMA are computed in one piece either way
    mean = (g * g).sum(-1).div_(19).add_(1e-30)
    assert torch.equal(row1, row0.clone().mul_(0.9).add_(mean, alpha=1.0 - 0.9))  # ema_'s ops
    gsq, r = g.double().square(), row1.double()
    bound = 2 * 37 * 2.0**-24  # 37 fp32 additions of terms >= 0 (and one division each)
    for col, over in ((col1, over1), (col2, over2)):
        torch.testing.assert_close(col.double(), gsq.sum(0), rtol=bound, atol=0)
        torch.testing.assert_close(over.double(), (gsq / r[:, None]).sum(0), rtol=bound, atol=0)
    # Σ u² of u = g·rf⊗cf, rf = rsqrt(r / mean(r)), cf = rsqrt(c): against float64
    cf = torch.rand(19, generator=gen) + 0.5
    rf = (r / r.mean()).rsqrt()
    exact = (g.double() * rf[:, None] * cf.double()[None, :]).square().sum()
    got = factored_sumsq(over2, cf, row1.mean().reshape(1))
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


def _work(shape, seed: int | None, row_offset: int, chunk_rows: int):
    """What `quant.load_state` / `store_state` read: state, one-chunk workspaces, shard."""
    codes = torch.zeros(shape, dtype=torch.int8)
    scale = torch.zeros(quant.scale_shape(shape))
    chunk = (chunk_rows, shape[-1])
    return types.SimpleNamespace(
        state={"exp_avg": codes, "exp_avg_scale": scale},
        param=torch.empty(shape),
        shard=types.SimpleNamespace(row_offset=row_offset) if row_offset else None,
        quant_seed=quant.quant_seed(seed),
        m_buf=torch.empty(chunk),
        sign_buf=torch.empty(chunk, dtype=torch.bool),
        noise_buf=torch.empty(chunk) if seed is not None else None,
        hash_buf=torch.empty(chunk, dtype=torch.int32) if seed is not None else None,
    )


@pytest.mark.parametrize("row_offset", [0, 7])
@pytest.mark.parametrize("seed", [None, 1234])
def test_int8_state_by_rows_equals_the_whole_tensor(seed, row_offset) -> None:
    shape = (9, 300)  # three blocks a row, the last one partial
    m = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    m[4, 128:256] = 0.0  # an all-zero block
    whole, rowwise = _work(shape, seed, row_offset, 9), _work(shape, seed, row_offset, 6)
    if seed is None:
        whole.quant_seed = rowwise.quant_seed = None
    quant.store_state(whole, m.clone(), torch.empty(shape))
    for rows in (slice(0, 2), slice(2, 3), slice(3, 9)):  # the workspaces hold 6 rows
        quant.store_state(rowwise, m[rows].clone(), torch.empty(shape)[rows], rows)
    assert torch.equal(rowwise.state["exp_avg"], whole.state["exp_avg"])
    assert torch.equal(rowwise.state["exp_avg_scale"], whole.state["exp_avg_scale"])
    if seed is not None:  # the noise of the global elements: not the same codes as nearest
        nearest = _work(shape, None, 0, 9)
        nearest.quant_seed = None
        quant.store_state(nearest, m.clone())
        assert not torch.equal(nearest.state["exp_avg"], whole.state["exp_avg"])
    values = quant.load_state(whole, torch.empty(shape)).clone()
    for rows in (slice(0, 4), slice(4, 9)):
        got = quant.load_state(rowwise, torch.empty(shape)[rows], rows)
        assert got.data_ptr() == rowwise.m_buf.data_ptr()  # into the one-chunk workspace
        assert torch.equal(got, values[rows])
    # a code step is at most 2/127 of the block absmax (at the top of the square-law grid)
    torch.testing.assert_close(values, m, atol=2 * float(m.abs().max()) / 127, rtol=0)


@pytest.mark.parametrize("sr", [False, True])
def test_workspaces_hold_one_chunk(sr: bool, monkeypatch) -> None:
    """A 2-D parameter of 2.1M elements: every workspace of the PyTorch path (g², the
    dequantized momentum, signs, noise, hash) holds one chunk of rows, not the parameter."""
    p = torch.nn.Parameter(torch.randn(2100, 1000, generator=torch.Generator().manual_seed(0)))
    p.grad = torch.randn(2100, 1000, generator=torch.Generator().manual_seed(1))
    assert factored.chunk_shape(p) == (1048, 1000)  # 2^20 // 1000 rows
    sizes = {}
    for chunk in (factored.CPU_CHUNK, 1 << 40):  # the shipped chunk; one sweep
        monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
        opt = Adafactor(
            [p], lr=1e-3, relative_step=False, beta1=0.9, state_dtype=torch.int8,
            stochastic_rounding=sr,
        )  # fmt: skip
        opt.step()
        sizes[chunk] = {key[1:]: buf.numel() for key, buf in opt._workspaces.items()}
    chunked, whole = sizes.values()
    assert len(chunked) == (5 if sr else 3)  # fp32 0 and 1 (+2), bool, (+int32)
    assert set(chunked.values()) == {1048 * 1000}
    assert set(whole.values()) == {2100 * 1000}
