"""Search spaces of the uvqk projection's backward (Triton SiLU' pass) and of its torch backends.

Width N = 4 heads dqk (u, v, q, k); the resource rule is the template's (``check_bwd_config``).
"""

from __future__ import annotations

from kernel_templates.gemm_silu.bwd_config import GemmSiluBwdConfig, check_bwd_config, default_bwd_config
from kernel_templates.gemm_silu.torch_impl import TorchGemmSiluConfig
from search_spaces.base import SearchSpace, SpaceContext


def _n(ctx: SpaceContext) -> int:
    return 4 * ctx.num_heads * ctx.dqk


def tile_fits(c, ctx: SpaceContext) -> str | None:
    return check_bwd_config(c, _n(ctx))


def interpreter_small(c, ctx: SpaceContext) -> str | None:
    small = c.num_warps == 1 and c.block_m * c.block_n <= 256
    return None if not ctx.interpret or small else "interpreter: one warp, <= 256-element tiles"


def _default(ctx: SpaceContext) -> GemmSiluBwdConfig:
    return GemmSiluBwdConfig(4, 32, 1, 1) if ctx.interpret else default_bwd_config(_n(ctx))


def _torch_default(ctx: SpaceContext) -> TorchGemmSiluConfig:
    return TorchGemmSiluConfig()


GEMM_SILU_BWD_TRITON = SearchSpace(
    "gemm_silu_bwd/triton",
    GemmSiluBwdConfig,
    {
        "block_m": (1, 2, 4, 8, 16, 32),
        "block_n": (32, 64, 128, 256, 512),
        "num_warps": (1, 2, 4, 8),
        "row_programs_per_sm": (1, 2, 4, 8),
    },
    (tile_fits, interpreter_small),
    _default,
)
GEMM_SILU_TORCH = SearchSpace("gemm_silu/torch", TorchGemmSiluConfig, {}, (), _torch_default)
GEMM_SILU_BWD_TORCH = SearchSpace("gemm_silu_bwd/torch", TorchGemmSiluConfig, {}, (), _torch_default)
