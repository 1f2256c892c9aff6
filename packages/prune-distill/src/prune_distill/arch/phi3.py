"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama-style spec with fused projections.

``qkv_proj`` is ``[q | k | v]`` and ``gate_up_proj`` is ``[gate | up]``, each sliced per part.
Partial rotary embeddings act within ``head_dim``, which pruning keeps (written into the config).
"""

from __future__ import annotations

from prune_distill.arch.llama import llama_style

PHI3 = llama_style("phi3", fused_qkv=True, fused_gate_up=True)
