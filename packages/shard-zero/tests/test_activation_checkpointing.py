"""Activation checkpointing under every stage, world 2, against one process without it.

Two forms: Hugging Face's (`gradient_checkpointing_enable`, non-reentrant; transformers 5
checkpoints inside the decoder layer's call, so the unit's hooks run once) and a model whose
forward calls `torch.utils.checkpoint.checkpoint(layer, h)` itself (older transformers, many
custom models): recomputing the layer in backward then runs its forward hooks again, and at
stage 3 the unit must stay gathered for its backward (not be freed by the post-forward hook,
not be gathered a third time). Checked on the updates after 3 steps and by counting the
stage-3 parameter all-gathers.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from leanlm_testing import spawn
from leanlm_testing.models import random_batches, tiny_llama
from shard_zero import ZeroConfig, full_state_dict, memory_stats, prepare

GLOBAL_BATCH = 4
LAYERS = 3


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class _Net(nn.Module):
    """Embedding, `LAYERS` MLP blocks (checkpointed by the forward itself if asked), a head."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(256, 32)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32)) for _ in range(LAYERS)
        )
        self.head = nn.Linear(32, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            if self.checkpointing:
                h = h + checkpoint(layer, h, use_reentrant=False)
            else:
                h = h + layer(h)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss)


def _model(kind: str, checkpointing: bool) -> nn.Module:
    if kind == "net":
        return _Net(checkpointing)
    model = tiny_llama(seed=0, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    model.train()  # Hugging Face checkpoints only in training mode
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _reference(kind: str, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    model = _model(kind, checkpointing=False)
    opt = _adamw(list(model.parameters()))
    for batch in batches:
        model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> None:
    for kind in ("hf", "net"):
        _check(rank, world, kind)


def _check(rank: int, world: int, kind: str) -> None:
    batches = random_batches(256, batches=3, batch_size=GLOBAL_BATCH, seq_len=16, seed=5)
    init = {n: p.detach().clone() for n, p in _model(kind, False).named_parameters()}
    ref = _reference(kind, batches)
    per = GLOBAL_BATCH // world
    for stage in (1, 2, 3):
        config = ZeroConfig(stage=stage, min_shard_numel=100)  # type: ignore[arg-type]
        model, opt = prepare(_model(kind, checkpointing=True), _adamw, config)
        gathers: list[int] = []
        for batch in batches:
            ids = batch["input_ids"][rank * per : (rank + 1) * per]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            comm: dict[str, Any] = memory_stats(model, opt)["communication"]
            gathers.append(comm.get("all_gather", {}).get("calls", 0))
            opt.zero_grad()
        if stage == 3:  # root once, every layer twice (forward, backward): no third gather
            # (`prepare`'s own all-gathers are not counted in the first step)
            assert gathers == [1 + 2 * LAYERS] * 3, (kind, gathers)
            engine = model._shard_zero_engine  # type: ignore[attr-defined]
            assert all(u.full.untyped_storage().nbytes() == 0 for u in engine.units)
        got = full_state_dict(model)
        for name, final in ref.items():
            d_ref = (final - init[name]).double()
            d_got = got[name].double() - init[name].double()
            err = float((d_got - d_ref).norm() / d_ref.norm())
            assert err < 1e-4, f"{kind}, stage {stage}: {name}: relative update error {err:.3g}"


def test_activation_checkpointing_matches_one_process(tmp_path: Path) -> None:
    spawn(_worker, world_size=2, tmp_path=tmp_path)
