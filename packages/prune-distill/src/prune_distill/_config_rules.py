"""What a pruned config must say, and why a config class rejects a pruned shape.

Shared by `prune` (which builds the pruned config) and `search` (which counts the parameters of
every candidate shape from such a config): both write `head_dim` under the same rule and explain
the same rejections the same way.
"""

from __future__ import annotations

from typing import Any


def writes_head_dim(config: Any, field: str, hidden: int, heads: int, head_dim: int) -> bool:
    """Whether the pruned config must state `head_dim` (in its field `field`) explicitly.

    Config classes without a `head_dim` field (Phi-3, Granite, OLMo 2, Qwen2 in transformers 5)
    derive it as ``hidden_size // num_attention_heads``; their models read the field when it is
    set. It is left out when the source config has none and the pruned shape derives the same
    value, so a config that needs no `head_dim` gets none (a no-op prune gives an equal config).

    Args:
        config: the source model's config.
        field: the config field holding `head_dim`.
        hidden: the pruned `hidden_size`.
        heads: the pruned number of query heads.
        head_dim: the (unchanged) per-head width.

    Returns:
        True when the source config has the field or the pruned shape would derive another
        value (``hidden != heads * head_dim``).
    """
    return hasattr(config, field) or hidden != heads * head_dim


def _rope_parameters(config: Any) -> dict[str, Any] | None:
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            return value
    return None


def longrope_conflict(config: Any, head_dim: int) -> str | None:
    """Why `config` fails its LongRoPE check although the model (which uses `head_dim`) is fine.

    transformers' `Phi3Config` checks the length of the LongRoPE ``short_factor`` /
    ``long_factor`` lists against ``int(hidden_size // num_attention_heads *
    partial_rotary_factor) // 2``, ignoring `head_dim`, while the lists have one entry per
    rotary frequency of `head_dim`. A pruned shape that changes ``hidden_size /
    num_attention_heads`` is then refused (and `from_pretrained` would refuse it too).

    Args:
        config: the pruned config, with its new `hidden_size` and `num_attention_heads`.
        head_dim: the per-head width the model keeps.

    Returns:
        The explanation and what to prune instead, or None when this is not the cause.
    """
    rope = _rope_parameters(config)
    if rope is None or rope.get("rope_type", rope.get("type")) != "longrope":
        return None
    factors = rope.get("short_factor")
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(factors, list) or not isinstance(hidden, int) or not isinstance(heads, int):
        return None
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else partial
    need = int(head_dim * partial) // 2
    checked = int(hidden // heads * partial) // 2
    if len(factors) != need or checked == need:
        return None
    return (
        f"its LongRoPE `rope_parameters` short_factor / long_factor lists have {need} entries, "
        f"one per rotary frequency of head_dim {head_dim} (int(head_dim x partial_rotary_factor "
        f"{partial}) // 2), but transformers' {type(config).__name__} checks their length "
        f"against hidden_size // num_attention_heads ({hidden} // {heads} = {hidden // heads}, "
        f"which asks for {checked}), not head_dim: prune hidden_size and num_attention_heads "
        f"together so that hidden_size / num_attention_heads stays {head_dim}, or prune only "
        "intermediate_size and num_hidden_layers"
    )
