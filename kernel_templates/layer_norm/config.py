"""Configs of the LayerNorm kernels and their resource model (the search space imports it).

A program normalises ``block_rows`` rows of the full width (``BLOCK_D`` = next power of two of D):
the tile lives in registers, so ``block_rows * BLOCK_D`` is bounded per warp count. The backward
walks ``rows_per_program`` rows per program (a multiple of ``block_rows``) and keeps one row of
dweight/dbias partial sums per program, summed by one small reduction afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import JsonConfig

MAX_TILE_ELEMS_PER_WARP = 1024  # fp32 elements of the row tile per warp (32 lanes x 32 registers)


def block_d(d: int) -> int:
    """Width of the row tile: D padded to a power of two (the kernel masks the tail)."""
    return max(16, 1 << (max(1, d) - 1).bit_length())


@dataclass(frozen=True)
class LayerNormFwdConfig(JsonConfig):
    kind: ClassVar[str] = "layer_norm_fwd"
    block_rows: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows must be a power of two >= 1, got {self.block_rows}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


@dataclass(frozen=True)
class LayerNormBwdConfig(JsonConfig):
    kind: ClassVar[str] = "layer_norm_bwd"
    block_rows: int = 4
    num_warps: int = 4
    programs_per_sm: int = 8  # grid = programs_per_sm x SMs programs, each a contiguous row range

    def __post_init__(self) -> None:
        LayerNormFwdConfig(self.block_rows, self.num_warps)
        if self.programs_per_sm not in (1, 2, 4, 8, 16):
            raise ValueError(f"programs_per_sm must be 1, 2, 4, 8 or 16, got {self.programs_per_sm}")


def check_config(config: LayerNormFwdConfig | LayerNormBwdConfig, d: int) -> str | None:
    """Why ``config`` cannot run well at width ``d`` (register tile too large or too thin), or None."""
    tile = config.block_rows * block_d(d)
    if tile > MAX_TILE_ELEMS_PER_WARP * config.num_warps:
        return f"tile {config.block_rows}x{block_d(d)} exceeds {MAX_TILE_ELEMS_PER_WARP} elements per warp"
    if tile < 32 * config.num_warps:
        return f"tile {config.block_rows}x{block_d(d)} leaves warps idle ({config.num_warps} warps)"
    return None


def _rows_for(d: int) -> int:
    """About 4K elements a tile: enough bytes in flight per program without spilling."""
    return max(1, min(16, 4096 // block_d(d)))


def default_fwd_config(d: int) -> LayerNormFwdConfig:
    rows = _rows_for(d)
    return LayerNormFwdConfig(block_rows=rows, num_warps=4 if rows * block_d(d) <= 4096 else 8)


def default_bwd_config(d: int) -> LayerNormBwdConfig:
    """About 1K elements a tile and 8 programs per SM: the H100 tuning's winner at width 1024
    (block_rows 1, 4 warps; 2.0x the 4K-element tiles at 32K-262K rows)."""
    return LayerNormBwdConfig(block_rows=max(1, min(16, 1024 // block_d(d))), num_warps=4, programs_per_sm=8)
