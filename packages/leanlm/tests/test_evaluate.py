import math

import torch

from leanlm.train.evaluate import evaluate_perplexity, window_nll


class FixedLogits(torch.nn.Module):
    """Predicts p = (1/2, 1/4, 1/4) over a 3-token vocabulary at every position."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        logits = torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(*input_ids.shape, 3)

        class Out:
            pass

        out = Out()
        out.logits = logits + self.dummy
        return out


def test_perplexity_matches_a_hand_computed_value():
    # Scored tokens (the first of each window is context only): 1, 2 | 0, 0.
    # Their probabilities: 1/4, 1/4, 1/2, 1/2, so perplexity = (4*4*2*2) ** (1/4) = 2 * sqrt(2).
    windows = torch.tensor([[0, 1, 2], [2, 0, 0]])
    result = evaluate_perplexity(FixedLogits(), windows, batch_size=1)
    assert result.tokens == 4
    assert result.windows == 2
    # The log-softmax runs in fp32 (eps 1.2e-7): 1e-6 relative is a few fp32 ulps.
    assert math.isclose(result.perplexity, 2 * math.sqrt(2), rel_tol=1e-6)
    assert math.isclose(result.loss, (2 * math.log(4) + 2 * math.log(2)) / 4, rel_tol=1e-6)


def test_perplexity_does_not_depend_on_batching():
    torch.manual_seed(0)

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 11)

        def forward(self, input_ids):
            out = type("Out", (), {})()
            out.logits = self.table(input_ids)
            return out

    model = Bigram()
    windows = torch.randint(0, 11, (7, 9))
    a = evaluate_perplexity(model, windows, batch_size=1)
    b = evaluate_perplexity(model, windows, batch_size=4)
    # Per-batch fp32 sums differ only in summation order: a few ulps.
    assert math.isclose(a.perplexity, b.perplexity, rel_tol=1e-6)
    logits = model(windows).logits
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), windows[:, 1:].reshape(-1)
    )
    assert math.isclose(a.loss, expected.item(), rel_tol=1e-6)
    # 7 windows x 8 scored tokens each
    assert math.isclose(window_nll(logits, windows).item(), expected.item() * 56, rel_tol=1e-6)


def test_a_bf16_validation_pass_does_not_keep_every_layers_weight_copy():
    """Autocast would cache each fp32 weight's bf16 copy until the forward ends (all layers)."""
    from leanlm.config import DataConfig, RunConfig
    from leanlm.plan_scoring import evaluate
    from leanlm.plan_tracking import build, fake_tensors, measure
    from leanlm_testing.models import tiny_llama_config

    layers, hidden, ffn = 8, 256, 1024
    cfg = tiny_llama_config(
        vocab_size=64, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers
    )
    layer_bf16 = 2 * (hidden * hidden * 3 + 3 * hidden * ffn)  # q, o, k+v at GQA 4/2; the MLP
    run = RunConfig(mixed_precision="bf16", data=DataConfig(seq_len=8, eval_windows=1))
    with fake_tensors():
        model = build(cfg, torch.float32)  # trainable fp32 weights, as in a training stage

        def step(tracker):
            tracker.phase = "evaluate"
            evaluate(run, model, 1, 64)  # evaluate_perplexity under bf16 autocast

        peaks = measure(step, [model])
    held = peaks["evaluate"]["activations"]  # casts and temporaries
    assert held < 2 * layer_bf16, (held, layer_bf16)  # one weight's copy at a time, not 8 layers'
    assert held > 2 * hidden * hidden  # it did measure the casts (one q_proj copy at least)
