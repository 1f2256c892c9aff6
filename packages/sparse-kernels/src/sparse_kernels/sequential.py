"""Layer-by-layer calibration: one decoder layer's statistics in memory at a time.

The sequential pass of SparseGPT (Frantar & Alistarh, arXiv 2301.00774, §3 and the reference
`llama.py`) and Wanda (Sun et al., arXiv 2306.11695, `prune_wanda`):

1. run the model on every calibration batch with each decoder layer's forward replaced by a
   stub that records its call: the hidden states layer 0 receives, and every layer's keyword
   arguments (attention mask, which may differ per layer for sliding-window layers, position
   ids, the rotary `position_embeddings` the model computes once and hands to every layer);
   the stubs compute nothing and the forward stops at the last layer that is pruned;
2. for each layer in order: hook its targeted Linears, run the layer on every batch's hidden
   states to accumulate their input statistics (Hessian XᵀX for SparseGPT, ‖X_j‖² for Wanda),
   prune its Linears one by one (SparseGPT also updates the kept weights) and free each one's
   statistics as soon as it is pruned;
3. run the layer again, now pruned, on the same hidden states: its outputs replace them as the
   next layer's inputs (recomputed after pruning, as both references do), so every layer is
   scored on the inputs the already-pruned layers before it produce.

All Linears of one layer are scored from one pass of that layer on its (upstream-pruned) inputs:
`o_proj` and `down_proj` see the outputs of the dense `q/k/v` and `gate/up` of the same layer,
as in the SparseGPT and Wanda references (GPTQ's `--true-sequential` would re-run the layer
between sub-blocks; it is not implemented).

Memory beyond the model: the hidden states of all calibration batches (samples x seq x hidden in
the model's dtype), one batch's layer output, the layers' keyword arguments (the same objects
for every layer in most models) and the statistics of one layer's Linears (Σ in² fp32 for
SparseGPT), never all layers'. Everything stays on the
model's device (no CPU offload of layers).

Supported layouts: decoder layers at `model.model.layers` (Hugging Face Llama-style causal LMs;
tested with Llama, and Qwen2 with sliding-window layers) or `model.layers` (their base models),
called as
`layer(hidden_states, **kwargs)` and returning the hidden states (or a tuple that starts with
them, as transformers 4.x layers do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sparse_kernels.calibration import (
    InputStats,
    TokenMask,
    check_batch,
    real_tokens,
    record_input_stats,
    to_device,
)

LAYER_PATHS = ("model.layers", "layers")
"""Where `decoder_layers` looks for the `nn.ModuleList` of decoder layers, in order."""

PruneFn = Callable[[str, nn.Linear, InputStats], None]
Call = tuple[tuple[Any, ...], dict[str, Any]]
"""A layer call's positional arguments after the hidden states, and its keyword arguments."""


class _ReachedLayerError(Exception):
    """Raised by the last layer's stub to stop the model's forward once the calls are recorded."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The qualified name and `nn.ModuleList` of `model`'s decoder layers.

    Raises:
        ValueError: if none of `LAYER_PATHS` is a non-empty `nn.ModuleList`; the message names
            the model class and `config.model_type`.
    """
    for path in LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return path, obj
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    raise ValueError(
        f"sequential pruning needs the decoder layers as an nn.ModuleList at "
        f"{' or '.join(f'`model.{p}`' for p in LAYER_PATHS)} (Hugging Face Llama-style causal "
        f"LMs such as Llama, Mistral, Qwen2); {type(model).__name__} "
        f"(model_type={model_type!r}) has neither: prune it with `sequential=False`"
    )


def _layer_of(names: Iterable[str], prefix: str, count: int) -> dict[int, list[str]]:
    """Layer index -> qualified names under `prefix.<index>.`; error for names outside."""
    by_layer: dict[int, list[str]] = {}
    outside = []
    for name in names:
        head, _, _rest = name.removeprefix(prefix + ".").partition(".")
        if not name.startswith(prefix + ".") or not head.isdigit() or int(head) >= count:
            outside.append(name)
            continue
        by_layer.setdefault(int(head), []).append(name)
    if outside:
        raise ValueError(
            f"sequential pruning prunes Linears inside the decoder layers (`{prefix}.N.`) only; "
            f"`targets` also selects {sorted(outside)}: drop them from `targets` or use "
            f"`sequential=False`"
        )
    return by_layer


