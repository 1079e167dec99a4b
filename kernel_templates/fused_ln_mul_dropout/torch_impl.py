"""The ``torch`` backend of ``dropout(LN(x) * u)``: PyTorch ops, the kernels' dropout mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernel_templates.config_base import JsonConfig
from kernel_templates.gemm_silu.reference import silu_grad

from .triton_ln_mul_dropout import dropout_keep_mask


@dataclass(frozen=True)
class TorchLnMulDropoutConfig(JsonConfig):
    kind: ClassVar[str] = "ln_mul_dropout_torch"


def ln_mul_dropout_fwd_torch(x, u, weight, bias, eps, p, seed, *, config=None, out=None):
    """(out, mean, rstd): LayerNorm in fp32, times u, the kernels' dropout mask."""
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps) if x.shape[0] else torch.empty(0, device=x.device)
    y = F.layer_norm(xf, (x.shape[-1],), weight.float(), bias.float(), eps) * u.float()
    if p > 0:
        y = torch.where(dropout_keep_mask(x.shape[0], x.shape[1], p, seed), y / (1.0 - p), 0.0)
    y = y.to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y, mean, rstd


def ln_mul_dropout_bwd_torch(do, x, u, weight, bias, mean, rstd, p, seed, *, config=None, out=None, silu_pre=None):
    """(dx, du, dweight, dbias) from the saved statistics, in fp32; with ``silu_pre`` (u = silu(silu_pre)) du
    through SiLU' and a fifth output, its fp32 column sums."""
    d = x.shape[-1]
    g = do.float()
    if p > 0:
        g = torch.where(dropout_keep_mask(x.shape[0], d, p, seed), g / (1.0 - p), 0.0)
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    y = xhat * weight.float() + bias.float()
    du = g * y
    dy = g * u.float()
    dxhat = dy * weight.float()
    dx = (dxhat - xhat * (dxhat * xhat).sum(-1, keepdim=True) / d - dxhat.sum(-1, keepdim=True) / d) * rstd[:, None]
    if silu_pre is not None:
        du = du * silu_grad(silu_pre)
    res = (dx.to(x.dtype), du.to(u.dtype), (dy * xhat).sum(0).to(weight.dtype), dy.sum(0).to(bias.dtype))
    if silu_pre is not None:
        res = (*res, res[1].float().sum(0))
    if out is not None:
        for dst, src in zip(out, res[:4], strict=True):
            dst.copy_(src)
        return tuple(out) + res[4:]
    return res
