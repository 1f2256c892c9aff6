"""AdamW in leanlm: torch's fused step where every parameter is on the CPU (a CPU run, and the
host step of ZeRO-Offload), the default elsewhere; the same updates as a float64 reference."""

import torch

from leanlm.train.optim import decay_param_groups, optimizer_over


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 24), (24,), (7, 5)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
            for s in shapes]  # fmt: skip


def test_adamw_on_cpu_is_fused_and_steps_as_a_float64_reference():
    params = _params(torch.float32)
    ref = [torch.nn.Parameter(p.detach().double()) for p in params]
    opt = optimizer_over("adamw", decay_param_groups(params, 0.1), lr=1e-2, betas=(0.9, 0.95))
    assert [g["fused"] for g in opt.param_groups] == [True, True]
    ref_opt = torch.optim.AdamW(decay_param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95),
                                foreach=False)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        for p, r in zip(params, ref, strict=True):
            r.grad = torch.randn(r.shape, generator=gen, dtype=torch.float64)
            p.grad = r.grad.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref, strict=True):  # fp32 rounding over 20 steps, nothing more
        torch.testing.assert_close(p.double(), r.detach(), rtol=1e-5, atol=1e-6)
        assert (p.double() - r.detach()).abs().max() > 0  # fp32 really stepped, not float64
    assert opt.state[params[0]]["step"].item() == 20


def test_adamw_off_the_cpu_keeps_torchs_default():
    meta = [torch.nn.Parameter(torch.empty(4, 4, device="meta"))]
    opt = optimizer_over("adamw", meta, lr=1e-3, betas=(0.9, 0.95))
    assert opt.param_groups[0]["fused"] is None
    ints = [torch.zeros(3, dtype=torch.int64)]  # not floating point: never fused
    opt = optimizer_over("adamw", ints, lr=1e-3, betas=(0.9, 0.95))
    assert opt.param_groups[0]["fused"] is None
