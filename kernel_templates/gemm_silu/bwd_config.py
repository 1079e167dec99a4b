"""Config of the uvqk projection's backward (Triton SiLU' pass + cuBLAS GEMMs) and its resource model.

The elementwise pass computes d_pre = dy * silu'(pre) tile by tile and keeps one row of dbias
partial sums per program: a program walks ``rows_per_program`` rows of a ``block_n``-wide column
strip, ``block_m`` rows at a time. The two GEMMs (dx = d_pre W, dW = d_pre^T x) are cuBLAS's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import JsonConfig

MAX_TILE_ELEMS_PER_WARP = 1024


@dataclass(frozen=True)
class GemmSiluBwdConfig(JsonConfig):
    kind: ClassVar[str] = "gemm_silu_bwd"
    block_m: int = 16
    block_n: int = 256
    num_warps: int = 4
    row_programs_per_sm: int = 2  # programs along M per SM (each walks a contiguous row range)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.row_programs_per_sm not in (1, 2, 4, 8):
            raise ValueError(f"row_programs_per_sm must be 1, 2, 4 or 8, got {self.row_programs_per_sm}")


def check_bwd_config(config: GemmSiluBwdConfig, n: int) -> str | None:
    """Why the tile does not fit registers or leaves warps idle, or None."""
    tile = config.block_m * config.block_n
    if tile > MAX_TILE_ELEMS_PER_WARP * config.num_warps:
        return f"tile {config.block_m}x{config.block_n} exceeds {MAX_TILE_ELEMS_PER_WARP} elements per warp"
    if tile < 128 * config.num_warps:
        return f"tile {config.block_m}x{config.block_n} leaves warps idle"
    if config.block_n > max(16, 1 << (max(1, n) - 1).bit_length()):
        return f"block_n {config.block_n} wider than N={n}"
    return None


def default_bwd_config(n: int) -> GemmSiluBwdConfig:
    bn = min(256, max(16, 1 << (max(1, n) - 1).bit_length()))
    return GemmSiluBwdConfig(block_m=max(1, 4096 // bn), block_n=bn, num_warps=4, row_programs_per_sm=2)
