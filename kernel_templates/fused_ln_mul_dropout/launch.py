"""Runtime launchers of ``dropout(LN(x) * u)``: ``launch_checks`` in front of the Triton kernels' launchers and
of the torch backend (same signatures, keyword arguments passed through): the torch functions would broadcast a
short ``u`` or take a dropout probability outside [0, 1) without a word."""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import (
    config_of,
    dense_if_empty,
    dropout_p,
    fill_outs,
    finite_eps,
    floating,
    grad_outs,
    out_rows,
    outputs_apart,
    row_stats,
    same_shape,
    seed_tensor,
    untracked,
    vectors,
    width,
)

from . import torch_impl as _torch
from . import triton_ln_mul_dropout as _k
from .config import LnMulDropoutBwdConfig, LnMulDropoutFwdConfig

_BWD_OUTS = ("out[0]", "out[1]", "out[2]", "out[3]")


def _inputs(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seed: torch.Tensor) -> list:
    """weight and bias checked (contiguous copies when strided); u of x's shape, all on x's device."""
    params = vectors(width(x), x.device, weight=weight, bias=bias)
    same_shape("u", u, tuple(x.shape))
    floating(x.device, u=u)
    seed_tensor(seed, x.device)
    return params


def _fwd_args(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, p: float,
              seed: torch.Tensor, kw: dict) -> tuple:  # fmt: skip
    weight, bias = _inputs(x, u, weight, bias, seed)
    if kw.get("out") is not None:
        out_rows("out", kw["out"], tuple(x.shape), x.device)
        outputs_apart({"x": x, "u": u, "weight": weight, "bias": bias, "seed": seed}, {"out": kw["out"]})
    return weight, bias, finite_eps(eps), dropout_p(p)


def _bwd_args(do: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor, kw: dict) -> tuple:  # fmt: skip
    weight, bias = _inputs(x, u, weight, bias, seed)
    mean, rstd = row_stats(x.shape[0], x.device, mean=mean, rstd=rstd)
    same_shape("dout", do, tuple(x.shape))
    floating(x.device, dout=do)
    out = kw.get("out")
    grad_outs(out, tuple(x.shape), x.device, 2)
    if kw.get("silu_pre") is not None:
        same_shape("silu_pre", kw["silu_pre"], tuple(x.shape))
        floating(x.device, silu_pre=kw["silu_pre"])
    if out is not None:
        inputs = {"dout": do, "x": x, "u": u, "weight": weight, "bias": bias, "mean": mean, "rstd": rstd}
        inputs.update(seed=seed, silu_pre=kw.get("silu_pre"))
        outputs_apart(inputs, dict(zip(_BWD_OUTS, out, strict=True)))
    return weight, bias, mean, rstd, dropout_p(p)


def ln_mul_dropout_fwd(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                       p: float, seed: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """(out, mean, rstd) for 2-D x, u of shape (L, D) (rows may be strided, columns contiguous)."""
    x, u = dense_if_empty(x), dense_if_empty(u)
    weight, bias, eps, p = _fwd_args(x, u, weight, bias, eps, p, seed, kw)
    config_of(kw.get("config"), LnMulDropoutFwdConfig, optional=True)
    return _k.ln_mul_dropout_fwd(x, u, weight, bias, eps, p, seed, **kw)


def ln_mul_dropout_bwd(
    do: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor, **kw: Any,
) -> tuple:  # fmt: skip
    """(dx, du, dweight, dbias); the dropout mask is redrawn from ``seed``. With ``silu_pre`` (u = silu(silu_pre)):
    du through SiLU' and a fifth output, its fp32 column sums (``triton_ln_mul_dropout.ln_mul_dropout_bwd``)."""
    do, x, u = dense_if_empty(do), dense_if_empty(x), dense_if_empty(u)
    if "silu_pre" in kw:
        kw["silu_pre"] = dense_if_empty(kw["silu_pre"])
    weight, bias, mean, rstd, p = _bwd_args(do, x, u, weight, bias, mean, rstd, p, seed, kw)
    config_of(kw.get("config"), LnMulDropoutBwdConfig, optional=True)
    return _k.ln_mul_dropout_bwd(do, x, u, weight, bias, mean, rstd, p, seed, **kw)


@untracked
def ln_mul_dropout_fwd_torch(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                             p: float, seed: torch.Tensor, **kw: Any) -> tuple:  # fmt: skip
    """The torch backend (``torch_impl.ln_mul_dropout_fwd_torch``) after the same checks."""
    weight, bias, eps, p = _fwd_args(x, u, weight, bias, eps, p, seed, kw)
    return _torch.ln_mul_dropout_fwd_torch(x, u, weight, bias, eps, p, seed, **kw)


@untracked
def ln_mul_dropout_bwd_torch(
    do: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: torch.Tensor, **kw: Any,
) -> tuple:  # fmt: skip
    """The torch backend (``torch_impl.ln_mul_dropout_bwd_torch``) after the same checks; ``out`` as the Triton
    launcher takes it (dweight and dbias may be None)."""
    weight, bias, mean, rstd, p = _bwd_args(do, x, u, weight, bias, mean, rstd, p, seed, kw)
    out = kw.pop("out", None)
    res = _torch.ln_mul_dropout_bwd_torch(do, x, u, weight, bias, mean, rstd, p, seed, **kw)
    return (*fill_outs(out, res[:4]), *res[4:])
