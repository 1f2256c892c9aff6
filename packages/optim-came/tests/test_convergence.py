"""A short training run of a tiny Llama (byte-level, on English prose from the standard library):
CAME vs AdamW vs Adafactor at the same lr and the same warmup + cosine schedule.

Observed (120 steps, batch 16 x 64 bytes, lr 3e-3, mean loss of the last 10 steps; data seeds
0 / 1 / 2):

| optimizer | seed 0 | seed 1 | seed 2 |
|---|---|---|---|
| AdamW | 1.639 | 1.817 | 1.762 |
| Adafactor (Trainer settings, no momentum) | 1.619 | 1.699 | 1.711 |
| CAME, `instability_init=1.0` | 1.574 | 1.703 | 1.688 |
| CAME, came-pytorch defaults | 2.035 | 2.216 | 2.039 |

(seed 0 ran 150 steps.) With came-pytorch's zero-initialised instability, matrices step ~11x lr
at first and still ~5x lr after 100 steps (research note §1.7), so at an AdamW-sized lr short
runs overshoot; `instability_init=1.0` removes that and CAME then matches or beats both. The
assertions keep a margin of several times the seed-to-seed spread of the differences.
"""

import math
import pathlib
import sysconfig

import pytest
import torch

from optim_adafactor import Adafactor
from optim_came import CAME

pytest.importorskip("transformers")

STEPS, BATCH, SEQ, LR = 120, 16, 64, 3e-3


def _data() -> torch.Tensor:
    path = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    return torch.tensor(list(path.read_bytes()[:400_000]), dtype=torch.long)


def _train(make_opt, data: torch.Tensor) -> float:
    from leanlm_testing.models import tiny_llama

    model = tiny_llama(seed=0).train()
    opt = make_opt(model.parameters())
    warmup = STEPS // 10

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (STEPS - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        x = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10


@pytest.mark.slow  # ~15 s on an idle 2-core machine, minutes on a loaded one
def test_came_converges_like_adamw_and_adafactor() -> None:
    data = _data()
    adamw = _train(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0), data)
    adafactor = _train(
        lambda p: Adafactor(p, lr=LR, relative_step=False, scale_parameter=False), data
    )
    came = _train(lambda p: CAME(p, lr=LR, instability_init=1.0), data)
    came_default = _train(lambda p: CAME(p, lr=LR), data)
    print(f"adamw {adamw:.4f} adafactor {adafactor:.4f} came {came:.4f} default {came_default:.4f}")
    assert came < adamw + 0.03  # observed 0.06-0.11 below
    assert came < adafactor + 0.05  # observed -0.045 to +0.004
    assert came < 3.0  # it learned (from 5.2 at the start)
    assert came_default > came + 0.2  # the early spike costs 0.35-0.5 at this length
