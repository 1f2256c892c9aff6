"""Qwen3: the Llama-style spec plus per-head q/k RMSNorms.

``q_norm`` / ``k_norm`` normalise each head over its ``head_dim`` with one weight shared by all
heads, so pruning heads or hidden channels leaves them as they are.
"""

from __future__ import annotations

from prune_distill.arch.llama import llama_style

QWEN3 = llama_style("qwen3", qk_norm="head_dim")
