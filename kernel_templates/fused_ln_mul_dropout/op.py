"""Custom ops, autograd function and public entry point of the fused ``dropout(LN(x) * u)``.

The Triton launches sit behind ``hstu::ln_mul_dropout_fwd/bwd`` custom ops (fake impls, and the
autograd function registered with ``register_autograd``) so torch.compile treats them as opaque
nodes instead of tracing into the launcher. Autograd saves the seed tensor, never the mask.
"""

from __future__ import annotations

import operator

import torch

from kernel_templates.launch_checks import dense, dropout_p, finite_eps, unit_columns

from .launch import ln_mul_dropout_bwd, ln_mul_dropout_fwd

_FWD_SCHEMA = (
    "(Tensor x, Tensor u, Tensor weight, Tensor bias, float eps, float p, Tensor seed) -> (Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor x, Tensor u, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, float p, Tensor seed)"
    " -> (Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("hstu::ln_mul_dropout_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def ln_mul_dropout_fwd_op(x, u, weight, bias, eps, p, seed):
    """(out, mean, rstd) of 2-D x, u."""
    return ln_mul_dropout_fwd(x, u, weight, bias, eps, p, seed)


@ln_mul_dropout_fwd_op.register_fake
def _(x, u, weight, bias, eps, p, seed):
    rows = x.shape[0]
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("hstu::ln_mul_dropout_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def ln_mul_dropout_bwd_op(dout, x, u, weight, bias, mean, rstd, p, seed):
    """(dx, du, dweight, dbias); the mask is redrawn from ``seed``."""
    return ln_mul_dropout_bwd(dout, x, u, weight, bias, mean, rstd, p, seed)


@ln_mul_dropout_bwd_op.register_fake
def _(dout, x, u, weight, bias, mean, rstd, p, seed):
    return x.new_empty(x.shape), u.new_empty(u.shape), torch.empty_like(weight), torch.empty_like(bias)


def _setup_context(ctx, inputs, output) -> None:
    x, u, weight, bias, _eps, p, seed = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, u, weight, bias, mean, rstd, seed)
    ctx.p = p


def _backward(ctx, dout, _dmean, _drstd):
    """Autograd of the fused op: the bwd op redraws the mask from the saved seed tensor."""
    x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dx, du, dw, db = ln_mul_dropout_bwd_op(dout.contiguous(), x, u, weight, bias, mean, rstd, ctx.p, seed)
    return dx, du, dw, db, None, None, None


ln_mul_dropout_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def fused_ln_mul_dropout(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    seed: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``dropout(LayerNorm(x) * u)`` in one kernel each way; LN over the last dim, stats in fp32.

    x and u must share a shape and dtype (cast under autocast first). The dropout seed is drawn on
    x's device from torch's generator when not given (``torch.manual_seed`` makes runs repeatable).
    """
    for name, t in (("x", x), ("u", u), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        dense(**{name: t})  # reshape failed inside torch on a sparse x
    if x.dim() < 1 or x.shape[-1] < 1:  # a 0-wide row has no mean (and reshape(-1, 0) failed inside torch)
        raise ValueError(f"x must have a last dimension of size >= 1 (LayerNorm runs over it), got {tuple(x.shape)}")
    if x.shape != u.shape:
        raise ValueError(f"x and u must share a shape, got {tuple(x.shape)} and {tuple(u.shape)}")
    if x.dtype != u.dtype:
        raise ValueError(f"x and u must share a dtype, got {x.dtype} and {u.dtype}")
    if weight.shape != (x.shape[-1],) or bias.shape != (x.shape[-1],):
        raise ValueError(f"weight and bias must have shape ({x.shape[-1]},)")
    p, eps = dropout_p(p), finite_eps(eps)  # checked in eval mode too; float(eps) took True, named no argument
    if not training:
        p = 0.0
    if seed is None:
        seed_t = (
            torch.randint(0, 2**31 - 1, (1,), device=x.device)
            if p > 0
            else torch.zeros(1, dtype=torch.int64, device=x.device)
        )
    elif isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.is_floating_point() or seed.is_complex() or seed.dtype == torch.bool:
            got = f"{seed.dtype} {tuple(seed.shape)}"
            raise ValueError(f"seed must be an int or a one-element integer tensor, got {got}")
        seed_t = seed.reshape(1).to(device=x.device, dtype=torch.int64)
    else:
        seed_t = torch.tensor([_int64_seed(seed)], dtype=torch.int64, device=x.device)
    d = x.shape[-1]
    x2, u2 = unit_columns(x.reshape(-1, d)), unit_columns(u.reshape(-1, d))
    out, _, _ = ln_mul_dropout_fwd_op(x2, u2, weight, bias, eps, p, seed_t)
    return out.view(x.shape)


def _int64_seed(seed: object) -> int:
    """``seed`` as the int64 the kernels draw from: an int (not a float, which int() would truncate, nor a bool, as
    the launchers refuse a bool seed tensor) in range."""
    try:
        if isinstance(seed, bool):
            raise TypeError
        value = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be an int or a one-element integer tensor, got {seed!r}") from None
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"seed must fit in int64 ([-2**63, 2**63)), got {value}")
    return value
