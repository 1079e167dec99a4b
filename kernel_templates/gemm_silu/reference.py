"""References for ``y = silu(x @ W^T + b)``: the fp32 oracle and PyTorch in the kernel's dtype.

The fp32 oracle is what kernels are judged against; the in-dtype path is what the model runs today
(``F.silu(F.linear(x, W, b))``) and sets the error budget of the project's tolerance rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemm_silu_pre_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The pre-activation ``x @ weight^T + bias``: inputs cast to ``compute_dtype``, one linear."""
    bias = None if bias is None else bias.to(compute_dtype)
    return F.linear(x.to(compute_dtype), weight.to(compute_dtype), bias)


def gemm_silu_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``silu(x @ weight^T + bias)`` computed in ``compute_dtype`` (fp32: upcast inputs first)."""
    return F.silu(gemm_silu_pre_reference(x, weight, bias, compute_dtype))


def gemm_silu_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The unfused baseline the model runs: cuBLAS linear (bias fused) then an elementwise SiLU pass."""
    return F.silu(F.linear(x, weight, bias))


def gemm_silu_flops(m: int, n: int, k: int) -> float:
    """2 M N K: the GEMM's multiply-adds (bias and SiLU are not counted)."""
    return 2.0 * m * n * k


def silu_grad(pre: torch.Tensor) -> torch.Tensor:
    """d silu(p) / dp = s (1 + p (1 - s)) with s = sigmoid(p), in fp32."""
    p = pre.float()
    s = torch.sigmoid(p)
    return s * (1.0 + p * (1.0 - s))
