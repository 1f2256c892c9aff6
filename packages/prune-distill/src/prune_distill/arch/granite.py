"""Granite: the Llama-style spec as is.

Its ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` and
``logits_scaling`` are config constants that depend on no pruned size, so they are kept.
"""

from __future__ import annotations

from prune_distill.arch.llama import llama_style

GRANITE = llama_style("granite")
