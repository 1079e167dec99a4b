"""Output projection + residual of the HSTU layer: ``out = residual + y W^T + b`` on cuBLAS."""

from .impl import LinearResidualConfig, linear_residual

__all__ = ["LinearResidualConfig", "linear_residual"]
