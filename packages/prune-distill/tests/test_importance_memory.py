"""What importance scoring holds in memory: one layer's activations at a time, plus running sums.

`LiveBytes` counts the bytes of every tensor storage created while it is active and alive (until
the storage is freed); the model's weights and the calibration inputs exist before and are not
counted. Two checks, each of which a lazy implementation fails:

* going from 2 to 8 layers adds at most the running sums of 6 more layers (a few per-channel
  fp64 vectors); keeping any per-layer activation until the end would add 6 x (B, S, ...) tensors;
* the peak is that of one forward pass (and, with the LM-loss layer metric, its loss): the
  logits (tokens x vocabulary) of a pass are gone before the next pass starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from leanlm_testing.memory import LiveBytes
from prune_distill import collect_importance, contiguous_block_search
from prune_distill.importance import _token_nll, lm_targets

FFN = 512
BATCH, SEQ = 2, 64


def _peak(make: Callable[..., Any], data: Callable[..., Any], run: Callable[..., Any], **kw: Any):
    model = make("llama", num_hidden_layers=kw.pop("layers", 2), intermediate_size=FFN, **kw)
    batches = data(2, batch_size=BATCH, seq_len=SEQ)
    inputs = [b["input_ids"] for b in batches]
    mode = LiveBytes()
    for t in [*model.parameters(), *model.buffers(), *inputs]:
        mode.ignore(t)
    with mode, torch.no_grad():
        run(model, batches)
    return mode.peak, model.config


def _sums_per_layer(config: Any) -> int:
    """Bytes of one layer's running sums: fp64 s1 and s2 per MLP neuron, per head and per channel
    of each of its 2 norms, a row count per aggregator group, its cosine and skipped-layer sums."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    return 8 * (2 * FFN + 1 + 2 * heads + 1 + 2 * (2 * hidden + 1) + 1 + 2)


def test_peak_grows_with_depth_by_the_running_sums_only(make, data):
    for layer_loss in (False, True):

        def run(model: Any, batches: list[dict], layer_loss: bool = layer_loss) -> None:
            collect_importance(model, batches, layer_loss=layer_loss)

        shallow, config = _peak(make, data, run, layers=2)
        deep, _ = _peak(make, data, run, layers=8)
        # one fp32 (B, S, FFN) activation kept per layer would add 6 x 256 KiB here
        assert 0 < deep - shallow <= 6 * _sums_per_layer(config) + 1024, (layer_loss, shallow, deep)


def test_logits_do_not_outlive_their_pass(make, data):
    vocab = 4096  # the logits (2 x 64 x 4096 fp32 = 2 MiB) dominate this model's passes
    logits_bytes = BATCH * SEQ * vocab * 4

    def forward(model: Any, batches: list[dict]) -> None:
        model(**batches[0], use_cache=False)

    def forward_and_loss(model: Any, batches: list[dict]) -> None:
        _token_nll(model(**batches[0], use_cache=False).logits, lm_targets(batches[0]))

    def scoring(model: Any, batches: list[dict]) -> None:
        collect_importance(model, batches, layer_loss=False)

    def scoring_with_loss(model: Any, batches: list[dict]) -> None:
        collect_importance(model, batches, layer_loss=True)

    def block_search(model: Any, batches: list[dict]) -> None:
        contiguous_block_search(model, batches, 1)

    one_forward, config = _peak(make, data, forward, vocab_size=vocab)
    one_loss, _ = _peak(make, data, forward_and_loss, vocab_size=vocab)
    assert one_loss > 2 * logits_bytes  # the loss's copies of the logits are counted
    sums = 2 * _sums_per_layer(config)
    # keeping the previous batch's logits (without the loss) or the full model's logits during
    # the skipped-layer passes (with it) adds 2 MiB
    for run, reference in (
        (scoring, one_forward),
        (scoring_with_loss, one_loss),
        (block_search, one_loss),
    ):
        peak, _ = _peak(make, data, run, vocab_size=vocab)
        assert peak <= reference + sums + logits_bytes // 8, (run.__name__, peak, reference)
