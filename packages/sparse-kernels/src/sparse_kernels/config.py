"""`SparsityConfig`: which pattern, which method, which modules."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Method = Literal["magnitude", "wanda", "sparsegpt"]
Granularity = Literal["layer", "row"]

_NM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")

BLOCK_SIZES = (16, 32, 64, 128)
"""Tile edges the block-sparse Triton kernels take (power of two; 128 is the largest whose dW
tile fits registers). Here, in plain Python, so a config check needs no torch."""


@dataclass(frozen=True, kw_only=True)
class Pattern:
    """A parsed sparsity pattern."""

    kind: Literal["unstructured", "nm", "block"]
    """Which structure the zeros follow."""
    n: int = 0
    """N:M only: weights kept in every group of `m` consecutive input features."""
    m: int = 0
    """N:M only: group size along the input dimension."""


def parse_nm(n: int, m: int) -> Pattern:
    """Validate an N:M pair (keep `n` of every `m`) and return the pattern."""
    if m < 1:
        raise ValueError(f"`m` ({m}) must be >= 1 for N:M sparsity")
    if not 0 < n < m:
        raise ValueError(f"`n` ({n}) must satisfy 0 < n < `m` ({m}) for N:M sparsity")
    return Pattern(kind="nm", n=n, m=m)


def parse_pattern(pattern: str) -> Pattern:
    """Parse `"unstructured"`, `"block"` or `"N:M"` (e.g. `"2:4"`: keep 2 of every 4).

    Raises:
        ValueError: for an unknown pattern or an N:M pair with `n >= m` or `n < 1`.
    """
    if pattern in ("unstructured", "block"):
        return Pattern(kind=pattern)  # type: ignore[arg-type]
    match = _NM.match(pattern)
    if match is None:
        raise ValueError(
            f"`pattern` ({pattern!r}) must be 'unstructured', 'block' or 'N:M' such as '2:4'"
        )
    return parse_nm(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True, kw_only=True)
class SparsityConfig:
    """How `sparsify_` prunes a model.

    Example:
        `SparsityConfig(pattern="2:4", method="wanda")` keeps the 2 largest Wanda scores in
        every group of 4 consecutive input features of every targeted `nn.Linear`.
    """

    pattern: str = "unstructured"
    """`"unstructured"`, `"block"` (block_size x block_size tiles) or `"N:M"` (keep N of M)."""
    sparsity: float = 0.5
    """Fraction of zeros for unstructured and block patterns (ignored for N:M: 1 - N/M)."""
    method: Method = "magnitude"
    """Score: `|W|`, Wanda `|W|·‖X_j‖₂`, or SparseGPT (OBS with the calibration Hessian)."""
    block_size: int = 64
    """Tile edge of the block pattern (edge tiles of non-multiple shapes are partial)."""
    granularity: Granularity | None = None
    """Unstructured only: rank scores over the whole `"layer"`, or within each output `"row"`.
    None (default) picks the method's own: `"row"` for Wanda (its paper compares weights per
    output), `"layer"` for magnitude and SparseGPT. Resolved at construction, so the attribute
    always holds `"layer"` or `"row"`."""
    targets: Sequence[str] | None = None
    """Regexes (`re.search`) on qualified module names; default: every `nn.Linear` inside an
    `nn.ModuleList` (the decoder blocks), so embeddings and `lm_head` are never pruned."""
    dampening: float = 0.01
    """SparseGPT: λ = dampening · mean(diag H) added to the Hessian diagonal."""
    sparsegpt_block: int = 128
    """SparseGPT: columns processed per lazy-update block."""

    def __post_init__(self) -> None:
        for name in ("block_size", "sparsegpt_block"):
            check_int(name, getattr(self, name))
        for name in ("sparsity", "dampening"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"`{name}` must be a number, got {value!r}")
        parsed = parse_pattern(self.pattern)
        if parsed.kind != "nm" and not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"`sparsity` ({self.sparsity}) must be in [0, 1)")
        if self.method not in ("magnitude", "wanda", "sparsegpt"):
            raise ValueError(
                f"`method` ({self.method!r}) must be 'magnitude', 'wanda' or 'sparsegpt'"
            )
        if self.granularity is None:
            default = "row" if self.method == "wanda" else "layer"
            object.__setattr__(self, "granularity", default)
        if self.granularity not in ("layer", "row"):
            raise ValueError(f"`granularity` ({self.granularity!r}) must be 'layer' or 'row'")
        if self.block_size < 1:
            raise ValueError(f"`block_size` ({self.block_size}) must be >= 1")
        if self.dampening < 0:
            raise ValueError(f"`dampening` ({self.dampening}) must be >= 0")
        if self.sparsegpt_block < 1:
            raise ValueError(f"`sparsegpt_block` ({self.sparsegpt_block}) must be >= 1")
        check_targets_type(self.targets)

    @property
    def parsed(self) -> Pattern:
        """The parsed pattern."""
        return parse_pattern(self.pattern)

    @property
    def target_sparsity(self) -> float:
        """The fraction of zeros this config produces (N:M: 1 - N/M)."""
        p = self.parsed
        return 1.0 - p.n / p.m if p.kind == "nm" else self.sparsity


def check_int(name: str, value: object) -> None:
    """TypeError naming `name` unless `value` is an integer (not a bool).

    An integer is what `operator.index` takes, as torch's size arguments do: an `int`, a NumPy
    integer scalar or a 0-dim integer tensor (not a float, even an integral one).
    """
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int, got {value!r}")
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {value!r}") from None


def check_targets_type(targets: object) -> None:
    """TypeError if `targets` is a single string (each character would be taken as a regex)."""
    if isinstance(targets, str):
        raise TypeError(
            f"`targets` must be a sequence of regexes, not a single string, got {targets!r}: "
            f"pass [{targets!r}]"
        )
