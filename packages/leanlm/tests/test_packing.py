"""`[data] packing`: no token attends across a document boundary, and no label crosses one."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from leanlm.data.packing import boundary_labels, document_positions, install
from leanlm.train.model import llama_config

EOS = 1


def test_positions_restart_after_each_eos_and_boundary_labels_are_ignored():
    ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4], [EOS, 3, 3, 3, 3, EOS, EOS, 2]])
    assert document_positions(ids, EOS).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0],
        [0, 0, 1, 2, 3, 4, 0, 0],
    ]
    assert boundary_labels(ids, ids, EOS).tolist() == [
        [5, 6, EOS, -100, 8, 9, EOS, -100],
        [EOS, -100, 3, 3, 3, EOS, -100, -100],
    ]


@pytest.fixture(scope="module")
def tiny_llama(tiny_config):
    """The tests' tiny model (`leanlm.train.model.llama_config`), 40 tokens, a chosen attention."""

    def make(attention: str) -> LlamaForCausalLM:
        config = llama_config(tiny_config().model, vocab_size=40, bos_id=EOS, eos_id=EOS, pad_id=0)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=attention)
        assert model.config._attn_implementation == attention
        return model

    return make


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("training", [True, False])
def test_a_packed_document_has_the_logits_it_has_alone(tiny_llama, attention, training):
    model = tiny_llama(attention).train(training)
    docs = [torch.tensor([5, 6, 7, EOS]), torch.tensor([8, 9, 10, 11, 12, EOS]), torch.tensor([13])]
    packed = torch.cat(docs)[None]
    alone = [model(input_ids=d[None]).logits[0] for d in docs]
    unmasked = model(input_ids=packed).logits[0]
    handle = install(model, EOS)
    logits = model(input_ids=packed).logits[0]
    start = 0
    for doc, reference in zip(docs, alone, strict=True):
        torch.testing.assert_close(logits[start : start + len(doc)], reference, atol=1e-5, rtol=0)
        start += len(doc)
    # without packing the second document sees the first: its logits are not those of it alone
    assert (unmasked[4:10] - alone[1]).abs().max() > 1e-2
    handle.remove()
    torch.testing.assert_close(model(input_ids=packed).logits[0], unmasked)


def test_the_packed_loss_skips_predicting_a_document_from_the_one_before(tiny_llama):
    model = tiny_llama("sdpa")
    install(model, EOS)
    ids = torch.tensor([[5, 6, 7, EOS, 8, 9, 10, EOS, 13, 14]])
    out = model(input_ids=ids, labels=ids)
    predicted = torch.tensor([0, 1, 2, 4, 5, 6, 8])  # not 3 and 7: the EOS before a document
    expected = F.cross_entropy(out.logits[0, predicted], ids[0, predicted + 1])
    torch.testing.assert_close(out.loss, expected)
