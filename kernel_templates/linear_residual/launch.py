"""Runtime launcher of ``out = residual + y W^T + b``: argument checks in front of ``impl.linear_residual``.

``torch.add`` / ``torch.addmm`` with ``out=`` resize a buffer of the wrong shape (with a warning) instead of
refusing it, integer activations are multiplied as integers, a weight of another dtype fails inside
cuBLAS with a RuntimeError, and an ``out`` over y or the weight is read after ``addmm`` wrote it (wrong
results): here each is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_templates.launch_checks import floating, outputs_apart, untracked

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
    # ``addmm(out=)`` reads y and the weight while it writes out: an out over either came back wrong without a word
    # (out over the residual is an in-place residual add, which both modes compute right).
    outputs_apart({"y": y, "weight": weight, "bias": bias}, {"out": out})
    result = _linear_residual(y, weight, bias, residual, **kw)
    # A residual narrower than y (fp16 beside an fp32 GEMM) would come back in the promoted dtype.
    return result if result.dtype == residual.dtype else result.to(residual.dtype)
