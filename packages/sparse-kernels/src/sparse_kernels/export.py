"""Saving sparsified models: a plain Hugging Face checkpoint, and a compact safetensors file.

* `save_pretrained_sparse(model, path)`: `model.save_pretrained(path)` with the masks baked in
  (dense weights with exact zeros; `from_pretrained` reloads it, no sparse_kernels needed),
  plus `sparse_masks.safetensors` (bit-packed masks) and `sparsity.json`, so
  `load_masks_(model, path)` can re-attach the masks for sparse fine-tuning.
* `save_compressed(model, path)` / `load_compressed_(model, path)`: one safetensors file where
  each masked weight is stored as 2:4 values + int16 metadata (when its mask is 2:4) or as a
  bitmask + the kept values; other tensors dense. Loading restores the weights (equal in value;
  pruned entries come back as +0.0, where a masked weight may hold -0.0) and the masks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from sparse_kernels.semi24 import compress_24, decompress_24, mask_24
from sparse_kernels.sparsify import apply_mask_, masks, remove_masks_, stored_weight

MASKS_FILE = "sparse_masks.safetensors"
ALIASES_KEY = "sparse_kernels_aliases"
"""Metadata key of `save_compressed`: tied keys stored once (alias -> stored key)."""
INFO_FILE = "sparsity.json"
_BITS = 2 ** torch.arange(8, dtype=torch.int32)


def pack_bits(mask: Tensor) -> Tensor:
    """Boolean tensor -> uint8 bitmask (8 entries per byte, little-endian bit order)."""
    flat = mask.reshape(-1).to(torch.int32).cpu()
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) * _BITS).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """Inverse of `pack_bits`."""
    numel = 1
    for s in shape:
        numel *= s
    bits = (packed.to(torch.int32)[:, None] & _BITS) != 0
    return bits.reshape(-1)[:numel].view(*shape)


def _weight_key(name: str) -> str:
    """State-dict key of the weight of the module `name` (`""`: the root module itself)."""
    return f"{name}.weight" if name else "weight"


def check_no_block_sparse(model: nn.Module, what: str) -> None:
    """ValueError naming every `BlockSparseLinear` of `model` (`what` cannot handle them).

    Their tiles are not `nn.Linear` weights: `to_masked_linear_(model)` turns them back into
    masked Linears (exactly), which every export function handles.
    """
    module = sys.modules.get("sparse_kernels.block_sparse")  # no such layer before its import
    if module is None:
        return
    found = [
        n or "<root>" for n, m in model.named_modules() if isinstance(m, module.BlockSparseLinear)
    ]
    if found:
        raise ValueError(
            f"`{what}` does not handle BlockSparseLinear layers ({', '.join(found)}): call "
            f"`to_masked_linear_(model)` first (exact: same masks and weights)"
        )


def dense_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` with masked weights baked in under their plain `*.weight` keys.

    Only the masks' parametrizations are replaced: another one (e.g. `weight_norm`, as in
    Wav2Vec2's positional convolution) keeps its keys, as `save_pretrained` writes them.
    """
    found = masks(model)
    ours = tuple(f"{name}.parametrizations.weight." if name else "parametrizations.weight."
                 for name in found)  # fmt: skip
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith(ours):
            continue
        out[key] = value
    for name in found:
        weight = model.get_submodule(name).weight
        assert isinstance(weight, Tensor)
        out[_weight_key(name)] = weight.detach()
    return out


