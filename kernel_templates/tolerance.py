"""The project's tolerance rule, in one place for the tuner's checks, the tests and the benchmarks.

A kernel's error against the fp32 reference (max norm) may be at most ``ERR_FACTOR`` times the error of
PyTorch computing the same thing in the kernel's dtype, plus a small absolute slack: ``ATOL_REL[dtype]``
of the reference's largest magnitude, plus ``ATOL_ABS``. Non-finite values never pass.
"""

from __future__ import annotations

import torch

ERR_FACTOR = 2.0
# Slack relative to the fp32 reference's largest magnitude, by the dtype the kernel computes in. Half
# types round every stored operand; fp32 kernels differ from torch's fp32 only in summation order.
ATOL_REL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}
ATOL_ABS = 1e-5


def atol_for(dtype: torch.dtype, scale: float) -> float:
    """The absolute slack for a kernel computing in ``dtype`` whose reference's largest magnitude is ``scale``."""
    if dtype not in ATOL_REL:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {sorted(str(d) for d in ATOL_REL)}")
    return ATOL_REL[dtype] * scale + ATOL_ABS


def error_bound(torch_err: float, dtype: torch.dtype, ref32: torch.Tensor) -> float:
    """Largest error allowed: ``ERR_FACTOR`` x PyTorch's own error in ``dtype`` + the slack of ``dtype`` for the
    fp32 reference ``ref32``'s largest magnitude."""
    scale = float(ref32.detach().float().abs().max()) if ref32.numel() else 0.0
    return ERR_FACTOR * torch_err + atol_for(dtype, scale)
