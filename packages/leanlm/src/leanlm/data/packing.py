"""`[data] packing`: several documents in one window, attention never crossing between them.

Documents are joined with EOS and cut into `seq_len` windows; each document gets position ids
restarting at 0 after every EOS. Given such position ids and no attention mask, transformers 5.x
(`masking_utils.find_packed_sequence_indices`) builds a block-diagonal causal mask for `sdpa`
and `eager` alike, so a token attends only to its own document; the label after each EOS is
-100. `install` adds both through a forward pre-hook, so the loss functions call the model
unchanged.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

IGNORE_INDEX = -100
"""The label transformers' cross-entropy skips."""


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids `(B, T)` that restart at 0 on the token after every `eos_id`.

    E.g. `[a, b, EOS, c, d]` -> `[0, 1, 2, 0, 1]`.
    """
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = input_ids[..., :-1] == eos_id
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def boundary_labels(labels: torch.Tensor, input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`labels` with -100 on every token that follows an `eos_id` (a document's first token).

    transformers shifts labels by one inside its loss, so label t is what position t - 1
    predicts: masking the token after EOS drops the prediction made at the EOS.
    """
    out = labels.clone()
    out[..., 1:] = out[..., 1:].masked_fill(input_ids[..., :-1] == eos_id, IGNORE_INDEX)
    return out


def install(model: torch.nn.Module, eos_id: int) -> RemovableHandle:
    """Make `model(input_ids=..., labels=...)` a packed forward (see the module docstring).

    A document longer than what is left of a window continues in the next one, where it starts
    again at position 0. The label after an EOS (the next document's first token, which the
    previous document cannot predict) is not trained on.

    A call that brings its own `position_ids` or `attention_mask` is left alone.

    Returns:
        The hook's handle (`.remove()` undoes it).
    """

    def pack(
        module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        input_ids = kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor):
            return None
        if kwargs.get("position_ids") is not None or kwargs.get("attention_mask") is not None:
            return None
        kwargs["position_ids"] = document_positions(input_ids, eos_id)
        # the packed mask is built only without a KV cache (a training-style forward)
        kwargs["use_cache"] = False
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor):
            kwargs["labels"] = boundary_labels(labels, input_ids, eos_id)
        return args, kwargs

    return model.register_forward_pre_hook(pack, with_kwargs=True)
