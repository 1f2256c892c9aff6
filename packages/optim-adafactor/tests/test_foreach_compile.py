"""`torch.compile(opt.step)` through the multi-tensor step of torch semantics (`_foreach_path`).

Before, it recompiled every step until dynamo's recompile limit (8 graphs over 12 steps, then
eager): the batch key hashed the step count, which burnt it into the graph, and a scheduled
float `lr` (a symbolic float under compile) was the scalar of `torch._foreach_mul_`, which burnt
it in too. Now the compiled step leaves the step count out of the batch key, takes each work's
own, and scales by the step-varying floats one tensor at a time (the per-tensor path's ops);
the eager step is unchanged (bit for bit: test_foreach_path.py). On the CPU the path runs only
with `_foreach_path.ON_CPU` (`eager_batches` sets it).
"""

from functools import partial

import pytest
import torch

from leanlm_testing import optim_basics as basics
from optim_adafactor import Adafactor, _foreach_path

STEPS = 12


@pytest.fixture
def eager_batches(monkeypatch) -> list[int]:
    """Torch semantics take the multi-tensor path on the CPU; the sizes of its eager batches.

    Not recorded under compile: dynamo guards on the length of a list appended to inside the
    compiled step (one recompile per step, as conftest's `foreach_batches` would cause).
    """
    monkeypatch.setattr(_foreach_path, "ON_CPU", True)
    sizes: list[int] = []
    step = _foreach_path.step

    def recorded(works):
        if not torch.compiler.is_compiling():
            sizes.append(len(works))
        return step(works)

    monkeypatch.setattr(_foreach_path, "step", recorded)
    return sizes


def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warmup over the test's steps: a new float `lr` at every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: (k + 1) / STEPS)


TORCH_ARGS = Adafactor.from_torch_args
CASES = {
    "lambdalr-weight-decay": (partial(TORCH_ARGS, lr=1e-2, weight_decay=0.1), warmup),
    "lambdalr-maximize-d": (partial(TORCH_ARGS, lr=1e-2, maximize=True, d=1.5), warmup),
    "constant-lr": (partial(TORCH_ARGS, weight_decay=0.1), None),
    "tensor-lr": (partial(TORCH_ARGS, lr=torch.tensor(5e-3), weight_decay=0.1), None),
}


@pytest.mark.parametrize(("make_opt", "scheduler"), list(CASES.values()), ids=list(CASES))
def test_compiled_foreach_step_settles_and_equals_eager(make_opt, scheduler, eager_batches) -> None:
    """12 steps: 3 graphs (as the per-tensor path); parameters (with a scheduler the state too)
    within 1e-5 of the eager step."""
    basics.check_compiled_step(make_opt, steps=STEPS, max_graphs=3, scheduler=scheduler)
    assert eager_batches == [len(basics.SHAPES)] * STEPS  # one batch of all, each step


def _uneven_steps(compiled: bool) -> tuple[list[torch.Tensor], Adafactor, int]:
    """A matrix stepped from step 1 and a vector from step 3 (no gradient before) in one group.

    Returns the parameters, the optimizer and the number of graphs compiled.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(9, 5, generator=gen), torch.randn(7, generator=gen)]
    opt = Adafactor.from_torch_args(params, lr=1e-2, weight_decay=0.1)
    sched = warmup(opt)
    step = torch.compile(opt.step) if compiled else opt.step
    for k in range(STEPS):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) if i == 0 or k >= 2 else None
        step()
        sched.step()
    return params, opt, counters["stats"]["unique_graphs"]


def test_compiled_foreach_step_with_uneven_step_counts_equals_eager(eager_batches) -> None:
    """Works of one group at different step counts: eagerly two batches, each with its own
    β2_t and 1/√t; compiled one batch, each work with its own step count (nothing compares
    them: torch 2.13's inductor then named an unbound symbol, `NameError: name 's37' is not
    defined`)."""
    eager, eager_opt, _ = _uneven_steps(compiled=False)
    assert eager_batches == [1] * 2 + [1, 1] * (STEPS - 2)  # at steps t and t-2: apart
    compiled, opt, graphs = _uneven_steps(compiled=True)
    # as the per-tensor path: steps 1 and 2, then the vector's new state, its step 1, step 2
    assert graphs <= 5, f"{graphs} graphs over {STEPS} steps"
    assert [opt.state[p]["step"] for p in compiled] == [STEPS, STEPS - 2]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for key, value in eager_opt.state[b].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(opt.state[a][key], value, atol=1e-5, rtol=1e-5)


def test_the_compiled_step_traces_the_foreach_path(eager_batches) -> None:
    """The compiled step is one graph of the `torch._foreach_*` ops (no break, no eager path)."""
    import torch._dynamo

    torch._dynamo.reset()
    params = [torch.randn(4, 3), torch.randn(5)]
    opt = Adafactor.from_torch_args(params, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(p.shape)
    explained = torch._dynamo.explain(opt.step)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    targets = {node.target for g in explained.graphs for node in g.graph.nodes}
    assert {torch._foreach_norm, torch._foreach_addcmul_} <= targets
    assert eager_batches == []
