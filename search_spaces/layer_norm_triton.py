"""Search spaces of the LayerNorm kernels (Triton): rows per tile, warps, programs per SM (backward).

The resource rule is the template's own (``kernel_templates.layer_norm.config.check_config``); the
width is the layer's hidden size (heads x dv of the task).
"""

from __future__ import annotations

from kernel_templates.layer_norm.config import (
    LayerNormBwdConfig,
    LayerNormFwdConfig,
    check_config,
    default_bwd_config,
    default_fwd_config,
)
from search_spaces.base import SearchSpace, SpaceContext


def tile_fits(c, ctx: SpaceContext) -> str | None:
    return check_config(c, ctx.width)


def interpreter_small(c, ctx: SpaceContext) -> str | None:
    """Under the interpreter only the smallest tiles (seconds per launch otherwise)."""
    return "interpreter: one warp, <= 4 rows" if ctx.interpret and (c.num_warps > 1 or c.block_rows > 4) else None


def _fwd_default(ctx: SpaceContext) -> LayerNormFwdConfig:
    return LayerNormFwdConfig(4, 1) if ctx.interpret else default_fwd_config(ctx.width)


def _bwd_default(ctx: SpaceContext) -> LayerNormBwdConfig:
    return LayerNormBwdConfig(4, 1, 4) if ctx.interpret else default_bwd_config(ctx.width)


_ROWS = (1, 2, 4, 8, 16)
_WARPS = (1, 2, 4, 8, 16)
LAYER_NORM_FWD_TRITON = SearchSpace(
    "layer_norm_fwd/triton",
    LayerNormFwdConfig,
    {"block_rows": _ROWS, "num_warps": _WARPS},
    (tile_fits, interpreter_small),
    _fwd_default,
)
LAYER_NORM_BWD_TRITON = SearchSpace(
    "layer_norm_bwd/triton",
    LayerNormBwdConfig,
    {"block_rows": _ROWS, "num_warps": _WARPS, "programs_per_sm": (2, 4, 8, 16)},
    (tile_fits, interpreter_small),
    _bwd_default,
)


def _torch_default(ctx: SpaceContext):
    from kernel_templates.layer_norm.reference import TorchLayerNormConfig

    return TorchLayerNormConfig()


def _torch_space(name: str) -> SearchSpace:
    from kernel_templates.layer_norm.reference import TorchLayerNormConfig

    return SearchSpace(name, TorchLayerNormConfig, {}, (), _torch_default)


LAYER_NORM_FWD_TORCH = _torch_space("layer_norm_fwd/torch")
LAYER_NORM_BWD_TORCH = _torch_space("layer_norm_bwd/torch")
