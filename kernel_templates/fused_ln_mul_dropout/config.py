"""Configs of the fused ``dropout(LN(x) * u)`` kernels; the resource model is the LayerNorm one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import JsonConfig
from kernel_templates.layer_norm.config import LayerNormBwdConfig, LayerNormFwdConfig, block_d, check_config

__all__ = ["LnMulDropoutBwdConfig", "LnMulDropoutFwdConfig", "check_config", "default_bwd_config", "default_fwd_config"]


@dataclass(frozen=True)
class LnMulDropoutFwdConfig(JsonConfig):
    kind: ClassVar[str] = "ln_mul_dropout_fwd"
    block_rows: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        LayerNormFwdConfig(self.block_rows, self.num_warps)


@dataclass(frozen=True)
class LnMulDropoutBwdConfig(JsonConfig):
    kind: ClassVar[str] = "ln_mul_dropout_bwd"
    block_rows: int = 4
    num_warps: int = 4
    programs_per_sm: int = 8

    def __post_init__(self) -> None:
        LayerNormBwdConfig(self.block_rows, self.num_warps, self.programs_per_sm)


def _rows(d: int) -> int:
    return max(1, min(16, 4096 // block_d(d)))


def default_fwd_config(d: int) -> LnMulDropoutFwdConfig:
    """What the kernels ran before they were tunable: ~4K-element tiles, 4 warps up to 1024 wide."""
    return LnMulDropoutFwdConfig(_rows(d), 4 if block_d(d) <= 1024 else 8)


def default_bwd_config(d: int) -> LnMulDropoutBwdConfig:
    """About 1K elements a tile, 4 warps, 8 programs per SM: the H100 tuning's winner at width 1024
    (2.5x the 4K-element tiles)."""
    return LnMulDropoutBwdConfig(max(1, min(16, 1024 // block_d(d))), 4, 8)
