"""Triton start-up shared by the kernel modules: is Triton installed, is the interpreter on."""

from __future__ import annotations

import importlib.util
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""TRITON_INTERPRET=1 at import: kernels run on CPU tensors and upcast loads to fp32."""
HAS_TRITON = importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device` (CUDA, or CPU under the interpreter)."""
    return HAS_TRITON and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))
