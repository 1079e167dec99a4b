"""Runtime launchers of ``dropout(LN(x) * u)``: ``launch_checks`` in front of the Triton kernels' launchers
(same signatures, keyword arguments passed through)."""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import (
    dropout_p,
    finite_eps,
    floating,
    grad_outs,
    out_rows,
    row_stats,
    same_shape,
    seed_tensor,
    vectors,
    width,
)

from . import triton_ln_mul_dropout as _k


def _inputs(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seed: torch.Tensor) -> list:
    """weight and bias checked (contiguous copies when strided); u of x's shape, all on x's device."""
    params = vectors(width(x), x.device, weight=weight, bias=bias)
    same_shape("u", u, tuple(x.shape))
    floating(x.device, u=u)
    seed_tensor(seed, x.device)
    return params


def ln_mul_dropout_fwd(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       p: float, seed: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """(out, mean, rstd) for 2-D x, u of shape (L, D) (rows may be strided, columns contiguous)."""
    weight, bias = _inputs(x, u, weight, bias, seed)
    if kw.get("out") is not None:
        out_rows("out", kw["out"], tuple(x.shape), x.device)
    return _k.ln_mul_dropout_fwd(x, u, weight, bias, finite_eps(eps), dropout_p(p), seed, **kw)


def ln_mul_dropout_bwd(
    do: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor, **kw: Any,
) -> tuple:  # fmt: skip
    """(dx, du, dweight, dbias); the dropout mask is redrawn from ``seed``."""
    weight, bias = _inputs(x, u, weight, bias, seed)
    mean, rstd = row_stats(x.shape[0], x.device, mean=mean, rstd=rstd)
    same_shape("dout", do, tuple(x.shape))
    floating(x.device, dout=do)
    grad_outs(kw.get("out"), tuple(x.shape), x.device, 2)
    return _k.ln_mul_dropout_bwd(do, x, u, weight, bias, mean, rstd, dropout_p(p), seed, **kw)
