"""The ZeRO paper's model-state formula (Rajbhandari et al., SC'20, arXiv 1910.02054, §5).

Per rank, with Ψ parameters, N data-parallel ranks, P bytes per compute parameter, G = P bytes
per gradient and K bytes of optimizer state per parameter (the fp32 master weight included when
the compute dtype is not fp32):

    data parallel: (P + G + K)Ψ        stage 1 (P_os): (P + G)Ψ + KΨ/N
    stage 2 (P_os+g): PΨ + (G + K)Ψ/N  stage 3 (P_os+g+p): (P + G + K)Ψ/N

Mixed-precision Adam is P = G = 2, K = 12 (16Ψ at N = 1). These are model states only: no
activations, temporaries, communication buffers or gathered units.
"""

from __future__ import annotations

# optimizer state per parameter without the master weight (bytes): AdamW two fp32 moments,
# CAME one fp32 moment (its factored statistics are O(rows + columns)), Adafactor without
# momentum nothing (factored statistics only)
STATE_BYTES = {"adamw": 8, "came": 4, "adafactor": 0}


def optimizer_k(optimizer: str, param_bytes: int) -> int | None:
    """K for `optimizer` at `param_bytes` per compute parameter (None for a custom optimizer)."""
    state = STATE_BYTES.get(optimizer)
    if state is None:
        return None
    return state + (4 if param_bytes < 4 else 0)


def model_state_bytes(*, psi: int, world: int, stage: int, param_bytes: int, k: int) -> float:
    """The paper's per-rank model-state bytes at ZeRO `stage` (0: plain data parallelism)."""
    p = g = param_bytes
    if stage == 0:
        return float((p + g + k) * psi)
    if stage == 1:
        return (p + g) * psi + k * psi / world
    if stage == 2:
        return p * psi + (g + k) * psi / world
    if stage == 3:
        return (p + g + k) * psi / world
    raise ValueError(f"`stage` ({stage}) must be 0, 1, 2 or 3")
