"""Tile configuration of the CuTe DSL HSTU attention forward (Hopper sm90).

Frozen and hashable so it keys the compile cache and serialises to artifacts as plain JSON, like the
Triton configs. Structural checks live here; resource checks that depend on the head dims and dtype
(shared memory, registers) live in ``search_spaces/hstu_attention_cute.py`` and ``check_fwd_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import L2_GROUPS, JsonConfig

CUTE_HEAD_DIMS = (64, 128, 256)
SMEM_BYTES_SM90 = 227 * 1024
# Bytes the kernel keeps in shared memory besides the Q/K/V tiles (mbarriers, alignment padding).
SMEM_RESERVED_BYTES = 2048
SPLIT_PARTS = (1, 2, 3, 4)  # most parts a heavy query tile's key range is cut into (1: never cut)


@dataclass(frozen=True)
class HSTUCuteFwdConfig(JsonConfig):
    """Forward tiles of the warp-specialised TMA + wgmma kernel.

    ``block_m`` query rows per CTA, split over ``block_m // 64`` MMA warpgroups (wgmma M is 64 per
    warpgroup); one extra producer warpgroup issues the TMA loads. ``block_n`` keys per pipeline
    step, ``num_stages`` K/V buffers in flight. ``intra_wg_overlap`` issues the next Q K^T before
    the current P V so the SiLU math overlaps the tensor cores. ``l2_group`` sequence-heads launch
    together so their K/V is re-read from L2 (see ``schedule.py``). ``compact`` launches only the real
    tiles of a jagged batch, heaviest first, from a table built on the device (``tile_table.py``;
    ``l2_group`` then counts whole sequences' heads). ``tanh_silu`` computes silu(x) = h + h tanh(h), h = x/2,
    with one MUFU op (tanh.approx) per score instead of two (ex2, rcp). ``split_heavy`` > 1 (with
    ``compact``) cuts a query tile's key range into up to that many parts on separate CTAs when the
    batch's causal work is carried by a few long sequences (``tile_table.split_tile_table``); the last
    part to finish adds the others' fp32 partial outputs.
    """

    kind: ClassVar[str] = "hstu_attention_fwd_cute"
    block_m: int = 128
    block_n: int = 64
    num_stages: int = 2
    intra_wg_overlap: bool = True
    l2_group: int = 8
    compact: bool = False
    tanh_silu: bool = False
    split_heavy: int = 1

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128, 192):
            raise ValueError(
                f"HSTUCuteFwdConfig.block_m must be 64, 128 or 192 (64 rows per MMA warpgroup), got {self.block_m!r}"
            )
        if self.block_n not in (64, 96, 128, 160, 192, 256) or self.block_n % 16:
            raise ValueError(
                f"HSTUCuteFwdConfig.block_n must be one of 64, 96, 128, 160, 192, 256, got {self.block_n!r}"
            )
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"HSTUCuteFwdConfig.num_stages must be an int in [1, 6], got {self.num_stages!r}")
        if self.l2_group not in L2_GROUPS:
            raise ValueError(f"HSTUCuteFwdConfig.l2_group must be one of {L2_GROUPS}, got {self.l2_group!r}")
        if self.split_heavy not in SPLIT_PARTS:
            raise ValueError(f"HSTUCuteFwdConfig.split_heavy must be one of {SPLIT_PARTS}, got {self.split_heavy!r}")
        if self.split_heavy > 1 and not self.compact:
            raise ValueError("HSTUCuteFwdConfig.split_heavy > 1 needs compact=True (the split table is a compact one)")
        for name in ("intra_wg_overlap", "compact", "tanh_silu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HSTUCuteFwdConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def mma_warpgroups(self) -> int:
        return self.block_m // 64


def smem_bytes(config: HSTUCuteFwdConfig, dqk: int, dv: int, elem_bytes: int = 2) -> int:
    """Shared memory the forward needs: one Q tile and ``num_stages`` K and V tiles."""
    q = config.block_m * dqk
    kv = config.num_stages * config.block_n * (dqk + dv)
    return (q + kv) * elem_bytes + SMEM_RESERVED_BYTES


def accumulator_regs(config: HSTUCuteFwdConfig, dv: int) -> int:
    """32-bit registers per MMA thread held by the O and S accumulators and the P operand."""
    o = 64 * dv // 128
    s = 64 * config.block_n // 128
    p = s // 2
    return o + s + p


def check_fwd_config(
    config: HSTUCuteFwdConfig, dqk: int, dv: int, smem_limit: int = SMEM_BYTES_SM90, max_regs: int | None = None
) -> None:
    """Raise ``ValueError`` saying why ``config`` cannot run for these head dims (before compiling)."""
    if not isinstance(config, HSTUCuteFwdConfig):
        raise ValueError(f"config must be an HSTUCuteFwdConfig, got {type(config).__name__}")
    if dqk not in CUTE_HEAD_DIMS or dv not in CUTE_HEAD_DIMS:
        raise ValueError(f"CuTe HSTU forward supports head dims {CUTE_HEAD_DIMS}, got Dqk={dqk}, Dv={dv}")
    if dqk != dv:
        raise ValueError(f"CuTe HSTU forward needs Dqk == Dv, got Dqk={dqk}, Dv={dv}")
    need = smem_bytes(config, dqk, dv)
    if need > smem_limit:
        raise ValueError(
            f"config {config.to_dict()} needs {need} bytes of shared memory for D={dqk}, above the {smem_limit} limit"
        )
    if max_regs is None:
        max_regs = {1: 256, 2: 240, 3: 160}[config.mma_warpgroups]
    # Accumulators plus ~24 registers of addressing and mask state must fit the per-thread budget.
    regs = accumulator_regs(config, dv) + 24
    if regs > max_regs:
        raise ValueError(
            f"config {config.to_dict()} needs about {regs} registers per MMA thread for Dv={dv}, above {max_regs}"
        )
