"""`state_dtype=torch.bfloat16` on the PyTorch path: the first moment is rounded once per step."""

import pytest
import torch

from optim_adafactor import factored
from optim_came import CAME

KW = {"lr": 1e-2, "weight_decay": 0.1}
SHAPES = [(10, 300), (2, 5, 130), (17,)]  # matrix (two chunks when forced), 3-D, vector


@pytest.mark.parametrize("chunk", [factored.CPU_CHUNK, 600])
def test_bf16_moment_is_the_fp32_update_rounded_once(monkeypatch, chunk: int) -> None:
    """Every step from the same state: bf16 `exp_avg` == the fp32-state step's, rounded to bf16.

    Rounding after each term (`m.mul_(β1)` on the bf16 tensor, then `addcmul_`) fails this for
    vectors; the kernels round once. Between steps the fp32 run is set to the bf16 run's state.
    """
    monkeypatch.setattr(factored, "CPU_CHUNK", chunk)
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(s, generator=gen, requires_grad=True) for s in SHAPES]
    refs = [p.detach().clone().requires_grad_() for p in ps]
    opt = CAME(ps, **KW, state_dtype=torch.bfloat16, backend="torch")
    ref = CAME(refs, **KW, backend="torch")
    rounded = 0
    for _ in range(6):
        for p, r in zip(ps, refs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        decayed = [p.detach() * (1 - KW["lr"] * KW["weight_decay"]) for p in ps]
        opt.step()
        ref.step()
        for p, r, d in zip(ps, refs, decayed, strict=True):
            m, m_ref = opt.state[p]["exp_avg"], ref.state[r]["exp_avg"]
            assert m.dtype == torch.bfloat16
            torch.testing.assert_close(m, m_ref.bfloat16(), atol=0, rtol=0)
            rounded += int((m.float() != m_ref).sum())
            # the stored (rounded) moment steps p: its update is the fp32 run's times m / m_ref
            want = d + (r.detach() - d) * (m.float() / m_ref)
            torch.testing.assert_close(p.detach(), want, atol=1e-6, rtol=1e-6)
            with torch.no_grad():
                r.copy_(p)
            ref.state[r]["exp_avg"] = m.float()  # the next step starts from the same state
    assert rounded > 100  # the moment did need rounding: the check above is not vacuous
