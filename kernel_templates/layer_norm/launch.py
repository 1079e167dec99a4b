"""The input LayerNorm's runtime launchers: ``launch_checks`` in front of the Triton kernels' launchers
(same signatures, keyword arguments passed through)."""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import (
    finite_eps,
    floating,
    grad_outs,
    out_rows,
    row_stats,
    same_shape,
    vectors,
    width,
)

from . import triton_layer_norm as _k


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, **kw: Any) -> tuple:
    """(y, mean, rstd): y = LN(x) in ``out_dtype`` (default x's, or ``out``'s), statistics fp32 of shape (rows,)."""
    weight, bias = vectors(width(x), x.device, weight=weight, bias=bias)
    out, out_dtype = kw.get("out"), kw.get("out_dtype")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype!r}")
    if out is not None:
        out_rows("out", out, tuple(x.shape), x.device)
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out is {out.dtype} but out_dtype is {out_dtype}")
    return _k.layer_norm_fwd(x, weight, bias, finite_eps(eps), **kw)


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """(dx, dweight, dbias); dx in x's dtype with ``residual_grad`` (x's shape) added when given."""
    weight, bias = vectors(width(x), x.device, weight=weight, bias=bias)
    mean, rstd = row_stats(x.shape[0], x.device, mean=mean, rstd=rstd)
    same_shape("dy", dy, tuple(x.shape))
    floating(x.device, dy=dy, residual_grad=kw.get("residual_grad"))
    grad_outs(kw.get("out"), tuple(x.shape), x.device, 1)
    return _k.layer_norm_bwd(dy, x, weight, bias, mean, rstd, **kw)
