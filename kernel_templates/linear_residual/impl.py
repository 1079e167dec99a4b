"""``out = residual + y W^T + b``: two cuBLAS formulations, chosen per shape by the tuner.

- ``linear_add``: ``F.linear`` (bias in the GEMM epilogue), then one add of the residual;
- ``addmm``: ``addmm(residual, y, W^T)`` (the residual read as the GEMM's C, beta = 1), then the
  bias added in place. It needs the residual in the GEMM's dtype; with a wider residual stream
  (fp32 under autocast) the call runs ``linear_add``.

The backward is plain GEMMs (dy = dout W, dW = dout^T y, db = sum of dout) and is not tuned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernel_templates.config_base import JsonConfig

MODES = ("linear_add", "addmm")


@dataclass(frozen=True)
class LinearResidualConfig(JsonConfig):
    kind: ClassVar[str] = "linear_residual"
    mode: str = "linear_add"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


def linear_residual(
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    config: LinearResidualConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + y W^T + b, in the residual's dtype."""
    if y.dim() != 2 or weight.dim() != 2 or weight.shape[1] != y.shape[1]:
        raise ValueError(f"y (M, K) and weight (N, K) must agree, got {tuple(y.shape)} and {tuple(weight.shape)}")
    m, n = y.shape[0], weight.shape[0]
    if residual.shape != (m, n):
        raise ValueError(f"residual must have shape ({m}, {n}), got {tuple(residual.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if config.mode == "addmm" and residual.dtype == y.dtype:
        res = torch.addmm(residual, y, weight.t(), out=out) if out is not None else torch.addmm(residual, y, weight.t())
        return res.add_(bias) if bias is not None else res
    res = (
        torch.add(residual, F.linear(y, weight, bias), out=out)
        if out is not None
        else residual + F.linear(y, weight, bias)
    )
    return res


def linear_residual_bwd(dout, y, weight, *, config=None, out=None):
    """(dy, dweight, dbias) in the GEMM dtype (dbias summed in fp32)."""
    g = dout.to(y.dtype)
    return g @ weight, g.t() @ y, g.float().sum(0).to(y.dtype)
