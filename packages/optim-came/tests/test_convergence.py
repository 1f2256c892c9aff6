"""A short training run of a tiny Llama (byte-level, on English prose from the standard library):
CAME vs AdamW vs Adafactor at the same lr (3e-3, leanlm's default) and the same warmup + cosine
schedule. The 500-step, 3-seed, lr-swept version is `benchmarks/exp_convergence.py` (results in
`benchmarks/RESULTS.md` and the README).

Observed validation loss (held-out last 10% of the text, 128 windows) after 120 steps of batch
16 x 64 bytes; seed = model initialisation and data order:

| optimizer | seed 0 | seed 1 | seed 2 |
|---|---:|---:|---:|
| AdamW | 1.755 | 1.766 | 1.763 |
| Adafactor (HF Trainer settings, no momentum) | 1.573 | 1.562 | 1.595 |
| CAME, `instability_init=1.0` (leanlm's setting) | 1.570 | 1.561 | 1.555 |
| CAME, came-pytorch defaults | 1.834 | 2.091 | 1.820 |

Differences per seed (mean ± std): CAME - AdamW -0.18 / -0.21 / -0.21 (-0.199 ± 0.013);
CAME - Adafactor -0.003 / -0.001 / -0.041 (-0.015 ± 0.022); CAME defaults - CAME 0.26 / 0.53 /
0.27.

What is asserted on seed 0, with margins from the worst observed seed: CAME is not worse than
AdamW (+0.05: 0.23 above the worst, ~18 std; it is ~0.2 below at this length, and at 500
steps the two are within 0.02, see RESULTS.md), not worse than Adafactor (+0.07: ~3 std above
the worst), and clearly better than came-pytorch's zero-initialised instability, whose first
steps are ~11x lr (research note §1.7): the gap must exceed 0.1, observed >= 0.26.

"Below Adafactor" is not asserted, because it is not robust at this scale. With β3 = 0.9999 and
`R, C` starting at 1, the confidence term moves only 1-β3^t of the way (1% at 120 steps, 5% at
500) towards the measured instability, so CAME is in effect Adafactor (with a fixed β2) plus
β1 = 0.9 momentum here. The two are within the seed noise: 0.001-0.04 apart at 120 steps, and
within ±0.02 either way at 500 steps.
"""

from __future__ import annotations

import math
import pathlib
import statistics
import sysconfig
from collections.abc import Callable, Iterator

import pytest
import torch

from optim_adafactor import Adafactor
from optim_came import CAME

pytest.importorskip("transformers")

STEPS, BATCH, SEQ, LR, VAL_WINDOWS = 120, 16, 64, 3e-3, 128

MakeOpt = Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, MakeOpt] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0),
    # HF Trainer's optim="adafactor": an external lr, no relative step or parameter scale.
    "adafactor": lambda p: Adafactor(p, lr=LR, relative_step=False, scale_parameter=False),
    # The leanlm pipeline's setting.
    "came": lambda p: CAME(p, lr=LR, instability_init=1.0),
    # came-pytorch's defaults (zero-initialised instability).
    "came_default": lambda p: CAME(p, lr=LR),
}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the first 90% and the last 10% of the bytes of pydoc's topics."""
    path = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def _train(make_opt: MakeOpt, train: torch.Tensor, val: torch.Tensor, *, seed: int) -> float:
    """Validation loss after STEPS steps (seed: model initialisation and data order)."""
    from leanlm_testing.models import tiny_llama

    model = tiny_llama(seed=seed).train()
    opt = make_opt(model.parameters())
    warmup = STEPS // 10

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        starts = torch.randint(0, len(train) - SEQ, (BATCH,), generator=gen)
        x = torch.stack([train[s : s + SEQ] for s in starts.tolist()])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model.eval()
    stride = (len(val) - SEQ) // VAL_WINDOWS
    windows = torch.stack([val[i * stride : i * stride + SEQ] for i in range(VAL_WINDOWS)])
    with torch.no_grad():
        return statistics.fmean(model(input_ids=w, labels=w).loss.item() for w in windows.split(64))


@pytest.mark.slow  # 4 x 120 steps: ~20 s idle (estimate); 25 min at load average ~20
def test_came_converges_like_adamw_and_adafactor() -> None:
    train, val = _data()
    loss = {name: _train(make, train, val, seed=0) for name, make in OPTIMIZERS.items()}
    print(" ".join(f"{name} {value:.4f}" for name, value in loss.items()))
    assert loss["came"] < 3.0  # it learned (5.5 at initialisation)
    assert loss["came"] < loss["adamw"] + 0.05  # observed 0.18-0.21 below
    assert loss["came"] < loss["adafactor"] + 0.07  # observed 0.001-0.041 below (std 0.022)
    assert loss["came_default"] > loss["came"] + 0.1  # the early spike: observed 0.26-0.53
