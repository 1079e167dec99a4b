"""PyTorch LayerNorm forward/backward (fp32 statistics): the oracle and the ``torch`` backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernel_templates.config_base import JsonConfig


@dataclass(frozen=True)
class TorchLayerNormConfig(JsonConfig):
    """The PyTorch composition has nothing to tune: one config."""

    kind: ClassVar[str] = "layer_norm_torch"


def layer_norm_reference(x, weight, bias, eps, compute_dtype=torch.float32, out_dtype=None):
    """(y, mean, rstd) computed in ``compute_dtype`` (fp32: the oracle)."""
    xf = x.to(compute_dtype)
    mean = xf.float().mean(-1)
    rstd = torch.rsqrt(xf.float().var(-1, unbiased=False) + eps)
    y = F.layer_norm(xf, (x.shape[-1],), weight.to(compute_dtype), bias.to(compute_dtype), eps)
    return y.to(out_dtype or x.dtype), mean, rstd


def layer_norm_fwd_torch(x, weight, bias, eps, *, config=None, out_dtype=None, out=None):
    """The ``torch`` backend: F.layer_norm in fp32, cast to ``out_dtype``."""
    y, mean, rstd = layer_norm_reference(x, weight, bias, eps, torch.float32, out_dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y, mean, rstd


def layer_norm_bwd_torch(
    dy, x, weight, bias, mean, rstd, *, config=None, residual_grad=None, residual_grad_sum=False, out=None
):
    """The ``torch`` backend: the LayerNorm gradient from the saved statistics, in fp32 (``residual_grad_sum``:
    a 4th result, residual_grad's fp32 column sum)."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    g = dy.float()
    dxhat = g * weight.float()
    d = x.shape[-1]
    dx = (dxhat - xhat * (dxhat * xhat).sum(-1, keepdim=True) / d - dxhat.sum(-1, keepdim=True) / d) * rstd[:, None]
    if residual_grad is not None:
        dx = dx + residual_grad.float()
    dw, db = (g * xhat).sum(0).to(weight.dtype), g.sum(0).to(bias.dtype)
    dx = dx.to(x.dtype)
    more = (residual_grad.float().sum(0),) if residual_grad_sum else ()
    if out is not None:
        for dst, src in zip(out, (dx, dw, db), strict=True):
            dst.copy_(src)
        return (*out, *more)
    return dx, dw, db, *more
