"""SparseGPT: one-shot pruning with optimal-brain-surgeon weight updates.

Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot"
(arXiv 2301.00774). For a Linear with weight W (rows x cols) and the layer Hessian
H = 2 XᵀX / tokens of its calibration inputs, columns are processed left to right. Removing
weight w_rc (or keeping it) changes the error by w²/[H⁻¹]_cc²; pruning it and compensating the
not-yet-processed columns of the same row with `- (w / [H⁻¹]_cc) · H⁻¹_{c, c:}` is the OBS update,
computed with the upper Cholesky factor of H⁻¹ so each step is one rank-1 update. Columns are
handled in blocks of `blocksize` with lazy updates of the rest of the matrix (a GEMM per block).

Masks: unstructured masks are chosen adaptively per column block (exact total count across
blocks; with `per_row`, exact in every row: each row prunes its share of each block), N:M masks
every `m` columns, block masks once up front from the OBS saliency summed
over tiles (the weight update then follows that fixed mask). All math in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_kernels.config import Pattern
from sparse_kernels.masks import block_mask


def _inverse_cholesky_upper(hessian: Tensor, dampening: float) -> Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, λ = dampening · mean(diag H)."""
    H = hessian.clone()
    damp = dampening * torch.mean(torch.diag(H))
    if float(damp) <= 0:
        damp = torch.tensor(1e-8)
    idx = torch.arange(H.shape[0])
    H[idx, idx] += damp
    L = torch.linalg.cholesky(H)
    Hinv = torch.cholesky_inverse(L)
    upper: Tensor = torch.linalg.cholesky(Hinv, upper=True)
    return upper


@torch.no_grad()
def sparsegpt_prune(
    weight: Tensor,
    hessian: Tensor,
    pattern: Pattern,
    *,
    sparsity: float,
    block_size: int = 64,
    blocksize: int = 128,
    dampening: float = 0.01,
    per_row: bool = False,
) -> tuple[Tensor, Tensor]:
    """Prune `weight` with SparseGPT; return the updated weight (with zeros) and the mask.

    Args:
        weight: (rows, cols) Linear weight (any float dtype; math in fp32).
        hessian: (cols, cols) `2 XᵀX / tokens` of the calibration inputs.
        pattern: unstructured, N:M or block.
        sparsity: fraction of zeros (unstructured / block).
        block_size: tile edge of the block pattern.
        blocksize: columns per lazy-update block.
        dampening: relative diagonal dampening of H.
        per_row: unstructured only: rank within each row, so every row prunes exactly
            `round(sparsity · cols)` (each column block: its share of every row).

    Returns:
        (new_weight in weight's dtype, bool mask), both (rows, cols).
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"`hessian` shape {tuple(hessian.shape)} must be ({cols}, {cols})")
    if pattern.kind == "nm" and cols % pattern.m:
        raise ValueError(
            f"in_features ({cols}) must be a multiple of `m` ({pattern.m}) for "
            f"{pattern.n}:{pattern.m} sparsity"
        )
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    Hinv = _inverse_cholesky_upper(H, dampening)
    dinv = torch.diag(Hinv)

    fixed: Tensor | None = None
    if pattern.kind == "block":
        fixed = block_mask(W.square() / dinv.square()[None, :], block_size, sparsity)
    if pattern.kind == "nm" and blocksize % pattern.m:
        blocksize = max(pattern.m, blocksize - blocksize % pattern.m)
    total_pruned = round(sparsity * rows * cols)
    mask = torch.ones_like(W, dtype=torch.bool)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d1 = torch.diag(Hinv1)
        if fixed is not None:
            keep1 = fixed[:, i1:i2].clone()
        elif pattern.kind == "unstructured":
            score = W1.square() / d1.square()[None, :]
            keep1 = torch.ones_like(W1, dtype=torch.bool)
            if per_row:  # each row prunes round(s·i2) - round(s·i1) here: round(s·cols) in all
                k = min(round(sparsity * i2) - round(sparsity * i1), count)
                if k > 0:
                    low = torch.topk(score, k, dim=1, largest=False, sorted=False).indices
                    keep1.scatter_(1, low, False)
            else:  # exact total: this block prunes round(s·rows·i2) - round(s·rows·i1)
                k = round(sparsity * rows * i2) - round(sparsity * rows * i1)
                k = min(k, total_pruned, rows * count)
                if k > 0:
                    low = torch.topk(score.flatten(), k, largest=False, sorted=False).indices
                    keep1.view(-1)[low] = False
        else:
            keep1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(count):
            if pattern.kind == "nm" and i % pattern.m == 0:
                group = W1[:, i : i + pattern.m].square() / d1[i : i + pattern.m].square()
                top = torch.topk(group, pattern.n, dim=1, sorted=False).indices
                keep1[:, i : i + pattern.m].scatter_(1, top, True)
            w = W1[:, i]
            d = Hinv1[i, i]
            q = torch.where(keep1[:, i], w, torch.zeros_like(w))
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        mask[:, i1:i2] = keep1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    W = W * mask
    return W.to(weight.dtype), mask
