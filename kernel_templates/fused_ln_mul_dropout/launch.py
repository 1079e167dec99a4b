"""Runtime launchers of ``dropout(LN(x) * u)``: ``norm_checks`` in front of the Triton kernels' launchers
(same signatures, keyword arguments passed through)."""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.norm_checks import finite_eps, param_grad_outs, row_stats, same_shape, vectors, width

from . import triton_ln_mul_dropout as _k


def ln_mul_dropout_fwd(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       p: float, seed: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """(out, mean, rstd) for 2-D x, u of shape (L, D) (rows may be strided, columns contiguous)."""
    weight, bias = vectors(width(x), weight=weight, bias=bias)
    if kw.get("out") is not None:
        same_shape("out", kw["out"], tuple(x.shape))
    return _k.ln_mul_dropout_fwd(x, u, weight, bias, finite_eps(eps), p, seed, **kw)


def ln_mul_dropout_bwd(
    do: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor, **kw: Any,
) -> tuple:  # fmt: skip
    """(dx, du, dweight, dbias); the dropout mask is redrawn from ``seed``."""
    weight, bias = vectors(width(x), weight=weight, bias=bias)
    mean, rstd = row_stats(x.shape[0], mean=mean, rstd=rstd)
    same_shape("dout", do, tuple(x.shape))
    param_grad_outs(kw.get("out"), x.shape[1], 2)
    return _k.ln_mul_dropout_bwd(do, x, u, weight, bias, mean, rstd, p, seed, **kw)
