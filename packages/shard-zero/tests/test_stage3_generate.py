"""Stage 3: Hugging Face `generate` on per-rank prompts that finish at different lengths.

Every stage-3 forward gathers with the other ranks; transformers keeps a finished rank's decoding
loop running (`synced_gpus`) by itself only under DeepSpeed ZeRO-3 / FSDP. Before the fix, the
rank whose prompt reached EOS first left generate while the other waited in its next gather
(until `ZeroConfig.timeout`). Tokens are compared with one process generating each prompt.
"""

from __future__ import annotations

import datetime
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanlm_testing import spawn
from leanlm_testing.distributed import single_process_group
from leanlm_testing.models import tiny_llama
from shard_zero import ZeroConfig, prepare
from shard_zero._generate import install

PROMPTS = [[5, 9, 17, 33, 2, 70], [8, 8, 40, 41, 42, 3]]
NEW = 8
TIMEOUT = 20.0  # seconds: a rank left waiting fails the test instead of hanging


def _model() -> nn.Module:
    """Tiny Llama, untied embeddings (tied, its random init repeats the prompt's last token)."""
    model: nn.Module = tiny_llama(tie_word_embeddings=False)
    return model


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _generate(model: nn.Module, prompt: list[int], eos: int, **kwargs: Any) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return list(out[0].tolist())


def _reference() -> tuple[int, list[list[int]]]:
    """An EOS that ends prompt 0 after 3 new tokens, and each prompt's tokens in one process."""
    model = _model()
    free = _generate(model, PROMPTS[0], eos=255)  # (255: not among its tokens, checked below)
    eos = free[len(PROMPTS[0]) + 2]
    tokens = [_generate(model, p, eos) for p in PROMPTS]
    lengths = [len(t) - len(p) for t, p in zip(tokens, PROMPTS, strict=True)]
    assert lengths == [3, NEW], lengths  # the premise: the ranks finish at different steps
    return eos, tokens


def _record_flags(model: nn.Module) -> list[bool]:
    """Spy on the decoding loop's stop check: the `synced_gpus` each step is run with."""
    seen: list[bool] = []
    check = model._has_unfinished_sequences

    def spy(this_peer_finished: bool, synced_gpus: bool, device: torch.device) -> bool:
        seen.append(synced_gpus)
        return bool(check(this_peer_finished, synced_gpus, device=device))

    model._has_unfinished_sequences = spy
    return seen


def _world_worker(rank: int, world: int, eos: int, want: list[list[int]]) -> None:
    config = ZeroConfig(stage=3, min_shard_numel=0, timeout=TIMEOUT)
    model, _ = prepare(_model(), _sgd, config)
    plain = type(model).generate
    assert inspect.signature(model.generate) == inspect.signature(plain.__get__(model))
    assert model.generate.__doc__ == plain.__doc__
    seen = _record_flags(model)
    # before: rank 1 failed after TIMEOUT in the gather of 'model.layers.0' (rank 0 had left)
    assert _generate(model, PROMPTS[rank], eos) == want[rank]
    assert seen == [True] * (NEW + 1), seen  # every rank runs the longest rank's steps
    seen.clear()
    assert _generate(model, PROMPTS[rank], eos, synced_gpus=None) == want[rank]
    assert seen == [True] * (NEW + 1), seen  # None: "transformers decides" -> on here
    seen.clear()
    # an explicit False (Seq2SeqTrainer's outside DeepSpeed / FSDP) runs synced, with a warning;
    # before: passed on, and rank 1 waited in its next gather until TIMEOUT
    with pytest.warns(UserWarning, match=r"synced_gpus=False given to generate\(\).*stage-3"):
        assert _generate(model, PROMPTS[rank], eos, synced_gpus=False) == want[rank]
    assert seen == [True] * (NEW + 1), seen
    stage2, _ = prepare(_model(), _sgd, ZeroConfig(stage=2))
    assert "generate" not in vars(stage2)  # stages 1-2: forwards do not communicate


def test_stage3_generate_waits_for_the_rank_that_finishes_last(tmp_path: Path) -> None:
    eos, tokens = _reference()
    spawn(_world_worker, eos, tokens, world_size=2, tmp_path=tmp_path)


def _subgroup_worker(rank: int, world: int, eos: int, want: list[list[int]]) -> None:
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT))
    if rank == 2:
        return  # outside the group: never calls generate (nor any collective of its loop)
    model, _ = prepare(_model(), _sgd, ZeroConfig(stage=3, min_shard_numel=0), group=group)
    engine_group = model._shard_zero_engine.group  # type: ignore[attr-defined]
    groups = []
    all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        # transformers' own stop check all-reduces over the default group, which rank 2 never
        # joins: fail at once instead of waiting for the default group's 30-minute timeout
        assert group is not None, "the stop flag was all-reduced over the default group"
        groups.append(group)
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = spy
    try:
        assert _generate(model, PROMPTS[rank], eos) == want[rank]
    finally:
        dist.all_reduce = all_reduce
    assert groups == [engine_group] * (NEW + 1), groups


def test_stage3_generate_over_a_subgroup_syncs_on_that_group(tmp_path: Path) -> None:
    eos, tokens = _reference()
    spawn(_subgroup_worker, eos, tokens, world_size=3, tmp_path=tmp_path)


def test_stage3_generate_at_world_one_is_left_as_is(tmp_path: Path) -> None:
    eos, want = _reference()
    with single_process_group("cpu", tmp_path):
        model, _ = prepare(_model(), _sgd, ZeroConfig(stage=3, min_shard_numel=0))
        assert "generate" not in vars(model)
        assert _generate(model, PROMPTS[0], eos) == want[0]


def test_a_subgroup_needs_the_stop_check_it_can_move_off_the_default_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `install` called as for a 2-rank subgroup of this 1-rank world: with transformers' stop
    # check in the expected form, `generate` and the check move to the group; in another form
    # (a future transformers) the flag would go to the default group: nothing is installed
    from transformers import GenerationMixin

    with single_process_group("cpu", tmp_path):
        model = _model()
        install(model, None, 2, torch.device("cpu"))
        assert {"generate", "_has_unfinished_sequences"} <= set(vars(model))

        def renamed(self: Any, finished: bool, synced_gpus: bool, device: Any) -> bool:
            return not finished

        monkeypatch.setattr(GenerationMixin, "_has_unfinished_sequences", renamed)
        model = _model()
        install(model, None, 2, torch.device("cpu"))
        assert not {"generate", "_has_unfinished_sequences"} & set(vars(model))
