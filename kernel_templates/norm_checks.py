"""Argument checks of the LayerNorm-family launchers (input LayerNorm, LN(x) * u + dropout).

The Triton kernels read 1-D parameters and row statistics as contiguous arrays and trust the shapes of
the tensors they are given. These checks run in front of them (``<op>/launch.py``, the launchers the
specs name), so a strided weight is made contiguous instead of read wrongly, and a short ``dout``,
``mean`` or ``out`` buffer is a ``ValueError`` naming it instead of an out-of-bounds read.
"""

from __future__ import annotations

import math

import torch


def width(x: torch.Tensor) -> int:
    """D of a 2-D (rows, D) input, named ``x`` in the error otherwise."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, D), got shape {tuple(getattr(x, 'shape', ()))}")
    return x.shape[1]


def finite_eps(eps: object) -> float:
    """``eps`` as a float, when it is a positive finite number (NaN passes an ``eps <= 0`` test)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < float(eps) < math.inf:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return float(eps)


def vectors(d: int, **named: torch.Tensor) -> list[torch.Tensor]:
    """Each named 1-D tensor of shape (d,), contiguous (copied when strided: the kernels index it densely)."""
    out = []
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.shape != (d,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{' and '.join(named)} must have shape ({d},), got {name} {got}")
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


def row_stats(rows: int, **named: torch.Tensor) -> list[torch.Tensor]:
    """Each named statistics tensor float32 of shape (rows,), contiguous (copied when strided)."""
    out = []
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (rows,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must be float32 of shape ({rows},), got {got}")
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


def same_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', t)!r}")


def param_grad_outs(out: tuple | None, d: int, first: int) -> None:
    """The dweight / dbias buffers of an ``out`` tuple (from index ``first``): shape (d,) when given."""
    if out is None:
        return
    for i, t in enumerate(out[first:], first):
        if t is not None:
            same_shape(f"out[{i}]", t, (d,))