def _call(layer: nn.Module, hidden: Tensor, call: Call) -> Tensor:
    args, kwargs = call
    out = layer(hidden, *args, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    assert isinstance(out, Tensor), f"decoder layer returned {type(out).__name__}"
    return out


def capture_layer_calls(
    model: nn.Module, layers: Sequence[nn.Module], calibration: Iterable[Mapping[str, Any]]
) -> tuple[list[Tensor], list[list[Call]], list[Tensor | None]]:
    """Per batch: the hidden states `layers[0]` receives, every layer's arguments, its tokens.

    The tokens are the batch's real positions (`calibration.real_tokens`).

    Each layer's `forward` is replaced, for the duration, by a stub that records its call and
    returns the hidden states unchanged, and the last one stops the model's forward: no layer
    computes anything and no logits are made. Layers get their own arguments (models such as
    Qwen2 or Gemma hand sliding-window layers a different attention mask); most models pass
    every layer the same objects, so this holds no extra memory. A KV cache is dropped
    (`past_key_values=None`, `use_cache=False`): layers are re-run and must not append to it.

    Returns:
        (hidden states per batch, per batch the `(args, kwargs)` of each layer in order, per
        batch its (batch, seq) real-token mask or None).

    Raises:
        ValueError: if `calibration` yields no batch or a non-mapping, or the forward of a batch
            does not call each of `layers` once.
    """
    device = next(model.parameters()).device
    hidden: list[Tensor] = []
    calls: list[list[Call]] = []
    real: list[Tensor | None] = []

    def stub(index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            kw = dict(kwargs)
            h = args[0] if args else kw.pop("hidden_states")
            for key in ("past_key_values", "past_key_value"):
                if key in kw:
                    kw[key] = None
            if "use_cache" in kw:
                kw["use_cache"] = False
            if index == 0:
                hidden.append(h.detach())
            calls[-1].append((tuple(args[1:]), kw))
            if index == len(layers) - 1:
                raise _ReachedLayerError
            return h

        return forward

    saved = [layer.__dict__.get("forward") for layer in layers]  # e.g. accelerate's wrapper
    for index, layer in enumerate(layers):
        layer.forward = stub(index)
    try:
        for i, batch in enumerate(calibration):
            calls.append([])
            kwargs = to_device(check_batch(batch), device)
            real.append(real_tokens(kwargs))
            with contextlib.suppress(_ReachedLayerError):
                model(**kwargs)
            if len(hidden) != i + 1 or len(calls[i]) != len(layers):
                raise ValueError(
                    f"calibration batch {i}: the forward of {type(model).__name__} called "
                    f"{len(calls[i])} of its first {len(layers)} decoder layers once each; "
                    f"check the batch keys ({sorted(batch)})"
                )
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
    if not hidden:
        raise ValueError("`calibration` yielded no batch")
    return hidden, calls, real


@torch.no_grad()
def prune_sequential_(
    model: nn.Module,
    modules: Mapping[str, nn.Linear],
    calibration: Iterable[Mapping[str, Any]],
    prune: PruneFn,
    *,
    hessian: bool,
) -> None:
    """Walk the decoder layers in order and call `prune(name, linear, stats)` for each target.

    Args:
        model: a Llama-style Hugging Face causal LM (see `decoder_layers`).
        modules: qualified name -> Linear to prune; all inside the decoder layers.
        calibration: iterable of dicts of model kwargs (`input_ids`, `attention_mask`, ...).
        prune: called once per Linear, in layer order, with the statistics of its inputs given
            the already-pruned layers before it; it prunes the Linear in place.
        hessian: also accumulate XᵀX (SparseGPT); otherwise only ‖X_j‖² (Wanda).

    Raises:
        ValueError: for an unsupported model layout, targets outside the decoder layers, or bad
            calibration batches.
    """
    prefix, layers = decoder_layers(model)
    by_layer = _layer_of(modules, prefix, len(layers))
    was_training = model.training
    model.eval()
    try:
        last = max(by_layer, default=-1)
        hidden, calls, real = capture_layer_calls(model, list(layers)[: last + 1], calibration)
        tokens = TokenMask()
        for index in range(last + 1):
            layer = layers[index]
            names = by_layer.get(index, [])
            if names:
                targets = {n: modules[n] for n in names}
                with record_input_stats(targets, hessian=hessian, tokens=tokens) as st:
                    for h, batch_calls, batch_real in zip(hidden, calls, real, strict=True):
                        tokens.current = batch_real  # padded positions are left out
                        _call(layer, h, batch_calls[index])
                missing = [name for name in names if st[name].tokens == 0]
                if missing:
                    raise ValueError(
                        f"no calibration token reached {', '.join(missing)} when layer {index} "
                        f"ran on its inputs; leave them out of `targets` or check the batches "
                        f"(layers before {index} are already pruned)"
                    )
                for name in names:
                    prune(name, modules[name], st.pop(name))  # freed as soon as it is used
            if index < last:
                for b, batch_calls in enumerate(calls):
                    hidden[b] = _call(layer, hidden[b], batch_calls[index])
    finally:
        model.train(was_training)
