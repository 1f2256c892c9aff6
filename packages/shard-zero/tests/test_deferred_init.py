"""Deferred init: `prepare` a `meta` model from an init function or a Hugging Face checkpoint.

The result must equal the model built normally (same seed) / loaded from the same safetensors,
value for value, and at stage 3 a rank must never hold the whole fp32 model while preparing:
the live bytes of every CPU tensor created inside `prepare` are tracked (a dispatch mode) and
compared with the same measurement of building the model normally.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import shard_zero._deferred as deferred_module
from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama_config
from leanlm_testing.reshard import recording_safe_open
from shard_zero import ZeroConfig, full_state_dict, prepare

LAYERS = 6  # one decoder layer is ~1/7 of the model: room to see "never the whole model"


def _config() -> Any:
    return tiny_llama_config(num_hidden_layers=LAYERS)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference() -> nn.Module:
    """Built normally, then `apply(_init_weights)` under seed 1 (what `init` reproduces)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_config())
    torch.manual_seed(1)
    model.apply(model._init_weights)
    return model


def _meta_model() -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_config())


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the live CPU storages created by ops inside the mode.

    Storages are tracked through weak references (torch keeps a storage's Python object alive
    as long as the storage lives, whichever tensor or parameter holds it), at their current size
    (a stage-3 unit resized to 0 counts 0).
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.storages.setdefault(id(storage), weakref.ref(storage))
        live = {k: r() for k, r in self.storages.items()}
        self.storages = {k: self.storages[k] for k, v in live.items() if v is not None}
        total = sum(v.nbytes() for v in live.values() if v is not None)
        self.peak = max(self.peak, total)
        return out


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs"


def _from_init(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="meta device: pass `init`"):
        prepare(_meta_model(), _adamw)
    with pytest.raises(ValueError, match="`device` is required"):
        prepare(_meta_model(), _adamw, init=lambda module: None)
    with pytest.raises(ValueError, match="`init` is only for a model built on the meta"):
        prepare(_reference(), _adamw, init=lambda module: None)
    want = _reference().state_dict()
    model_bytes = sum(v.numel() * 4 for k, v in want.items() if k != "lm_head.weight")
    for stage, dtype in ((3, None), (3, torch.bfloat16), (2, None)):
        config = ZeroConfig(stage=stage, min_shard_numel=100, param_dtype=dtype)  # type: ignore[arg-type]
        meta = _meta_model()
        torch.manual_seed(1)
        with _LiveBytes() as deferred_peak:
            model, opt = prepare(meta, _adamw, config, init=meta._init_weights, device="cpu")
        # full_state_dict reads the fp32 masters: exact even with bf16 compute weights
        _equal(full_state_dict(model), want, f"stage {stage} {dtype} from init")
        if dtype is not None:
            assert all(p.dtype == dtype for p in model.parameters())
            ids = torch.arange(16).view(2, 8)
            with torch.no_grad():
                assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
        if stage == 3 and dtype is None:
            from transformers import LlamaForCausalLM

            with _LiveBytes() as normal_peak:
                normal = LlamaForCausalLM(_config())
                prepare(normal, _adamw, config)
            if os.environ.get("SHARD_ZERO_PRINT"):
                print(rank, model_bytes, normal_peak.peak, deferred_peak.peak, flush=True)
            # building normally holds the whole fp32 model at least once; deferred never does
            assert normal_peak.peak >= model_bytes, (normal_peak.peak, model_bytes)
            # its fp32 shards (1/world of the model) plus a few modules' temporaries
            bound = model_bytes * (1 / world + 0.25)
            assert deferred_peak.peak < bound, (deferred_peak.peak, model_bytes)
            # and it trains like the model prepared the usual way
            ref, ref_opt = prepare(_reference(), _adamw, config)
            per = 8 // world
            for batch in random_batches(256, batches=2, batch_size=8, seq_len=16, seed=4):
                ids = batch["input_ids"][rank * per : (rank + 1) * per]
                for m, o in ((model, opt), (ref, ref_opt)):
                    m(input_ids=ids, labels=ids).loss.backward()
                    o.step()
                    o.zero_grad()
            _equal(full_state_dict(model), full_state_dict(ref), "after 2 steps")


@pytest.mark.distributed
def test_meta_model_with_init_equals_the_normally_built_one(tmp_path: Path) -> None:
    spawn(_from_init, world_size=2, tmp_path=tmp_path)