def save_pretrained_sparse(model: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """`model.save_pretrained(path)` with masks baked in, plus the masks and `sparsity.json`.

    Args:
        model: a Hugging Face `PreTrainedModel` (possibly sparsified with `sparsify_`).
        path: output directory.
        **kwargs: forwarded to `save_pretrained`.

    Raises:
        ValueError: naming the `BlockSparseLinear` layers of `model` (call `to_masked_linear_`).
    """
    check_no_block_sparse(model, "save_pretrained_sparse")
    path = Path(path)
    model.save_pretrained(path, state_dict=dense_state_dict(model), **kwargs)
    found = masks(model)
    save_file({name: pack_bits(m) for name, m in found.items()}, str(path / MASKS_FILE))
    info = {
        "format": "sparse-kernels/v1",
        "masks": {
            name: {"shape": list(m.shape), "sparsity": 1.0 - float(m.float().mean())}
            for name, m in found.items()
        },
    }
    (path / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def load_masks_(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Re-attach the masks saved by `save_pretrained_sparse`; returns them.

    Use after `from_pretrained` to continue sparse fine-tuning with the same masks.
    """
    check_no_block_sparse(model, "load_masks_")
    path = Path(path)
    info = json.loads((path / INFO_FILE).read_text())
    packed = load_file(str(path / MASKS_FILE))
    out = {}
    for name, meta in info["masks"].items():  # every layer checked before any mask is attached
        _masked_linear(model, name, tuple(meta["shape"]), path)
        out[name] = unpack_bits(packed[name], tuple(meta["shape"]))
    for name, mask in out.items():
        apply_mask_(model.get_submodule(name), mask)  # type: ignore[arg-type]
    return out


def _masked_linear(model: nn.Module, name: str, shape: tuple[int, ...], path: Path) -> nn.Linear:
    """The `nn.Linear` `name` of `model` with a weight of `shape`, else a ValueError."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Linear):
        what = "no such module" if module is None else type(module).__name__
        raise ValueError(
            f"{path} has a mask for {name or '<root>'!r}, which in `model` is {what}, not an "
            "nn.Linear: load the masks into the architecture they were saved from"
        )
    weight = (module.out_features, module.in_features)
    if weight != shape:
        raise ValueError(
            f"{path} has a mask of shape {shape} for {name or '<root>'!r}, whose weight in "
            f"`model` is {weight}: load the masks into the architecture they were saved from"
        )
    return module


def _is_24_mask(mask: Tensor) -> bool:
    if mask.dim() != 2 or mask.shape[1] % 4:
        return False
    return bool((mask.reshape(mask.shape[0], -1, 4).sum(-1) == 2).all())


def save_compressed(model: nn.Module, path: str | os.PathLike[str]) -> int:
    """Write `model` (masks included) to one compact safetensors file; returns its size in bytes.

    Masked weights with a 2:4 mask: `{key}.values24` (rows, cols/2) + `{key}.meta24` int16;
    other masked weights: `{key}.bitmask` uint8 + `{key}.kept` (kept values, row-major).
    Tied tensors (e.g. `lm_head.weight` sharing the input embedding) are stored once; the other
    keys are recorded as aliases in the file's metadata and restored by `load_compressed_`.

    Raises:
        ValueError: naming the `BlockSparseLinear` layers of `model` (call `to_masked_linear_`).
    """
    check_no_block_sparse(model, "save_compressed")
    state = dense_state_dict(model)
    found = {_weight_key(name): m for name, m in masks(model).items()}
    tensors: dict[str, Tensor] = {}
    formats: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first_key: dict[tuple[Any, ...], str] = {}
    for key, tensor in state.items():
        identity = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and identity in first_key:  # the same memory under another key
            aliases[key] = first_key[identity]
            continue
        first_key[identity] = key
        value = tensor.detach().cpu()
        mask = found.get(key)
        if mask is None:
            tensors[key] = value.contiguous().clone()
            continue
        mask = mask.cpu()
        if _is_24_mask(mask):
            values, meta = compress_24(value, mask=mask)
            tensors[f"{key}.values24"] = values
            tensors[f"{key}.meta24"] = meta
            formats[key] = {"format": "2:4", "shape": list(value.shape)}
        else:
            tensors[f"{key}.bitmask"] = pack_bits(mask)
            tensors[f"{key}.kept"] = value[mask].contiguous()
            formats[key] = {"format": "bitmask", "shape": list(value.shape)}
    metadata = {"sparse_kernels": json.dumps(formats), ALIASES_KEY: json.dumps(aliases)}
    save_file(tensors, str(path), metadata=metadata)
    return os.path.getsize(path)


@torch.no_grad()
def load_compressed_(
    model: nn.Module, path: str | os.PathLike[str], *, apply_masks: bool = True
) -> dict[str, Tensor]:
    """Load a `save_compressed` file into `model` (same architecture); returns the masks.

    Existing masks on `model` are removed first; with `apply_masks` the saved masks are
    attached again (the weights equal the saved model's in value either way; pruned entries
    come back as +0.0, where a masked weight may hold -0.0).

    Raises:
        ValueError: naming the `BlockSparseLinear` layers of `model` (call `to_masked_linear_`).
    """
    from safetensors import safe_open

    check_no_block_sparse(model, "load_compressed_")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    formats = json.loads(metadata.get("sparse_kernels", "{}"))
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    tensors = load_file(str(path))
    remove_masks_(model)
    state: dict[str, Tensor] = {}
    found: dict[str, Tensor] = {}
    for key, value in tensors.items():
        base = key.rsplit(".", 1)[0]
        if base not in formats:
            state[key] = value
    for key, fmt in formats.items():
        shape = tuple(fmt["shape"])
        if fmt["format"] == "2:4":
            meta = tensors[f"{key}.meta24"]
            state[key] = decompress_24(tensors[f"{key}.values24"], meta, shape[1])
            found[key] = mask_24(meta, shape[1])
        else:
            mask = unpack_bits(tensors[f"{key}.bitmask"], shape)
            kept = tensors[f"{key}.kept"]
            weight = kept.new_zeros(shape)
            weight[mask] = kept
            state[key] = weight
            found[key] = mask
    for key, original in aliases.items():
        state[key] = state[original]
    # a masked weight tied to an unmasked one (an LM head masked on purpose, tied to the input
    # embedding): the shared Parameter holds the unmasked values, only the head's view is masked
    tied = _tied_unmasked(model, found, state)
    for key, other in tied.items():
        state[key] = state[other]
    model.load_state_dict(state)
    out = {}
    for key, mask in found.items():
        name = "" if key == "weight" else key.removesuffix(".weight")
        if apply_masks:
            module = _masked_linear(model, name, tuple(mask.shape), Path(path))
            apply_mask_(module, mask)
            if key in tied:  # `apply_mask_` zeroed the shared values outside the mask
                stored_weight(module).copy_(state[tied[key]])
        out[name] = mask
    return out


def _tied_unmasked(
    model: nn.Module, found: dict[str, Tensor], state: dict[str, Tensor]
) -> dict[str, str]:
    """Masked weight key -> an unmasked key of `state` sharing its Parameter in `model`."""
    keys: dict[int, list[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(key)
    out = {}
    for group in keys.values():
        plain = [k for k in group if k not in found and k in state]
        for key in group:
            if key in found and plain:
                out[key] = plain[0]
    return out
