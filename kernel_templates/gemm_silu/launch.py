"""Runtime launchers of the uvqk projection's backward: argument checks in front of the Triton and torch
backends (same signatures, keyword arguments passed through).

The backends write dx and dW with ``torch.mm(..., out=)``, which resizes a buffer of the wrong shape (with a
warning) instead of refusing it, and at zero rows return a given dx buffer of any shape as it is; an integer
``pre`` is read as truncated values; an ``out`` buffer over an input (dx over x) is read after it is written.
These checks make each a ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import config_of, dense, floating, outputs_apart, untracked

from . import torch_impl as _torch
from . import triton_bwd as _triton
from .bwd_config import GemmSiluBwdConfig


def _gemm_operands(x: torch.Tensor, weight: torch.Tensor, **more: torch.Tensor | None) -> None:
    """x and weight 2-D floating tensors of one dtype, and ``more`` floating, all on x's device."""
    floating(x.device if isinstance(x, torch.Tensor) else torch.device("cpu"), x=x)
    floating(x.device, weight=weight, **more)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")


def check_bwd_args(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   pre: torch.Tensor | None, out: Any, done_cols: object = 0) -> None:  # fmt: skip
    """dtype, device and ``out`` rules of both backends (shapes of dy, pre and bias: ``triton_bwd._validate``).
    With ``done_cols`` d_pre is written over dy, which then needs memory of its own as an output does: over rows
    that share memory (an expanded dy) or over an operand the GEMMs read, the gradients came back wrong."""
    _gemm_operands(x, weight, dy=dy, bias=bias, pre=pre)
    if pre is None and bias is not None and bias.dtype != x.dtype:  # the recompute GEMM adds it in its epilogue
        raise ValueError(f"bias must be {x.dtype} like x to recompute the pre-activation, got {bias.dtype}")
    if done_cols and not isinstance(done_cols, bool):  # check_done_cols names a bad value
        outputs_apart({"x": x, "weight": weight, "bias": bias, "pre": pre}, {"dy (written with done_cols)": dy})
    if out is None:
        return
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ValueError(f"out must be a tuple (dx, dweight, dbias), got {got}")
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    for i, (t, shape) in enumerate(((out[0], (m, k)), (out[1], (n, k)))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"out[{i}] must be a {x.dtype} {shape} tensor on {x.device}, got {got}")
    dense(**{"out[0]": out[0], "out[1]": out[1]})
    if bias is None and out[2] is not None:
        raise ValueError("out[2] (dbias) must be None without a bias: it would be left unwritten")
    if bias is not None:
        if not isinstance(out[2], torch.Tensor) or tuple(out[2].shape) != (n,):
            raise ValueError(f"out[2] must be a ({n},) tensor, got {getattr(out[2], 'shape', out[2])!r}")
        floating(x.device, **{"out[2]": out[2]})
    # dx is written before dW = d_pre^T x is read from x (Triton backend): an out[0] over x came back wrong
    # without a word; so does any output over an operand read after it is written.
    outputs_apart(
        {"dy": dy, "x": x, "weight": weight, "bias": bias, "pre": pre},
        {"out[0]": out[0], "out[1]": out[1], "out[2]": out[2]},
    )


def gemm_silu_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  **kw: Any) -> tuple:  # fmt: skip
    """The Triton SiLU' pass + cuBLAS backward (``triton_bwd.gemm_silu_bwd``) after ``check_bwd_args``."""
    check_bwd_args(dy, x, weight, bias, kw.get("pre"), kw.get("out"), kw.get("done_cols", 0))
    config_of(kw.get("config"), GemmSiluBwdConfig, optional=True)
    return _triton.gemm_silu_bwd(dy, x, weight, bias, **kw)


@untracked
def gemm_silu_bwd_torch(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        **kw: Any) -> tuple:  # fmt: skip
    """The torch backward (``torch_impl.gemm_silu_bwd_torch``) after ``check_bwd_args`` and the shape checks."""
    check_bwd_args(dy, x, weight, bias, kw.get("pre"), kw.get("out"), kw.get("done_cols", 0))
    n = _triton._validate(dy, x, weight, bias, kw.get("pre"))[1]
    _triton.check_done_cols(kw.get("done_cols", 0), kw.get("done_db"), n, bias, dy.device, dy.dtype, x.dtype)
    return _torch.gemm_silu_bwd_torch(dy, x, weight, bias, **kw)


@untracked
def gemm_silu_fwd_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **kw: Any) -> torch.Tensor:
    """The torch forward (``torch_impl.gemm_silu_fwd_torch``: cuBLAS addmm, then SiLU) after the checks its
    ``out=`` path lacks (``torch.addmm`` resizes a wrong-shaped buffer with a warning, and reads an operand that
    an output overlaps after writing it); with ``pre_out`` the addmm writes the pre-activation there and SiLU
    reads it, writing ``out`` directly when given (no temporary and copy)."""
    _gemm_operands(x, weight, bias=bias)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be (N, K) with x's K = {x.shape[1]}, got {tuple(weight.shape)}")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"bias must be {x.dtype} like x (the GEMM dtype), got {bias.dtype}")
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    for name in ("out", "pre_out"):
        t = kw.get(name)
        if t is not None and (
            not isinstance(t, torch.Tensor) or tuple(t.shape) != (x.shape[0], n) or t.dtype != x.dtype
            or t.device != x.device
        ):  # fmt: skip
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must be a {x.dtype} {(x.shape[0], n)} tensor on {x.device}, got {got}")
        dense(**{name: t})
    out, pre_out = kw.get("out"), kw.pop("pre_out", None)
    outputs_apart({"x": x, "weight": weight, "bias": bias}, {"out": out, "pre_out": pre_out})
    if pre_out is None:
        return _torch.gemm_silu_fwd_torch(x, weight, bias, **kw)
    # The pre-activation kept too (the HSTU layer's backward reads it): addmm into it, then SiLU from it.
    torch.addmm(bias, x, weight.t(), out=pre_out) if bias is not None else torch.mm(x, weight.t(), out=pre_out)
    return torch.nn.functional.silu(pre_out) if out is None else torch.ops.aten.silu.out(pre_out, out=out)