def _from_checkpoint(rank: int, world: int, folder: str) -> None:
    want = _reference().state_dict()
    for stage in (3, 1):
        with recording_safe_open(deferred_module) as reads:
            config = ZeroConfig(stage=stage, min_shard_numel=100)  # type: ignore[arg-type]
            model, _ = prepare(_meta_model(), _adamw, config, checkpoint=folder, device="cpu")
        _equal(full_state_dict(model), want, f"stage {stage} from the checkpoint")
        engine = model._shard_zero_engine  # type: ignore[attr-defined]
        for e in engine.entries:
            mine = [rows for _, key, rows, _ in reads if key == e.name]
            assert mine == ([(e.start, e.end)] if e.sharded else [None]), (e.name, mine)


@pytest.mark.distributed
def test_meta_model_from_a_safetensors_folder_reads_only_its_rows(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    _reference().save_pretrained(folder, max_shard_size="100KB")  # several files + an index
    assert (folder / "model.safetensors.index.json").is_file()
    spawn(_from_checkpoint, str(folder), world_size=2, tmp_path=tmp_path)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.arange(4, dtype=torch.int64), persistent=False)


def _weights_only(module: nn.Module) -> None:
    """A hand-written init that (like many) sets the Linear weights only."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)


def test_an_init_that_leaves_a_tensor_unset_raises_naming_it(tmp_path: Path) -> None:
    """Before: what `init` did not write (a LayerNorm/RMSNorm weight, a bias, a buffer its
    constructor computes) kept uninitialised memory, silently (NaN losses at stages 1-3)."""
    from leanlm_testing.distributed import single_process_group

    def full(module: nn.Module, skip: tuple[type, ...] = ()) -> None:
        if isinstance(module, skip):
            return
        _weights_only(module)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        if isinstance(module, _Normed):
            module.scale.copy_(torch.arange(4) * 2)

    cases = {
        "parameter proj.bias \\(4,\\)": _weights_only,
        "parameter norm.weight \\(4,\\)": functools.partial(full, skip=(nn.LayerNorm, _Normed)),
        "buffer scale \\(4,\\)": functools.partial(full, skip=(_Normed,)),
    }
    with single_process_group("cpu", tmp_path):
        for stage in (1, 3):
            for message, init in cases.items():
                with torch.device("meta"):
                    meta = _Normed()
                with pytest.raises(ValueError, match=f"`init` left 4 of 4 elements of {message}"):
                    prepare(meta, _adamw, ZeroConfig(stage=stage), init=init, device="cpu")
            with torch.device("meta"):
                meta = _Normed()
            model, _ = prepare(meta, _adamw, ZeroConfig(stage=stage), init=full, device="cpu")
            got = full_state_dict(model)
            assert torch.equal(got["norm.weight"], torch.ones(4))
            assert torch.equal(got["proj.bias"], torch.zeros(4))
            assert torch.equal(model.scale, torch.arange(4) * 2)


def test_an_init_that_rewrites_its_childrens_parameters_as_apply_does(tmp_path: Path) -> None:
    """Hugging Face's GPT-2 `_init_weights` rescales `c_proj.weight` from `GPT2Attention` and
    `GPT2MLP`, after the `Conv1D`'s own init (as `model.apply` orders them). Before, deferred
    init failed there with torch's "more than one element of the written-to tensor refers to a
    single memory location" (the child's parameter was a placeholder again)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from leanlm_testing.distributed import single_process_group

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)
    reference = GPT2LMHeadModel(config)
    torch.manual_seed(1)
    reference.apply(reference._init_weights)
    want = reference.state_dict()

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(4, 4)

    def partly(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, Parent):
            module.child.weight[0].fill_(2.0)

    with single_process_group("cpu", tmp_path):
        for stage in (1, 3):
            with torch.device("meta"):
                meta = GPT2LMHeadModel(config)
            torch.manual_seed(1)
            config_z = ZeroConfig(stage=stage, min_shard_numel=0)
            model, _ = prepare(meta, _adamw, config_z, init=meta._init_weights, device="cpu")
            got = full_state_dict(model)
            for name, value in want.items():
                assert torch.equal(got[name], value), name
            with torch.device("meta"):
                parent = Parent()
            with pytest.raises(ValueError, match="rewrote 4 of 16 elements of parameter child"):
                prepare(parent, _adamw, config_z, init=partly, device="cpu")
