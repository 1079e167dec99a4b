"""Output projection + residual of the HSTU layer: ``out = residual + y W^T + b`` and its backward on cuBLAS.

The names exported here are the checked launchers (``launch``), as the other op packages export theirs: the
bare implementations in ``impl`` / ``bwd_impl`` take an ``out`` over y or the weight and return wrong values.
"""

from .bwd_impl import LinearResidualBwdConfig
from .impl import LinearResidualConfig
from .launch import linear_residual, linear_residual_bwd

__all__ = ["LinearResidualBwdConfig", "LinearResidualConfig", "linear_residual", "linear_residual_bwd"]
