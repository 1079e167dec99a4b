"""PyTorch reference of ``dropout(LayerNorm(x) * u)``: the oracle the fused kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ln_mul_dropout_reference(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dim in fp32, times u, then dropout; returns x's dtype.

    ``keep`` (bool, x's shape) replaces the random dropout mask, so a test can replay the mask a
    fused kernel drew and compare exactly.
    """
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps) * u.float()
    if training and p > 0:
        y = F.dropout(y, p, training=True) if keep is None else torch.where(keep, y / (1.0 - p), torch.zeros_like(y))
    return y.to(x.dtype)
