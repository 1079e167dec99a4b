"""Search spaces of the fused ``dropout(LN(x) * u)`` kernels (Triton) and their torch backend.

Same tunables and resource rule as the LayerNorm kernels (one normalised row tile per program).
"""

from __future__ import annotations

from kernel_templates.fused_ln_mul_dropout.config import (
    LnMulDropoutBwdConfig,
    LnMulDropoutFwdConfig,
    default_bwd_config,
    default_fwd_config,
)
from kernel_templates.fused_ln_mul_dropout.torch_impl import TorchLnMulDropoutConfig
from search_spaces.base import SearchSpace, SpaceContext
from search_spaces.layer_norm_triton import interpreter_small, tile_fits


def _fwd_default(ctx: SpaceContext) -> LnMulDropoutFwdConfig:
    return LnMulDropoutFwdConfig(4, 1) if ctx.interpret else default_fwd_config(ctx.width)


def _bwd_default(ctx: SpaceContext) -> LnMulDropoutBwdConfig:
    return LnMulDropoutBwdConfig(4, 1, 4) if ctx.interpret else default_bwd_config(ctx.width)


def _torch_default(ctx: SpaceContext) -> TorchLnMulDropoutConfig:
    return TorchLnMulDropoutConfig()


_ROWS = (1, 2, 4, 8, 16)
_WARPS = (1, 2, 4, 8, 16)
LN_MUL_DROPOUT_FWD_TRITON = SearchSpace(
    "ln_mul_dropout_fwd/triton",
    LnMulDropoutFwdConfig,
    {"block_rows": _ROWS, "num_warps": _WARPS},
    (tile_fits, interpreter_small),
    _fwd_default,
)
LN_MUL_DROPOUT_BWD_TRITON = SearchSpace(
    "ln_mul_dropout_bwd/triton",
    LnMulDropoutBwdConfig,
    {"block_rows": _ROWS, "num_warps": _WARPS, "programs_per_sm": (2, 4, 8, 16)},
    (tile_fits, interpreter_small),
    _bwd_default,
)
LN_MUL_DROPOUT_FWD_TORCH = SearchSpace("ln_mul_dropout_fwd/torch", TorchLnMulDropoutConfig, {}, (), _torch_default)
LN_MUL_DROPOUT_BWD_TORCH = SearchSpace("ln_mul_dropout_bwd/torch", TorchLnMulDropoutConfig, {}, (), _torch_default)
