"""Search space of the output projection + residual: which cuBLAS formulation (``impl.MODES``)."""

from __future__ import annotations

from kernel_templates.linear_residual.impl import MODES, LinearResidualConfig
from search_spaces.base import SearchSpace, SpaceContext


def _default(ctx: SpaceContext) -> LinearResidualConfig:
    return LinearResidualConfig("linear_add")


LINEAR_RESIDUAL_TORCH = SearchSpace("linear_residual_fwd/torch", LinearResidualConfig, {"mode": MODES}, (), _default)
