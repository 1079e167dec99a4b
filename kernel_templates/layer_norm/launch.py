"""The input LayerNorm's runtime launchers: ``launch_checks`` in front of the Triton kernels' launchers and of
the torch backend (same signatures, keyword arguments passed through): the torch functions would broadcast a
short ``u`` or gradient, or resize an ``out`` of the wrong shape, without a word."""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import (
    config_of,
    dense_if_empty,
    fill_outs,
    finite_eps,
    floating,
    grad_outs,
    out_rows,
    outputs_apart,
    row_stats,
    same_shape,
    untracked,
    vectors,
    width,
)

from . import reference as _ref
from . import triton_layer_norm as _k
from .config import LayerNormBwdConfig, LayerNormFwdConfig

_BWD_OUTS = ("out[0]", "out[1]", "out[2]")


def _fwd_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, kw: dict) -> tuple:
    weight, bias = vectors(width(x), x.device, weight=weight, bias=bias)
    out, out_dtype = kw.get("out"), kw.get("out_dtype")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype!r}")
    if out is not None:
        out_rows("out", out, tuple(x.shape), x.device)
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out is {out.dtype} but out_dtype is {out_dtype}")
        outputs_apart({"x": x, "weight": weight, "bias": bias}, {"out": out})
    return weight, bias, finite_eps(eps)


def _bwd_args(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor, kw: dict) -> tuple:  # fmt: skip
    weight, bias = vectors(width(x), x.device, weight=weight, bias=bias)
    mean, rstd = row_stats(x.shape[0], x.device, mean=mean, rstd=rstd)
    same_shape("dy", dy, tuple(x.shape))
    if kw.get("residual_grad") is not None:
        same_shape("residual_grad", kw["residual_grad"], tuple(x.shape))
    floating(x.device, dy=dy, residual_grad=kw.get("residual_grad"))
    _k.check_residual_grad_sum(kw.get("residual_grad_sum", False), kw.get("residual_grad"))
    out = kw.get("out")
    grad_outs(out, tuple(x.shape), x.device, 1)
    if out is not None:
        inputs = {"dy": dy, "x": x, "weight": weight, "bias": bias, "mean": mean, "rstd": rstd}
        outputs_apart({**inputs, "residual_grad": kw.get("residual_grad")}, dict(zip(_BWD_OUTS, out, strict=True)))
    return weight, bias, mean, rstd


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, **kw: Any) -> tuple:
    """(y, mean, rstd): y = LN(x) in ``out_dtype`` (default x's, or ``out``'s), statistics fp32 of shape (rows,)."""
    x = dense_if_empty(x)
    args = _fwd_args(x, weight, bias, eps, kw)
    config_of(kw.get("config"), LayerNormFwdConfig)
    return _k.layer_norm_fwd(x, *args, **kw)


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """(dx, dweight, dbias); dx in x's dtype with ``residual_grad`` (x's shape) added when given; with
    ``residual_grad_sum`` a 4th result, residual_grad's fp32 column sum. No rows: an empty dx, zero dweight and
    dbias (whatever strides the empty inputs have)."""
    dy, x = dense_if_empty(dy), dense_if_empty(x)
    if "residual_grad" in kw:
        kw["residual_grad"] = dense_if_empty(kw["residual_grad"])
    args = _bwd_args(dy, x, weight, bias, mean, rstd, kw)
    config_of(kw.get("config"), LayerNormBwdConfig)
    return _k.layer_norm_bwd(dy, x, *args, **kw)


@untracked
def layer_norm_fwd_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, **kw: Any) -> tuple:
    """The torch backend (``reference.layer_norm_fwd_torch``) after the same checks."""
    return _ref.layer_norm_fwd_torch(x, *_fwd_args(x, weight, bias, eps, kw), **kw)


@untracked
def layer_norm_bwd_torch(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         mean: torch.Tensor, rstd: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """The torch backend (``reference.layer_norm_bwd_torch``) after the same checks; ``out`` as the Triton
    launcher takes it (dweight and dbias may be None)."""
    args = _bwd_args(dy, x, weight, bias, mean, rstd, kw)
    out = kw.pop("out", None)
    res = _ref.layer_norm_bwd_torch(dy, x, *args, **kw)
    return (*fill_outs(out, res[:3]), *res[3:])
