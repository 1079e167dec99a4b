"""Output projection + residual of the HSTU layer: ``out = residual + y W^T + b`` and its backward on cuBLAS."""

from .bwd_impl import LinearResidualBwdConfig, linear_residual_bwd
from .impl import LinearResidualConfig, linear_residual

__all__ = ["LinearResidualBwdConfig", "LinearResidualConfig", "linear_residual", "linear_residual_bwd"]
