"""Runtime launchers of ``dropout(LN(x) * u)``: ``norm_checks`` in front of the Triton kernels' launchers."""

from __future__ import annotations

import torch

from kernel_templates.norm_checks import finite_eps, param_grad_outs, row_stats, same_shape, vectors

from . import triton_ln_mul_dropout as _k
from .config import LnMulDropoutBwdConfig, LnMulDropoutFwdConfig


def _d(x: torch.Tensor) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be 2-D (L, D), got shape {tuple(getattr(x, 'shape', ()))}")
    return x.shape[1]


def ln_mul_dropout_fwd(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    seed: torch.Tensor,
    *,
    config: LnMulDropoutFwdConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, mean, rstd) for 2-D x, u of shape (L, D) (rows may be strided, columns contiguous)."""
    weight, bias = vectors(_d(x), weight=weight, bias=bias)
    if out is not None:
        same_shape("out", out, tuple(x.shape))
    return _k.ln_mul_dropout_fwd(x, u, weight, bias, finite_eps(eps), p, seed, config=config, out=out)


def ln_mul_dropout_bwd(
    do: torch.Tensor,
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    *,
    config: LnMulDropoutBwdConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, du, dweight, dbias); the dropout mask is redrawn from ``seed``."""
    d = _d(x)
    weight, bias = vectors(d, weight=weight, bias=bias)
    mean, rstd = row_stats(x.shape[0], mean=mean, rstd=rstd)
    same_shape("dout", do, tuple(x.shape))
    param_grad_outs(out, d, 2)
    return _k.ln_mul_dropout_bwd(do, x, u, weight, bias, mean, rstd, p, seed, config=config, out=out)
