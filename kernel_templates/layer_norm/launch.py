"""The input LayerNorm's runtime launchers: ``norm_checks`` in front of the Triton kernels' launchers."""

from __future__ import annotations

import torch

from kernel_templates.norm_checks import finite_eps, param_grad_outs, row_stats, same_shape, vectors

from . import triton_layer_norm as _k
from .config import LayerNormBwdConfig, LayerNormFwdConfig


def _d(x: torch.Tensor) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, D), got shape {tuple(getattr(x, 'shape', ()))}")
    return x.shape[1]


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    config: LayerNormFwdConfig,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y = LN(x) in ``out_dtype`` (default x's, or ``out``'s), statistics fp32 of shape (rows,)."""
    weight, bias = vectors(_d(x), weight=weight, bias=bias)
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"out is {out.dtype} but out_dtype is {out_dtype}")
    return _k.layer_norm_fwd(x, weight, bias, finite_eps(eps), config=config, out_dtype=out_dtype, out=out)


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    config: LayerNormBwdConfig,
    residual_grad: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dx in x's dtype with ``residual_grad`` (x's shape) added when given."""
    d = _d(x)
    weight, bias = vectors(d, weight=weight, bias=bias)
    mean, rstd = row_stats(x.shape[0], mean=mean, rstd=rstd)
    same_shape("dy", dy, tuple(x.shape))
    param_grad_outs(out, d, 1)
    return _k.layer_norm_bwd(dy, x, weight, bias, mean, rstd, config=config, residual_grad=residual_grad, out=out)
