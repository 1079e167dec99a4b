"""Search space of the output projection's backward: the order of its two cuBLAS GEMMs (``bwd_impl.ORDERS``)."""

from __future__ import annotations

from kernel_templates.linear_residual.bwd_impl import ORDERS, LinearResidualBwdConfig
from search_spaces.base import SearchSpace, SpaceContext


def streams_need_cuda(c: LinearResidualBwdConfig, ctx: SpaceContext) -> str | None:
    """Under the interpreter (CPU) ``side_stream`` runs ``serial``: a trial of it would time serial again."""
    return "no CUDA streams under the interpreter" if ctx.interpret and c.order == "side_stream" else None


def _default(ctx: SpaceContext) -> LinearResidualBwdConfig:
    return LinearResidualBwdConfig("serial")


LINEAR_RESIDUAL_BWD_TORCH = SearchSpace(
    "linear_residual_bwd/torch", LinearResidualBwdConfig, {"order": ORDERS}, (streams_need_cuda,), _default
)
