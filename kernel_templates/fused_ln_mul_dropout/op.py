"""Autograd function and public entry point of the fused ``dropout(LN(x) * u)``."""

from __future__ import annotations

import torch

from .triton_ln_mul_dropout import ln_mul_dropout_bwd, ln_mul_dropout_fwd


class FusedLNMulDropout(torch.autograd.Function):
    """Saves x, u, the per-row mean/rstd and the seed; never the dropout mask."""

    @staticmethod
    def forward(ctx, x, u, weight, bias, eps: float, p: float, seed: int):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        u2 = u.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if u2.stride(-1) != 1:
            u2 = u2.contiguous()
        out, mean, rstd = ln_mul_dropout_fwd(x2, u2, weight, bias, eps, p, seed)
        ctx.save_for_backward(x2, u2, weight, bias, mean, rstd)
        ctx.p, ctx.seed, ctx.shape = p, seed, shape
        return out.view(shape)

    @staticmethod
    def backward(ctx, do):
        x2, u2, weight, bias, mean, rstd = ctx.saved_tensors
        dx, du, dw, db = ln_mul_dropout_bwd(do.reshape(x2.shape), x2, u2, weight, bias, mean, rstd, ctx.p, ctx.seed)
        return dx.view(ctx.shape), du.view(ctx.shape), dw, db, None, None, None


def fused_ln_mul_dropout(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = True,
    seed: int | None = None,
) -> torch.Tensor:
    """``dropout(LayerNorm(x) * u)`` in one kernel each way; LN over the last dim, stats in fp32.

    x and u must share a shape and dtype (cast under autocast first). The dropout seed is drawn
    from torch's CPU generator when not given, so ``torch.manual_seed`` makes runs repeatable.
    """
    if x.shape != u.shape:
        raise ValueError(f"x and u must share a shape, got {tuple(x.shape)} and {tuple(u.shape)}")
    if x.dtype != u.dtype:
        raise ValueError(f"x and u must share a dtype, got {x.dtype} and {u.dtype}")
    if weight.shape != (x.shape[-1],) or bias.shape != (x.shape[-1],):
        raise ValueError(f"weight and bias must have shape ({x.shape[-1]},)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    p = float(p) if training else 0.0
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if p > 0 else 0
    return FusedLNMulDropout.apply(x, u, weight, bias, float(eps), p, int(seed))
