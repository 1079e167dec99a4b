"""Runtime launchers of ``out = residual + y W^T + b`` and its backward: argument checks in front of
``impl.linear_residual`` and ``bwd_impl.linear_residual_bwd``.

``torch.add`` / ``torch.addmm`` with ``out=`` resize a buffer of the wrong shape (with a warning) instead of
refusing it, integer activations are multiplied as integers, a weight of another dtype fails inside
cuBLAS with a RuntimeError, and an ``out`` over y or the weight is read after ``addmm`` wrote it (wrong
results): here each is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import config_of, dense, floating, outputs_apart, untracked

from .bwd_impl import LinearResidualBwdConfig
from .bwd_impl import linear_residual_bwd as _linear_residual_bwd
from .impl import LinearResidualConfig
from .impl import linear_residual as _linear_residual


@untracked
def linear_residual(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                    **kw: Any) -> torch.Tensor:  # fmt: skip
    """``impl.linear_residual`` (residual + y W^T + b, in the residual's dtype) after the checks above."""
    named = {"y": y, "weight": weight, "bias": bias, "residual": residual}
    floating(getattr(y, "device", None), anchor="y", **named)
    for name in ("weight", "bias"):
        if named[name] is not None and named[name].dtype != y.dtype:
            raise ValueError(f"{name} must be {y.dtype} like y (the GEMM dtype), got {named[name].dtype}")
    out = kw.get("out")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != residual.shape
        or out.dtype != residual.dtype
        or out.device != residual.device
    ):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)
        want = f"{residual.dtype} {tuple(residual.shape)} tensor on {residual.device}"
        raise ValueError(f"out must be a {want} like residual, got {got}")
    dense(out=out)
    # ``addmm(out=)`` reads y and the weight while it writes out: an out over either came back wrong without a word.
    # out as the residual itself is an in-place residual add, which both modes compute right; an out over part of
    # it (rows shifted, a transpose) failed inside torch with an error naming neither.
    inputs = {"y": y, "weight": weight, "bias": bias}
    if out is not None and (out.data_ptr(), out.stride()) != (residual.data_ptr(), residual.stride()):
        inputs["residual"] = residual
    outputs_apart(inputs, {"out": out})
    config_of(kw.get("config"), LinearResidualConfig)
    result = _linear_residual(y, weight, bias, residual, **kw)
    # A residual narrower than y (fp16 beside an fp32 GEMM) would come back in the promoted dtype.
    return result if result.dtype == residual.dtype else result.to(residual.dtype)


@untracked
def linear_residual_bwd(dout: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                        **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``bwd_impl.linear_residual_bwd`` ((dy, dweight) in y's dtype) after the checks its ``torch.mm(out=)`` lacks:
    a buffer of the wrong shape was resized with a warning, one over an operand read after it was written."""
    floating(getattr(y, "device", None), anchor="y", y=y, dout=dout, weight=weight)
    if weight.dtype != y.dtype:
        raise ValueError(f"weight must be {y.dtype} like y (the GEMM dtype), got {weight.dtype}")
    if y.dim() != 2 or weight.dim() != 2 or weight.shape[1] != y.shape[1]:
        raise ValueError(f"y (M, K) and weight (N, K) must agree, got {tuple(y.shape)} and {tuple(weight.shape)}")
    m, k, n = y.shape[0], y.shape[1], weight.shape[0]
    if tuple(dout.shape) != (m, n):
        raise ValueError(f"dout must have shape ({m}, {n}) (y's rows, weight's rows), got {tuple(dout.shape)}")
    out, pending = kw.get("out"), kw.get("pending")
    if pending is not None and not isinstance(pending, list):
        raise ValueError(f"pending must be a list (it receives events) or None, got {type(pending).__name__}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
            raise ValueError(f"out must be a pair (dy, dweight), got {got}")
        for i, (t, shape) in enumerate(((out[0], (m, k)), (out[1], (n, k)))):
            if t is not None and (
                not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != y.dtype
                or t.device != y.device
            ):  # fmt: skip
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
                raise ValueError(f"out[{i}] must be a {y.dtype} {shape} tensor on {y.device}, got {got}")
        dense(**{"out[0]": out[0], "out[1]": out[1]})
        outputs_apart({"dout": dout, "y": y, "weight": weight}, {"out[0]": out[0], "out[1]": out[1]})
    config_of(kw.get("config"), LinearResidualBwdConfig)
    return _linear_residual_bwd(dout, y, weight, **kw)
