"""The ``torch`` backends of the uvqk projection: cuBLAS GEMMs and PyTorch elementwise ops.

Forward: ``F.silu(F.linear(x, W, b))`` (what the model ran before the fused kernel). Backward: the
pre-activation recomputed with one addmm (or taken from ``pre``), SiLU's derivative in fp32, then
dx = d_pre W, dW = d_pre^T x, db = sum of d_pre. Also the fp32 oracle of the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernel_templates.config_base import JsonConfig

from .reference import silu_grad


@dataclass(frozen=True)
class TorchGemmSiluConfig(JsonConfig):
    """The PyTorch composition has nothing to tune: one config, measured once per study."""

    kind: ClassVar[str] = "gemm_silu_torch"


def gemm_silu_fwd_torch(x, weight, bias, *, config=None, out=None):
    """cuBLAS addmm (bias fused) then an in-place SiLU pass."""
    if out is None:
        return F.silu(F.linear(x, weight, bias))
    torch.addmm(bias, x, weight.t(), out=out) if bias is not None else torch.mm(x, weight.t(), out=out)
    return F.silu(out, inplace=True)


def recompute_pre(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in the GEMM dtype (one cuBLAS call with the bias in its epilogue)."""
    return torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()


def gemm_silu_bwd_torch(dy, x, weight, bias, *, config=None, pre=None, out=None, done_cols=0, done_db=None):
    """(dx, dweight, dbias) of y = silu(x W^T + b); d_pre in the GEMM dtype, dbias summed in fp32.
    ``done_cols``: dy's first columns already hold d_pre (``done_db`` their fp32 bias gradient)."""
    pre = recompute_pre(x, weight, bias) if pre is None else pre
    c = done_cols
    d_pre = (dy[:, c:].float() * silu_grad(pre[:, c:])).to(x.dtype)
    db = d_pre.float().sum(0) if bias is not None else None
    if c:
        d_pre = torch.cat([dy[:, :c].to(x.dtype), d_pre], dim=1)
        db = None if db is None else torch.cat([done_db, db])
    db = None if db is None else db.to(bias.dtype)
    dx, dw = d_pre @ weight, d_pre.t() @ x
    if out is not None:
        for dst, src in zip(out, (dx, dw, db), strict=True):
            if dst is not None and src is not None:
                dst.copy_(src)
        return out
    return dx, dw, db


def gemm_silu_bwd_reference(dy, x, weight, bias, compute_dtype=torch.float32):
    """fp32 oracle (or PyTorch autograd in ``compute_dtype``) of the backward."""
    xs, ws = x.to(compute_dtype).detach().requires_grad_(True), weight.to(compute_dtype).detach().requires_grad_(True)
    bs = None if bias is None else bias.to(compute_dtype).detach().requires_grad_(True)
    with torch.enable_grad():
        y = F.silu(F.linear(xs, ws, bs))
        grads = torch.autograd.grad(y, [t for t in (xs, ws, bs) if t is not None], dy.to(compute_dtype))
    return grads[0], grads[1], grads[2] if bias is not None else None
